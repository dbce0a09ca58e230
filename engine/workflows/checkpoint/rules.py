"""The checkpoint family's operator-facing rules, as plain functions over a write transaction that
raise typed exceptions (no HTTP here; the routes map them in :data:`engine.workflows.checkpoint.api.REFUSALS`):

- **one at a time**: a checkpoint or a restore may start only while no checkpoint and no restore
  is open (:func:`refuse_while_open`); they never overlap, so a restore never reads a checkpoint
  being written and a checkpoint never captures a restore half applied;
- **membership fails closed**: a checkpoint covers every configured participant, so one that is
  not healthy refuses it (:func:`checkpoint_members`); a restore goes into exactly the
  participants the checkpoint holds, by name and kind, each healthy (:func:`restore_members`);
- **participants held closed**: from a checkpoint's prepare to its resume, and through a restore,
  no ``/run`` is sent and no retire or forget runs (:func:`open_workflow` says which holds them);
- **restore only what was published**: a restore starts from a checkpoint the journal records as
  published (``done``, with a manifest path; :func:`published_checkpoint`), in the directory it was
  published under, whose ``checkpoint.json`` says the same scope and members as the journal did at
  publication (:func:`check_manifest`), so a file changed or replaced behind the journal's back is
  refused rather than restored;
- **abort**: an operator may abort a checkpoint that is preparing, prepared, committing or
  committed (:data:`ABORTABLE`, read from the machine's edges into ``aborting``); it then moves as
  the controller's own abort does, under a fresh resume deadline (:func:`abort_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from journal import WriteTx, models
from journal.machines import CHECKPOINTS, RESTORES

#: The checkpoint states with an edge to ``aborting``: preparing, prepared, committing, committed.
ABORTABLE = tuple(s for s, to in CHECKPOINTS.edges.items() if "aborting" in to and s != "aborting")


class WorkflowOpen(Exception):
    """A checkpoint or a restore is open (``kind`` ``checkpoints`` or ``restores``, its id and state)."""

    def __init__(self, kind: str, entity_id: str, state: str) -> None:
        self.kind, self.entity_id, self.state = kind, entity_id, state
        what = "checkpoint" if kind == "checkpoints" else "restore"
        then = "wait for it to end or abort it first" if kind == "checkpoints" else "wait for it to end first"
        super().__init__(f"{what} {entity_id!r} is open (state {state}); {then}")


class MembershipIncomplete(Exception):
    """Configured participants that are not healthy (``missing``: name -> state): no checkpoint."""

    def __init__(self, missing: dict[str, str]) -> None:
        self.missing = missing
        said = ", ".join(f"{name} is {state}" for name, state in sorted(missing.items()))
        super().__init__(f"a checkpoint covers every configured participant, and {said}; nothing was written")


class MembershipMismatch(Exception):
    """The participants now differ from the checkpoint's members (``missing``: members not here or
    not healthy, ``extra``: participants the checkpoint does not hold, ``kinds``: name -> (then, now))."""

    def __init__(self, checkpoint_id: str, missing: dict[str, str], extra: list[str],
                 kinds: dict[str, tuple[str, str]]) -> None:
        self.checkpoint_id, self.missing, self.extra, self.kinds = checkpoint_id, missing, extra, kinds
        parts = [f"{name} is {state}" for name, state in sorted(missing.items())]
        parts += [f"{name} is not a member of it" for name in sorted(extra)]
        parts += [f"{name} was a {then}, is a {now}" for name, (then, now) in sorted(kinds.items())]
        super().__init__(f"checkpoint {checkpoint_id!r} restores into its own members only: {'; '.join(parts)}; "
                         "nothing was restored")


async def _participants(tx: WriteTx) -> dict[str, tuple[str, str | None]]:
    p = models.participants
    rows = (await tx.execute(sa.select(p.c.id, p.c.state, p.c.kind).where(p.c.state != "removed"))).all()
    return {r.id: (r.state, r.kind) for r in rows}


async def checkpoint_members(tx: WriteTx) -> None:
    """Raise :class:`MembershipIncomplete` unless every configured participant is healthy."""
    missing = {name: state for name, (state, _) in (await _participants(tx)).items() if state != "healthy"}
    if missing:
        raise MembershipIncomplete(missing)


async def restore_members(tx: WriteTx, checkpoint_id: str) -> None:
    """Raise :class:`MembershipMismatch` unless the participants are the checkpoint's members (names
    and kinds), every one healthy."""
    m = models.checkpoint_members
    members = {r.participant: r.kind for r in (await tx.execute(
        sa.select(m.c.participant, m.c.kind).where(m.c.checkpoint_id == checkpoint_id))).all()}
    now = await _participants(tx)
    missing = {name: now[name][0] if name in now else "not configured" for name in members
               if name not in now or now[name][0] != "healthy"}
    extra = sorted(set(now) - set(members))
    kinds = {name: (kind, str(now[name][1])) for name, kind in members.items()
             if name in now and now[name][1] is not None and now[name][1] != kind}
    if missing or extra or kinds:
        raise MembershipMismatch(checkpoint_id, missing, extra, kinds)


class NoSuchCheckpoint(LookupError):
    """``field``: the request field that named it, when one did."""

    def __init__(self, checkpoint_id: str, *, field: str | None = None, detail: str | None = None) -> None:
        self.checkpoint_id, self.field = checkpoint_id, field
        super().__init__(detail or f"no checkpoint {checkpoint_id!r}")


class NotPublished(Exception):
    def __init__(self, checkpoint_id: str, state: str) -> None:
        self.checkpoint_id, self.state = checkpoint_id, state
        super().__init__(f"checkpoint {checkpoint_id!r} is {state}: only a checkpoint the journal records as "
                         "published (done) can be restored")


class CheckpointMismatch(Exception):
    """What is on disk (or asked for) is not what the journal published; ``field`` names the request field."""

    def __init__(self, detail: str, field: str) -> None:
        self.field = field
        super().__init__(detail)


@dataclass(frozen=True)
class Published:
    """The journal's record of a published checkpoint: its directory, scope and members' manifests."""

    checkpoint_id: str
    directory: str
    scope: list[str]
    members: dict[str, dict[str, Any]]


async def published_checkpoint(conn: Any, checkpoint_id: str) -> Published:
    """Checkpoint ``checkpoint_id`` as the journal recorded it; :class:`NoSuchCheckpoint` or
    :class:`NotPublished` unless it was published. ``conn``: a snapshot read (or a transaction)."""
    c, m = models.checkpoints, models.checkpoint_members
    row = (await conn.execute(sa.select(c.c.state, c.c.checkpoint_dir, c.c.scope, c.c.manifest_path)
                              .where(c.c.id == checkpoint_id))).first()
    if row is None:
        raise NoSuchCheckpoint(checkpoint_id, field="checkpoint_id",
                               detail=f"no checkpoint {checkpoint_id!r} in the journal")
    if row.state != "done" or row.manifest_path is None:
        raise NotPublished(checkpoint_id, row.state)
    members = (await conn.execute(sa.select(m.c.participant, m.c.kind, m.c.manifest, m.c.episode_ids)
                                  .where(m.c.checkpoint_id == checkpoint_id))).all()
    return Published(checkpoint_id, row.checkpoint_dir, list(row.scope or []),
                     {r.participant: {"kind": r.kind, "manifest": r.manifest, "episode_ids": r.episode_ids}
                      for r in members})


def check_directory(published: Published, directory: str, given: str | None) -> None:
    """A directory the request named must be the one the checkpoint was published under (both real paths)."""
    if given is not None and given != directory:
        raise CheckpointMismatch(f"checkpoint {published.checkpoint_id!r} was published under {published.directory}, "
                                 f"not {given}", "directory")


def check_manifest(published: Published, manifest: dict[str, Any]) -> None:
    """The ``checkpoint.json`` read from disk must say the scope and members the journal recorded."""
    differs = [what for what, ok in (("scope", sorted(manifest["scope"]) == sorted(published.scope)),
                                      ("members", manifest.get("members") == published.members)) if not ok]
    if differs:
        raise CheckpointMismatch(f"checkpoint {published.checkpoint_id!r}: the {' and '.join(differs)} in its "
                                 "checkpoint.json differ from what the journal recorded at publication; nothing "
                                 "was restored", "checkpoint_id")


class NotAbortable(Exception):
    """The checkpoint is past the point of no return, or has ended."""

    def __init__(self, checkpoint_id: str, state: str) -> None:
        self.checkpoint_id, self.state = checkpoint_id, state
        why = "it has ended" if state in CHECKPOINTS.terminal else "it is past the point of no return"
        super().__init__(f"checkpoint {checkpoint_id!r} is {state}, {why}; only a checkpoint that is "
                         f"{', '.join(ABORTABLE)} can be aborted")


async def open_workflow(conn: Any) -> str | None:
    """The checkpoint or restore that holds dispatch paused, described; ``None`` when none is open.

    A straggler retry that has not started preparing holds no participant closed (as the
    retirement workflow counts it), so it does not pause dispatch either."""
    c, r = models.checkpoints, models.restores
    checkpoint = (await conn.execute(sa.select(c.c.id).where(
        c.c.state.not_in(sorted(CHECKPOINTS.terminal)),
        sa.not_(sa.and_(c.c.state == "preparing", c.c.deadline_ts.is_(None), c.c.retry_of.is_not(None))))
        .limit(1))).scalar()
    if checkpoint is not None:
        return f"checkpoint {checkpoint} is open"
    restore = (await conn.execute(sa.select(r.c.id).where(r.c.state.not_in(sorted(RESTORES.terminal))).limit(1))
               ).scalar()
    return None if restore is None else f"restore {restore} is open"


async def refuse_while_open(tx: WriteTx) -> None:
    """Raise :class:`WorkflowOpen` naming the oldest open checkpoint, else the oldest open restore."""
    for table, machine in ((models.checkpoints, CHECKPOINTS), (models.restores, RESTORES)):
        found = (await tx.execute(sa.select(table.c.id, table.c.state).where(
            table.c.state.not_in(sorted(machine.terminal))).order_by(table.c.created_at).limit(1))).first()
        if found is not None:
            raise WorkflowOpen(machine.kind, found.id, found.state)


async def abort_checkpoint(tx: WriteTx, checkpoint_id: str, *, reason: str | None, resume_deadline_ts: float) -> str:
    """Move the checkpoint to ``aborting`` (a compare-and-set from the state and version it reads);
    its detail says an operator aborted it and why, the time in its current state is added to its
    timings, and everyone is resumed by ``resume_deadline_ts``. Returns the state it was in.

    Raises :class:`NoSuchCheckpoint`, :class:`NotAbortable`, or ``StaleRow`` when the controller
    moved it meanwhile (run it with :meth:`GroupCommitter.run_fresh`)."""
    row = await tx.get("checkpoints", checkpoint_id)
    if row is None:
        raise NoSuchCheckpoint(checkpoint_id)
    if row.state not in ABORTABLE:
        raise NotAbortable(checkpoint_id, row.state)
    detail = "aborted by an operator" + (f": {reason}" if reason else "")
    timings = dict(row["timings"] or {})
    timings[row.state] = round((tx.now - row["updated_at"]).total_seconds(), 3)
    await tx.transition("checkpoints", checkpoint_id, from_state=row.state, version=row.version,
                        to_state="aborting", reason=detail,
                        changes={"detail": detail, "timings": timings, "deadline_ts": resume_deadline_ts})
    return row.state


__all__ = ["ABORTABLE", "CheckpointMismatch", "MembershipIncomplete", "MembershipMismatch", "NoSuchCheckpoint",
           "NotAbortable", "NotPublished", "Published", "WorkflowOpen", "abort_checkpoint", "check_directory",
           "check_manifest", "checkpoint_members", "open_workflow", "published_checkpoint", "refuse_while_open",
           "restore_members"]
