"""The retire and forget workflow, callers first (and the fan-out helpers the restore shares).

A ``retirements`` row is one retire or forget request (:func:`request_retirement`):

- ``queued`` while a checkpoint or a restore is open (participants refuse retire
  and forget then, ``invalid_phase``) or while an earlier retirement is not
  finished (requests run one at a time, oldest first); looked at again every
  ``poll_s``, and the oldest waiting one at once when a retirement, a checkpoint or a restore ends. A forget naming a rollout whose row is still live (:data:`LIVE_ROLLOUT`:
  ``pending``, ``dispatched``, ``restart``, ``retiring``, ``ambiguous``, ``errored``) is
  refused here: ``failed``, the detail naming them, nothing sent. A retire moves the ``dispatched``/``restart`` rollout rows it
  covers to ``retiring`` in the same write as ``queued -> running``.
- ``running``: one stage at a time in :data:`RETIRE_ORDER` (environment, then
  agent, then model and resources; ``stage`` is the index, advanced with the
  ``running -> running`` self-edge, so each stage's calls are new intents).
  Every participant of the stage gets ``POST retire {checkpoint_id,
  deadline_ts, episode_ids}`` or ``POST forget {checkpoint_id, deadline_ts,
  rollout_ids}``; ``checkpoint_id`` is ``<op>-<12 hex of the row id>`` and the
  deadline is the stage's start plus ``retire_timeout_s``. A stage whose
  participant is ``unreachable`` or not probed yet (``pending``: its kind is
  not known, so it may be of the stage) waits for it, looking again every
  ``poll_s``, instead of going on without it; still missing at the deadline,
  the retirement ``failed``, naming each.
- ``done`` once every stage succeeded (retire: ``retiring -> retired``; forget:
  ``finished``/``failed``/``retired -> forgotten``, in the same write); ``failed`` with every
  participant error of the first stage that had one. A failed retire leaves its
  marks on the participants that applied it (marks are only removed by forget)
  and its rollout rows ``retiring``; a new retire request finishes them.

Every call is an outbox intent owned by the row at its state and version, so
reconciling again finds the same calls, and a finished call wakes the row.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import ValidationError

from journal import Committed, Transition, WriteTx, models, outbox
from journal.machines import CHECKPOINTS, RESTORES, RETIREMENTS
from journal.writes import Row, to_row
from workers.protocol import EpisodeId

from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.checkpoint.fanout import Member, control_intent, fan_out, healthy, participant_rows, read_calls
from engine.workflows.checkpoint.rules import open_workflow

log = logging.getLogger("tidelog.retirement")

KIND = "retirements"
ROLLOUTS = "rollouts"
#: Callers before callees.
RETIRE_ORDER: tuple[tuple[str, ...], ...] = (("environment",), ("agent",), ("model", "resources"))
#: Participant states a stage waits out (a briefly unreachable server, one not probed yet).
AWAITED = ("pending", "unreachable")
#: Rollout states in which an attempt may still run, or the rollout will run again.
LIVE_ROLLOUT = ("pending", "dispatched", "restart", "retiring", "ambiguous", "errored")
Op = Literal["retire", "forget"]


class InvalidRetirement(ValueError):
    """A retire or forget request that cannot be queued; ``field`` names the argument at fault."""

    def __init__(self, field_name: str, detail: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {detail}")


@dataclass(frozen=True)
class RetirementSettings:
    retire_timeout_s: float = 60.0
    poll_s: float = 0.5


# -- requests ---------------------------------------------------------------------------------------

async def request_retirement(tx: WriteTx, retirement_id: str, op: Op, *, episodes: Sequence[EpisodeId] = (),
                             rollout_ids: Sequence[str] = ()) -> None:
    """Queue a retire of ``episodes`` (each attempt and every earlier one) or a forget of ``rollout_ids``.

    Raises :class:`InvalidRetirement` (a ``ValueError``) naming the argument: an
    unknown ``op``, a retire without episodes or with rollout ids, a forget
    without rollout ids or with episodes, or a rollout id the protocol refuses.
    """
    if op == "retire":
        if rollout_ids:
            raise InvalidRetirement("rollout_ids", "a retire names episodes, not rollout ids")
        if not episodes:
            raise InvalidRetirement("episodes", "a retire needs at least one episode")
        if not all(isinstance(e, EpisodeId) for e in episodes):
            raise InvalidRetirement("episodes", "every episode must be an EpisodeId")
        unique = {e.capture_key: e for e in episodes}
        episode_ids: list[dict[str, Any]] | None = [unique[k].model_dump() for k in sorted(unique)]
        ids = sorted({e.rollout_id for e in episodes})
    elif op == "forget":
        if episodes:
            raise InvalidRetirement("episodes", "a forget names rollout ids, not episodes")
        if not rollout_ids:
            raise InvalidRetirement("rollout_ids", "a forget needs at least one rollout id")
        for rollout_id in rollout_ids:
            try:
                EpisodeId(rollout_id=rollout_id)
            except ValidationError as exc:
                raise InvalidRetirement("rollout_ids", f"{rollout_id!r}: {exc.errors()[0]['msg']}") from None
        episode_ids, ids = None, sorted(set(rollout_ids))
    else:
        raise InvalidRetirement("op", f"{op!r} is neither 'retire' nor 'forget'")
    await tx.create(KIND, retirement_id, reason=f"{op} of {len(ids)} rollout(s) requested",
                    values={"op": op, "rollout_ids": ids, "episode_ids": episode_ids, "stage": 0})


def wire_id(row: Row) -> str:
    """The ``checkpoint_id`` a retirement's calls carry: valid, fixed for the row, never a checkpoint's."""
    return f"{row['op']}-{hashlib.sha256(row.id.encode()).hexdigest()[:12]}"


class RetirementController(BaseController):
    """Runs ``retirements`` rows (see the module docstring)."""

    kind = KIND

    def __init__(self, settings: RetirementSettings | None = None) -> None:
        self.settings = settings or RetirementSettings()
        # Rows found queued behind an earlier one or an open workflow, by (created_at, id): when a
        # retirement, a checkpoint or a restore ends, the oldest is looked at at once rather than
        # at its next poll (a backlog of reruns otherwise ran one per poll, ~1.8 s each, though each
        # took a quarter of a second). In memory only: a poll still finds every one.
        self._waiting: dict[str, tuple[Any, str]] = {}
        self._enqueue: Callable[[str, str], None] | None = None

    def attach(self, enqueue: Callable[[str, str], None]) -> None:
        self._enqueue = enqueue

    def on_commit(self, committed: Sequence[Committed]) -> None:
        ended = False
        for c in committed:
            if c.kind == KIND and c.from_state == "queued" and c.to_state != "queued":
                self._waiting.pop(c.entity_id, None)
            if ((c.kind == KIND and c.to_state in RETIREMENTS.terminal)
                    or (c.kind == "checkpoints" and c.to_state in CHECKPOINTS.terminal)
                    or (c.kind == "restores" and c.to_state in RESTORES.terminal)):
                ended = True
        if ended and self._waiting and self._enqueue is not None:
            self._enqueue(KIND, min(self._waiting.values())[1])

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state in RETIREMENTS.terminal:
            self._waiting.pop(entity_id, None)
            return Result()
        if row.state == "queued":
            return await self._queued(ctx, row)
        return await self._running(ctx, row)

    # -- queued -----------------------------------------------------------------------------------

    async def _blocker(self, ctx: Context, row: Row) -> str | None:
        q = models.retirements
        async with ctx.journal.read() as conn:
            # Participants refuse retire and forget from a checkpoint's prepare to its resume and
            # through a restore (a straggler retry not preparing yet holds no one closed).
            held = await open_workflow(conn)
            if held is not None:
                return held
            earlier = (await conn.execute(sa.select(q.c.id).where(
                q.c.state.not_in(sorted(RETIREMENTS.terminal)), q.c.id != row.id,
                sa.or_(q.c.created_at < row["created_at"],
                       sa.and_(q.c.created_at == row["created_at"], q.c.id < row.id))).limit(1))).scalar()
        return None if earlier is None else f"retirement {earlier} goes first"

    async def _rollouts(self, ctx: Context, ids: Sequence[str]) -> list[Row]:
        if not ids:
            return []
        t = models.rollouts
        async with ctx.journal.read() as conn:
            rows = (await conn.execute(sa.select(t).where(t.c.id.in_(list(ids))).order_by(t.c.id))).all()
        return [to_row(ROLLOUTS, r._mapping) for r in rows]

    @staticmethod
    def _latest(row: Row) -> dict[str, int]:
        latest: dict[str, int] = {}
        for e in row["episode_ids"] or []:
            latest[e["rollout_id"]] = max(latest.get(e["rollout_id"], 0), int(e.get("attempt", 0)))
        return latest

    async def _queued(self, ctx: Context, row: Row) -> Result:
        blocker = await self._blocker(ctx, row)
        if blocker is not None:
            log.debug("retirement %s stays queued: %s", row.id, blocker)
            self._waiting[row.id] = (row["created_at"], row.id)
            return Result(requeue_after=self.settings.poll_s)
        rollouts = await self._rollouts(ctx, row["rollout_ids"])
        if row["op"] == "forget":
            live = [r.id for r in rollouts if r.state in LIVE_ROLLOUT]
            if live:
                detail = f"forget refused: rollout(s) still live: {', '.join(live)}"

                async def refuse(tx: WriteTx) -> None:
                    await tx.transition(KIND, row.id, from_state="queued", version=row.version, to_state="running",
                                        reason="no checkpoint open")
                    await tx.transition(KIND, row.id, from_state="running", version=row.version + 1,
                                        to_state="failed", reason=detail, changes={"detail": detail})
                await ctx.write(refuse)
                return Result()
            await ctx.apply(Transition(KIND, row.id, "queued", row.version, "running", "no checkpoint open"))
            return Result()
        latest = self._latest(row)
        ops = [Transition(KIND, row.id, "queued", row.version, "running", "no checkpoint open")]
        ops += [Transition(ROLLOUTS, r.id, r.state, r.version, "retiring", f"retire requested ({row.id})")
                for r in rollouts if r.state in ("dispatched", "restart") and r["attempt"] <= latest[r.id]]
        await ctx.apply(*ops)
        return Result()

    # -- running ----------------------------------------------------------------------------------

    async def _running(self, ctx: Context, row: Row) -> Result:
        stage = int(row["stage"])
        if stage >= len(RETIRE_ORDER):
            return await self._finish(ctx, row)
        kinds = RETIRE_ORDER[stage]
        deadline = row["updated_at"].timestamp() + self.settings.retire_timeout_s
        body: dict[str, Any] = {"checkpoint_id": wire_id(row), "deadline_ts": deadline}
        if row["op"] == "retire":
            body["episode_ids"] = row["episode_ids"]
        else:
            body["rollout_ids"] = row["rollout_ids"]
        rows = await participant_rows(ctx)
        # The stage's members are fixed by its first look: whoever already has a call, else the healthy.
        known = [Member(r.id, r["kind"], r["url"]) for r in rows if r["kind"] in kinds]
        timeout = max(deadline - ctx.clock.time(), 0.0) + 5.0
        shared = outbox.Body.of(body)
        ids = {m.name: control_intent(row, m.url, row["op"], shared, timeout).id for m in known}
        calls = await read_calls(ctx, ids.values())
        members = [m for m in known if ids[m.name] in calls]
        if not members:
            # A retire or forget that left out a participant would leave it running the attempt
            # (or holding the mark): the stage waits for one that is unreachable or not probed yet
            # (kind unknown: it may be of this stage), up to the stage's deadline, then fails.
            waiting = [r for r in rows if r.state in AWAITED and (r["kind"] is None or r["kind"] in kinds)]
            if waiting:
                named = ", ".join(f"{r.id} is {r.state}" for r in waiting)
                if ctx.clock.time() < deadline:
                    log.info("retirement %s: stage %s waits (%s)", row.id, "+".join(kinds), named)
                    return Result(requeue_after=self.settings.poll_s)
                detail = (f"{row['op']} failed in stage {'+'.join(kinds)}: it waited "
                          f"{self.settings.retire_timeout_s:g} s (checkpoint.retire_timeout_s) for {named}")
                await ctx.apply(Transition(KIND, row.id, "running", row.version, "failed", detail[:200],
                                           {"detail": detail}))
                return Result()
            members = healthy(rows, kinds)
        outcome = await fan_out(ctx, row, members, row["op"], body, deadline)
        if outcome.open:
            return Result(requeue_after=timeout)
        if outcome.failures:
            detail = (f"{row['op']} failed in stage {'+'.join(kinds)} on {len(outcome.failures)} participant(s): "
                      + "; ".join(outcome.failures))
            await ctx.apply(Transition(KIND, row.id, "running", row.version, "failed", detail[:200],
                                       {"detail": detail}))
            return Result()
        if stage + 1 < len(RETIRE_ORDER):
            await ctx.apply(Transition(KIND, row.id, "running", row.version, "running",
                                       f"stage {'+'.join(RETIRE_ORDER[stage + 1])} starts", {"stage": stage + 1}))
            return Result()
        return await self._finish(ctx, row)

    async def _finish(self, ctx: Context, row: Row) -> Result:
        rollouts = await self._rollouts(ctx, row["rollout_ids"])
        ops = [Transition(KIND, row.id, "running", row.version, "done", f"{row['op']} applied everywhere")]
        if row["op"] == "retire":
            latest = self._latest(row)
            ops += [Transition(ROLLOUTS, r.id, "retiring", r.version, "retired", f"retired ({row.id})")
                    for r in rollouts if r.state == "retiring" and r["attempt"] <= latest[r.id]]
        else:
            ops += [Transition(ROLLOUTS, r.id, r.state, r.version, "forgotten", f"forgotten ({row.id})")
                    for r in rollouts if r.state in ("finished", "failed", "retired")]
            skipped = [r.id for r in rollouts if r.state in LIVE_ROLLOUT]
            if skipped:
                ops[0] = Transition(KIND, row.id, "running", row.version, "done", ops[0].reason,
                                    {"detail": f"live again, left as they are: {json.dumps(skipped)}"})
        await ctx.apply(*ops)
        return Result()


__all__ = ["KIND", "RETIRE_ORDER", "InvalidRetirement", "RetirementController", "RetirementSettings",
           "request_retirement", "wire_id"]
