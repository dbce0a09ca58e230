"""A checkpoint's scope and rollout set, read from the journal's rollouts (protocol: "Coordination").

The controller, not the participants, says which episodes a checkpoint continues:

- :func:`journal_scope` is the commit scope every member commits, the environments included: each
  rollout ``dispatched`` at its attempt (its episode may be live), and each rollout ``pending``
  with ``restored_on`` set (restored, its replacement not sent yet), named by that replacement
  attempt, so a checkpoint right after a restore keeps the restored boundary on every participant.
  The caller leaves out the restarts the prepares reported.
- A ``/run`` reply may already be on the wire when a checkpoint is prepared. Before it builds the
  checkpoint's rollout set the controller waits for the outstanding ``/run`` calls whose episode is
  neither among the episodes the environments committed nor a restart (:func:`unsettled_runs`);
  restarts are not waited for, they run on through the checkpoint.
- :func:`rollout_set` is then what the checkpoint continues: the scoped rollouts whose row is still
  at the scoped attempt, in flight or restored (a reply that arrived during the wait ended it), and
  the rollouts submitted and not dispatched yet. A restore continues exactly the first list.

Nothing here writes; dispatch is paused while a checkpoint is open, so the rows read here change
only by replies to ``/run`` calls already sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from journal import models
from workers.protocol import capture_key, split_capture_key

from engine.workflows.checkpoint.open_calls import SETTLED as _SETTLED

#: The rollout state whose attempt a checkpoint continues (and ``pending`` with ``restored_on``).
IN_FLIGHT = "dispatched"


async def journal_scope(conn: Any) -> list[str]:
    """The capture keys of every rollout a checkpoint taken now would continue, sorted."""
    t = models.rollouts
    rows = (await conn.execute(sa.select(t.c.id, t.c.attempt).where(sa.or_(
        t.c.state == IN_FLIGHT, sa.and_(t.c.state == "pending", t.c.restored_on.is_not(None)))))).all()
    return sorted(capture_key(r.id, r.attempt) for r in rows)


async def unsettled_runs(conn: Any, keys: Iterable[str]) -> list[str]:
    """Those of ``keys`` whose rollout's current ``/run`` (an outbox intent of this orchestrator) has
    not settled yet. A row sent by a caller's own code has no ``run_call``: nothing to wait for."""
    wanted = dict(map(split_capture_key, keys))
    if not wanted:
        return []
    t, c = models.rollouts, models.rpc_calls
    out: list[str] = []
    ids = sorted(wanted)
    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite's variable limit)
        rows = (await conn.execute(
            sa.select(t.c.id, t.c.attempt).select_from(t.join(c, c.c.id == t.c.run_call))
            .where(t.c.id.in_(ids[i:i + 500]), t.c.state == IN_FLIGHT, c.c.state.not_in(_SETTLED)))).all()
        out += [capture_key(r.id, r.attempt) for r in rows if wanted.get(r.id) == r.attempt]
    return sorted(out)


def episode_json(key: str) -> dict[str, Any]:
    """A capture key as the protocol's episode object (``EpisodeId.model_dump()``, without the model)."""
    rollout_id, attempt = split_capture_key(key)
    return {"rollout_id": rollout_id, "attempt": attempt}


#: Most not-dispatched rollout ids a checkpoint lists (oldest first; the count is always exact), so
#: a dataset of millions submitted ahead keeps the manifest far under the size a restore reads.
NOT_DISPATCHED_LISTED = 10_000


@dataclass(frozen=True)
class RolloutSet:
    """What a checkpoint continues (capture keys) and what was not dispatched yet (the count, and
    the ids of up to :data:`NOT_DISPATCHED_LISTED` of them, oldest first)."""

    continued: list[str]
    not_dispatched: list[str]
    not_dispatched_count: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"continued": [episode_json(k) for k in self.continued],
                "not_dispatched": self.not_dispatched,
                "not_dispatched_count": max(self.not_dispatched_count, len(self.not_dispatched))}

    def as_row(self) -> dict[str, Any]:
        """The ``checkpoints.rollouts`` value (capture keys, as :meth:`from_row` reads them back)."""
        return {"continued": self.continued, "not_dispatched": self.not_dispatched,
                "not_dispatched_count": max(self.not_dispatched_count, len(self.not_dispatched))}

    @classmethod
    def from_row(cls, value: dict[str, Any]) -> RolloutSet:
        return cls(list(value["continued"]), list(value["not_dispatched"]),
                   int(value.get("not_dispatched_count", len(value["not_dispatched"]))))


async def rollout_set(conn: Any, scope: Sequence[str]) -> RolloutSet:
    """The scoped rollouts still at the scoped attempt, in flight or restored, and every rollout ``pending``
    that no restore pinned (submitted or queued as its next attempt, not sent yet)."""
    t = models.rollouts
    wanted = dict(map(split_capture_key, scope))
    ids = sorted(wanted)
    continued: list[str] = []
    seen: set[str] = set()
    for i in range(0, len(ids), 500):
        for r in (await conn.execute(sa.select(t.c.id, t.c.state, t.c.attempt, t.c.restored_on)
                                     .where(t.c.id.in_(ids[i:i + 500])))).all():
            seen.add(r.id)
            # Anything else ended the attempt during the wait: finished, errored, or refused before it
            # started (back to pending unpinned: it is not dispatched, and nothing of it was kept).
            live = r.state == IN_FLIGHT or (r.state == "pending" and r.restored_on is not None)
            if live and r.attempt == wanted[r.id]:
                continued.append(capture_key(r.id, r.attempt))
    # A scoped episode with no row at all (a caller's own, recorded by nobody) stays continued.
    continued += [capture_key(rid, attempt) for rid, attempt in wanted.items() if rid not in seen]
    waiting = sa.and_(t.c.state == "pending", t.c.restored_on.is_(None))
    pending = (await conn.execute(sa.select(t.c.id).where(waiting).order_by(t.c.created_at, t.c.id)
                                  .limit(NOT_DISPATCHED_LISTED))).scalars().all()
    count = len(pending) if len(pending) < NOT_DISPATCHED_LISTED else int(
        (await conn.execute(sa.select(sa.func.count()).select_from(t).where(waiting))).scalar_one())
    return RolloutSet(sorted(continued), list(pending), count)


__all__ = ["IN_FLIGHT", "NOT_DISPATCHED_LISTED", "RolloutSet", "episode_json", "journal_scope", "rollout_set",
           "unsettled_runs"]
