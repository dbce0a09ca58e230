"""The checkpoint workflow: prepare stage by stage, commit, publish, resume (or abort).

A ``checkpoints`` row and one ``checkpoint_members`` row per participant are
created together (:func:`start_checkpoint`). The controller then advances the
checkpoint; every call to a participant is an outbox intent owned by the
checkpoint at its current state and version, so reconciling the same state
again finds the same intents, never new ones, and a completed call wakes the
checkpoint.

A step (a prepare stage, a commit wave, a resume stage) sends one body, encoded
and stored once, to all its members. Once every call of a step has settled, one
transaction records the members' answers, moves the checkpoint, and writes the
next step's calls (planned on the rows as that transaction leaves them, so they
are the intents a reconcile of the new state would write).

- ``preparing`` — first, while a retire or forget is already running (calling
  participants), the checkpoint waits for it (retirements requested later wait
  for the checkpoint). Then one stage at a time (environment, model, agent, resources):
  prepare every member of the stage with the stage's deadline. All prepared:
  the next stage (a self-edge, so the next stage's intents are new), or
  ``prepared`` after the last. A member that answers ``preparing`` (deadline
  passed with blockers) or fails: ``aborting``, with the blockers in
  ``blockers`` and the reason in ``detail``. Later stages are never touched.
- ``prepared`` → ``committing``: the scope is read from the journal's
  rollouts (:mod:`engine.workflows.checkpoint.scope`: every attempt in flight,
  every restored one not sent yet by its replacement attempt), less every
  restart any member reported.
- ``committing``: every member, the environments included, commits that scope
  into the same directory. A failure: ``aborting``. All committed: once every
  scoped ``/run`` whose episode no environment exported (its reply may be on
  the wire) has its reply recorded, ``committed`` with the rollout set it
  continues (``rollouts``: the scoped attempts still in flight or restored, and
  the rollouts not dispatched yet).
- ``committed`` → ``published``: ``<dir>/<id>/checkpoint.json`` (the members'
  manifests; ``scope``, the attempts a restore continues; ``committed_scope``;
  the restarts; the rollout set) and then ``<dir>/LATEST`` are written
  atomically and durably, by the commit deadline (a publish started with less
  than ``PUBLISH_MIN_S`` left gets that long, and first renews every member's
  lease to it and waits for those renews to settle: the leases count from the
  commit deadline). A publish that fails (a full
  disk, a read-only or unwritable directory, an I/O error) or is still running
  at the deadline: ``aborting``, the path and the OS error in ``detail``, with
  neither a checkpoint.json nor a changed ``LATEST`` left behind (errors a
  retry may cure are tried again a few times, within the deadline).
- ``published`` → ``resuming`` → ``done``; ``aborting`` → ``aborted``: every
  member is resumed in reverse stage order (members never reached too, so
  their late requests are fenced). A resume that fails is recorded and not
  retried forever: the participant's lease resumes it by itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from journal import Committed, Transition, WriteTx, machines, models, outbox
from journal.writes import Row

from engine.workflows.checkpoint import confined
from engine.runtime.clock import Clock, SystemClock
from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.checkpoint.fanout import Member, control_intent, describe_error, fan_out, read_calls, timings
from engine.workflows.checkpoint.open_calls import SETTLED, OpenCalls
from engine.workflows.checkpoint.publish_files import Publication, PublishFailed
from engine.workflows.checkpoint.retirement import KIND as RETIREMENTS
from engine.workflows.checkpoint.retries import (EXPORT_FAILED, member_id, next_try_id, retirement_id, retries,
                                                 start_retry)
from engine.workflows.checkpoint.scope import RolloutSet, episode_json, journal_scope, rollout_set, unsettled_runs

KIND = "checkpoints"
MEMBERS = "checkpoint_members"
#: Prepare order; resume runs it backwards.
STAGES: tuple[str, ...] = ("environment", "model", "agent", "resources")
#: How long past its deadline a call may take to answer (a participant answers at its deadline).
CALL_MARGIN_S = 2.0
#: The member columns a step decides on (reports and manifests are read only where needed).
_LIGHT = ("id", "state", "version", "participant", "kind", "url", "stage")
#: Every member state a resume moves from.
_RESUMABLE: tuple[str, ...] = tuple(sorted(set(machines.CHECKPOINT_MEMBERS.states) - {"resuming", "resumed"}))
#: How many times a publish is tried in all (only for a transient error, and only within the deadline).
PUBLISH_TRIES = 3
#: The pause before a publish is tried again.
PUBLISH_RETRY_S = 0.5
#: How often a commit waiting for /run replies already on the wire looks again.
RUN_REPLY_POLL_S = 0.2
#: The least time a publish is given, even one first tried at or past the deadline (after a restart).
PUBLISH_MIN_S = 5.0
#: Seconds between looks at the renews a late publish waits for (their replies wake it sooner).
RENEW_LOOK_S = 0.5

log = logging.getLogger("tidelog.checkpoint")


@dataclass(frozen=True)
class CheckpointTimeouts:
    """The checkpoint controller's deadlines (from the `checkpoint` section; not the participant kit's
    `workers.participant.CheckpointSettings`)."""

    prepare_timeout_s: float = 30.0
    commit_timeout_s: float = 120.0
    resume_timeout_s: float = 30.0


@dataclass(frozen=True)
class _Step:
    """One step's calls: ``op`` to each of ``members`` with one body; members in ``moving_from``
    move to ``moving_to`` when the calls are written."""

    op: str
    members: list[Row]
    body: dict[str, Any]
    deadline: float
    moving_from: tuple[str, ...]
    moving_to: str


def _after(row: Row, op: Transition) -> Row:
    """``row`` as ``op`` (a transition of it) leaves it."""
    return Row(row.kind, row.id, op.to_state, row.version + 1, {**row.values, **op.changes})


def _project(row: Row, members: list[Row], ops: Sequence[Transition]) -> tuple[Row, list[Row]]:
    """The checkpoint and its members as ``ops`` leave them (ops in order, at most one per member)."""
    by_id = {m.id: m for m in members}
    for op in ops:
        if op.kind == KIND:
            row = _after(row, op)
        elif op.entity_id in by_id:
            by_id[op.entity_id] = _after(by_id[op.entity_id], op)
    return row, [by_id[m.id] for m in members]


def _light(member: Row) -> Row:
    return Row(member.kind, member.id, member.state, member.version, {k: member[k] for k in _LIGHT[3:]})


async def start_checkpoint(tx: WriteTx, checkpoint_id: str, checkpoint_dir: str,
                           participants: Sequence[Row], *, max_tries: int = 3) -> None:
    """Create the checkpoint and one member per participant (healthy rows with a kind)."""
    if not participants:
        raise ValueError("a checkpoint needs at least one healthy participant")
    await tx.create(KIND, checkpoint_id, reason="checkpoint requested",
                    values={"checkpoint_dir": checkpoint_dir, "max_tries": max_tries, "try_number": 1})
    for p in participants:
        await tx.create(MEMBERS, member_id(checkpoint_id, p.id), reason="member of the checkpoint",
                        values={"checkpoint_id": checkpoint_id, "participant": p.id, "kind": p["kind"],
                                "url": p["url"], "stage": STAGES.index(p["kind"])})


class CheckpointController(BaseController):
    kind = KIND

    def __init__(self, settings: CheckpointTimeouts | None = None) -> None:
        self.settings = settings or CheckpointTimeouts()
        # The calls of each checkpoint's current step not yet seen settled (see open_calls).
        self._open = OpenCalls()
        # Checkpoint id -> (its version, its members as of that version), as this controller's
        # last write left them. Only this controller moves members, and always together with the
        # checkpoint row, so the same version means the same members; any other write to the
        # row (an operator's abort) changes its version, and a failed write drops the entry.
        self._members_at: dict[str, tuple[int, list[Row]]] = {}
        # Checkpoint id -> failed publish tries so far (transient errors only; bounded by the deadline).
        self._publish_tries: dict[str, int] = {}
        # Checkpoint id -> the lease bound its renews before a late publish ask for (one per look).
        self._renew_until: dict[str, float] = {}
        # The clock of the reconciler this controller runs under (its context's; :meth:`waiting`
        # has no context, and a step is tracked only by a reconcile, which sets this first).
        self._clock: Clock = SystemClock()

    def waiting(self, checkpoint_id: str) -> bool:
        """Whether a completed call of this checkpoint can be ignored: other calls of its step are
        still open (as far as this process's commits tell) and its deadline has not passed. The
        reconciler then skips the wake-up; the last call to settle wakes it."""
        return self._open.waiting_until(checkpoint_id, None, self._clock.time(), CALL_MARGIN_S) is not None

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """Journal commit listener (the orchestrator adds it): see :class:`OpenCalls`. A checkpoint
        that leaves ``committed`` (published, or aborted while its renews were out) needs no renew bound."""
        self._open.on_commit(committed)
        for c in committed:
            if c.kind == KIND and c.from_state == "committed" and c.to_state != "committed":
                self._renew_until.pop(c.entity_id, None)

    # -- reads ----------------------------------------------------------------------------------

    async def _members(self, ctx: Context, checkpoint_id: str, *, full: bool = False) -> list[Row]:
        """The checkpoint's members in stage order: only the columns a step decides on, unless
        ``full`` (reports, manifests and episode ids too)."""
        t = models.checkpoint_members
        names = [c.name for c in t.c] if full else list(_LIGHT)
        async with ctx.journal.read() as conn:
            rows = (await conn.execute(sa.select(*(t.c[n] for n in names))
                                       .where(t.c.checkpoint_id == checkpoint_id)
                                       .order_by(t.c.stage, t.c.participant))).all()
        # Plain tuples into rows: this runs on every look at a checkpoint of hundreds of members.
        rest = [(i, n) for i, n in enumerate(names) if n not in ("id", "state", "version")]
        at = {n: i for i, n in enumerate(names)}
        return [Row(MEMBERS, r[at["id"]], r[at["state"]], r[at["version"]], {n: r[i] for i, n in rest})
                for r in rows]

    def _plan(self, row: Row, members: list[Row], now: float) -> _Step | None:
        """The calls the checkpoint makes in its state (and stage), or ``None`` where it makes none
        (``now``: the clock's Unix time, for a deadline the row does not hold yet)."""
        if row.state == "preparing" and row["deadline_ts"] is not None:
            current = [m for m in members if m["stage"] == row["stage"]]
            deadline = float(row["deadline_ts"])
            return _Step("prepare", current, {"checkpoint_id": row.id, "deadline_ts": deadline}, deadline,
                         ("pending",), "preparing") if current else None
        if row.state == "committing":
            deadline = self._deadline(row, self.settings.commit_timeout_s, now)
            body: dict[str, Any] = {"checkpoint_id": row.id, "deadline_ts": deadline,
                                    "checkpoint_dir": str(Path(row["checkpoint_dir"]) / row.id)}
            if row["scope"] is None:
                return None  # the first look reads the scope from the journal (no calls yet)
            # Every member, the environments included, commits the one scope the journal gave.
            body["episode_ids"] = [episode_json(k) for k in row["scope"]]
            return _Step("commit", members, body, deadline, ("prepared",), "committing")
        if row.state in ("resuming", "aborting"):
            # Reverse stage order, from wherever each member stands (members never reached too).
            pending = [m for m in members if m.state != "resumed"]
            if not pending:
                return None
            stage = max(m["stage"] for m in pending)
            deadline = self._deadline(row, self.settings.resume_timeout_s, now)
            return _Step("resume", [m for m in pending if m["stage"] == stage],
                         {"checkpoint_id": row.id, "deadline_ts": deadline}, deadline, _RESUMABLE, "resuming")
        return None

    def _intents(self, row: Row, step: _Step, now: float) -> dict[str, outbox.Intent]:
        """Member id -> the step's call, one shared body for all (the same bytes to every member)."""
        # Prepare and commit are bounded by their phase's deadline: a call that fails is not sent
        # again past it (the checkpoint aborts and a retry runs under a new id). A resume is
        # retried a little; beyond that the participant's lease resumes it.
        timeout = max(step.deadline - now, 0.0) + CALL_MARGIN_S
        shared = outbox.Body.of(step.body)
        return {m.id: control_intent(row, m["url"], step.op, shared, timeout,
                                     max_attempts=3 if step.op == "resume" else 1) for m in step.members}

    async def _write(self, ctx: Context, row: Row, members: list[Row], ops: list[Transition],
                     known: Mapping[str, str] | None = None) -> None:
        """Apply ``ops`` and, in the same transaction, make the calls of the step they lead to.

        The next step is planned on the rows as ``ops`` leave them, so a decision and the calls
        it starts commit together; calls in ``known`` (id -> state) already exist and are not
        written again.
        """
        known = known or {}
        after, moved = _project(row, members, ops)
        step = self._plan(after, moved, ctx.clock.time())
        missing: list[tuple[outbox.Intent, str]] = []
        moves: list[Row] = []
        if step is not None:
            intents = self._intents(after, step, ctx.clock.time())
            missing = [(intents[m.id], f"{step.op} {m['participant']} for {row.id}") for m in step.members
                       if intents[m.id].id not in known]
            # Before the commit, so that on_commit sees every one of these calls settle.
            self._open.track(row.id, after.version, step.deadline, [i.id for i in intents.values()],
                             [i for i, state in known.items() if state in SETTLED])
            moves = [m for m in step.members if m.state in step.moving_from]

        moving = [Transition(MEMBERS, m.id, m.state, m.version, step.moving_to, f"{step.op} sent")
                  for m in moves if step is not None]

        async def write(tx: WriteTx) -> list[Row]:
            await tx.apply(ops)
            claimed = await outbox.ensure_all(tx, missing, claim=ctx.claims)
            await tx.apply(moving)
            return claimed
        self._members_at.pop(row.id, None)
        try:
            claimed = await ctx.write(write)
        except BaseException:
            self._open.forget(row.id)  # nothing written: the next reconcile reads where the calls stand
            raise
        if after.state not in machines.CHECKPOINTS.terminal:
            self._members_at[row.id] = (after.version, [_light(m) for m in _project(after, moved, moving)[1]])
        ctx.send(claimed)

    async def _settled(self, ctx: Context, row: Row, members: list[Row], step: _Step) -> dict[str, Row] | None:
        """Member id -> call (state, result, error) once every call of ``step`` settled; else ``None``
        (a completed call wakes the checkpoint again). Calls found missing are written now."""
        intents = self._intents(row, step, ctx.clock.time())
        ids = [i.id for i in intents.values()]
        # Tracked before the read: a call that settles during it is seen by on_commit.
        self._open.track(row.id, row.version, step.deadline, ids)
        # One read: states and replies together (a reconcile gets here once the step looks settled).
        calls = await read_calls(ctx, ids)
        settled = {i: c.state for i, c in calls.items()}
        self._open.track(row.id, row.version, step.deadline, ids, [i for i, st in settled.items() if st in SETTLED])
        if len(calls) < len(intents):
            # Only after a crash between a decision and its calls' commit, or at the start.
            await self._write(ctx, row, members, [], settled)
            return None
        if any(state not in SETTLED for state in settled.values()):
            return None
        return {mid: calls[i.id] for mid, i in intents.items()}

    @staticmethod
    def _deadline(row: Row, seconds: float, now: float) -> float:
        return float(row["deadline_ts"]) if row["deadline_ts"] is not None else now + seconds

    @staticmethod
    def _wait(ctx: Context, deadline: float) -> Result:
        """Look again once every open call must have settled (a completed call wakes it sooner)."""
        return Result(requeue_after=max(deadline - ctx.clock.time(), 0.0) + CALL_MARGIN_S + 1.0)

    # -- the machine ----------------------------------------------------------------------------

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        self._clock = ctx.clock
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state in machines.CHECKPOINTS.terminal:
            self._open.forget(entity_id)
            self._members_at.pop(entity_id, None)
            self._publish_tries.pop(entity_id, None)
            return Result()
        deadline = self._open.waiting_until(entity_id, row.version, ctx.clock.time(), CALL_MARGIN_S)
        if deadline is not None:
            return self._wait(ctx, deadline)
        if row.state == "committed":
            return await self._publish(ctx, row)
        known = self._members_at.get(entity_id)
        members = known[1] if known is not None and known[0] == row.version else await self._members(ctx, entity_id)
        if row.state == "preparing":
            return await self._preparing(ctx, row, members)
        if row.state == "committing":
            return await self._committing(ctx, row, members)
        return await self._resuming(ctx, row, members)

    def _move(self, ctx: Context, row: Row, to_state: str, reason: str, *, deadline: float | None = None,
              **changes: Any) -> Transition:
        """The checkpoint's own transition (its timings updated; a fresh deadline if given)."""
        if deadline is not None:
            changes["deadline_ts"] = ctx.clock.time() + deadline
        changes["timings"] = timings(ctx, row)
        return Transition(KIND, row.id, row.state, row.version, to_state, reason, changes)

    def _abort(self, ctx: Context, row: Row, detail: str, **changes: Any) -> Transition:
        return self._move(ctx, row, "aborting", detail, deadline=self.settings.resume_timeout_s, detail=detail,
                          **changes)

    async def _preparing(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        if not members:
            await ctx.apply(Transition(KIND, row.id, "preparing", row.version, "failed", "no participants",
                                       {"detail": "the checkpoint has no members"}))
            return Result()
        if row["deadline_ts"] is None:
            if row["retry_of"] is not None:
                waiting = await self._retirement_pending(ctx, retirement_id(row["retry_of"]))
                if waiting is not None:
                    return waiting
            running = await self._retirement_running(ctx)
            if running is not None:
                return running
            await self._write(ctx, row, members, [Transition(
                KIND, row.id, "preparing", row.version, "preparing", "stage 0 starts",
                {"deadline_ts": ctx.clock.time() + self.settings.prepare_timeout_s})])
            return Result()
        stage = row["stage"]
        step = self._plan(row, members, ctx.clock.time())
        ops: list[Transition] = []
        if step is not None:
            calls = await self._settled(ctx, row, members, step)
            if calls is None:
                return self._wait(ctx, step.deadline)
            ops, why, blockers = self._prepare_outcomes(step.members, calls)
            if why:
                await self._write(ctx, row, members, [
                    *ops, self._abort(ctx, row, f"stage {STAGES[stage]} not prepared: {why}", blockers=blockers)])
                return Result()
        if stage + 1 < len(STAGES):
            ops.append(Transition(KIND, row.id, "preparing", row.version, "preparing",
                                  f"stage {STAGES[stage + 1]} starts",
                                  {"stage": stage + 1, "deadline_ts": ctx.clock.time() + self.settings.prepare_timeout_s}))
        else:
            prepared = self._move(ctx, row, "prepared", "every stage prepared")
            ops += [prepared, self._move(ctx, _after(row, prepared), "committing", "prepared everywhere",
                                         deadline=self.settings.commit_timeout_s)]
        await self._write(ctx, row, members, ops)
        return Result()

    async def _retirement_running(self, ctx: Context) -> Result | None:
        """A retire or forget already calling participants is not cut off: stage 0 waits for it.
        (New ones wait in ``queued`` while this checkpoint is open, so the wait is for those only.)"""
        q = models.retirements
        async with ctx.journal.read() as conn:
            running = (await conn.execute(sa.select(q.c.id).where(q.c.state == "running").limit(1))).scalar()
        if running is not None:
            log.debug("checkpoint waits for retirement %s to finish before it prepares", running)
            return Result(requeue_after=0.25)
        return None

    async def _retirement_pending(self, ctx: Context, retirement: str) -> Result | None:
        """A straggler retry prepares only once its predecessor's blockers are retired."""
        row = await ctx.get(RETIREMENTS, retirement)
        if row is not None and row.state not in machines.RETIREMENTS.terminal:
            return Result(requeue_after=0.25)
        return None

    @staticmethod
    def _prepare_outcomes(members: list[Row], calls: dict[str, Row]
                          ) -> tuple[list[Transition], str, dict[str, Any]]:
        """Each member's settled prepare as a transition; why the stage is not prepared (``""``: it
        is); the blockers by participant."""
        ops: list[Transition] = []
        failures: list[str] = []
        blockers: dict[str, Any] = {}
        for m in members:
            call = calls[m.id]
            result = call["result"] or {}
            if call.state == "succeeded" and result.get("phase") == "prepared":
                state, detail = "prepared", None
            elif call.state == "succeeded":
                report = result.get("report") or {}
                state, detail = "not_ready", f"{report.get('blocker_count', 0)} blockers"
                blockers[m["participant"]] = report.get("blockers", [])
                failures.append(f"{m['participant']} has {detail}")
            else:
                state, detail = "failed", describe_error(call)
                failures.append(f"{m['participant']} failed: {detail}")
            if m.state == "preparing":
                ops.append(Transition(MEMBERS, m.id, "preparing", m.version, state, f"prepare answered: {state}",
                                      {"report": result.get("report"), "detail": detail}))
        return ops, "; ".join(failures), blockers

    async def _committing(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        if row["scope"] is None:
            # The scope is the journal's: the rollouts in flight and the restored ones not sent yet,
            # less every restart a prepare reported (protocol: PrepareResult.continued).
            reports = await self._members(ctx, row.id, full=True)
            restarts = sorted({k for m in reports for k in ((m["report"] or {}).get("restarts") or [])})
            async with ctx.journal.read() as conn:
                scope = sorted(set(await journal_scope(conn)) - set(restarts))
            await self._write(ctx, row, members, [Transition(
                KIND, row.id, "committing", row.version, "committing", f"scope of {len(scope)} episodes",
                {"scope": scope, "restarts": restarts})])
            return Result()
        step = self._plan(row, members, ctx.clock.time())
        assert step is not None
        calls = await self._settled(ctx, row, members, step)
        if calls is None:
            return self._wait(ctx, step.deadline)
        ops, failed = self._commit_outcomes(step.members, calls)
        if failed:
            # A failed export ends this checkpoint id for good: resume, then prepare under a new one.
            export_failed = any((c["error"] or {}).get("code") == EXPORT_FAILED for c in calls.values())
            await self._write(ctx, row, members, [*ops, self._abort(
                ctx, row, failed, **({"retry_reason": EXPORT_FAILED} if export_failed else {}))])
            return Result()
        # A /run reply may be on the wire: wait for every scoped attempt the environments did not
        # export (its episode is over there) and that is not a restart, until its reply is recorded.
        exported = {k for m in step.members if m["kind"] == "environment"
                    for k in (calls[m.id]["result"] or {}).get("episode_ids", [])}
        async with ctx.journal.read() as conn:
            outstanding = await unsettled_runs(conn, set(row["scope"]) - exported - set(row["restarts"] or ()))
            if outstanding and ctx.clock.time() < step.deadline:
                log.debug("checkpoint %s waits for %d /run replies", row.id, len(outstanding))
                return Result(requeue_after=RUN_REPLY_POLL_S)
            rollouts = await rollout_set(conn, row["scope"])
        if outstanding:  # past the deadline: not continued; after a crash they are retired and rerun
            log.warning("checkpoint %s: no /run reply by the commit deadline for %s", row.id, outstanding[:5])
            rollouts = RolloutSet(sorted(set(rollouts.continued) - set(outstanding)), rollouts.not_dispatched,
                                  rollouts.not_dispatched_count)
        ops.append(self._move(ctx, row, "committed", "committed everywhere", rollouts=rollouts.as_row()))
        await self._write(ctx, row, members, ops)
        return Result()

    @staticmethod
    def _commit_outcomes(members: list[Row], calls: dict[str, Row]) -> tuple[list[Transition], str]:
        """Each member's settled commit as a transition, and every failure in words (``""``: none)."""
        ops: list[Transition] = []
        failures: list[str] = []
        for m in members:
            call = calls[m.id]
            if call.state == "succeeded":
                reply = call["result"] or {}
                if m.state == "committing":
                    ops.append(Transition(MEMBERS, m.id, "committing", m.version, "committed", "commit answered",
                                          {"manifest": reply.get("manifest"), "episode_ids": reply.get("episode_ids")}))
            else:
                detail = describe_error(call)
                failures.append(f"{m['participant']} did not commit: {detail}")
                if m.state == "committing":
                    ops.append(Transition(MEMBERS, m.id, "committing", m.version, "failed", "commit failed",
                                          {"detail": detail}))
        return ops, "; ".join(failures)

    async def _publish(self, ctx: Context, row: Row) -> Result:
        """Write the checkpoint's manifest and then ``LATEST``; then resume (the same commit).

        Bounded by the commit deadline (at least :data:`PUBLISH_MIN_S`). A failure, or a write
        still running at the deadline, aborts the checkpoint with the reason in ``detail`` (the
        participants are resumed); a transient error is first tried again, up to
        :data:`PUBLISH_TRIES` in all, while the deadline allows.
        """
        members = await self._members(ctx, row.id, full=True)
        root = Path(row["checkpoint_dir"])
        continued = RolloutSet.from_row(row["rollouts"] or {"continued": row["scope"], "not_dispatched": []})
        # "scope" is what a restore continues; "committed_scope" what every member committed.
        manifest = {"checkpoint_id": row.id, "scope": continued.continued, "committed_scope": row["scope"],
                    "restarts": row["restarts"], "rollouts": continued.as_json(),
                    "members": {m["participant"]: {"kind": m["kind"], "manifest": m["manifest"],
                                                   "episode_ids": m["episode_ids"]} for m in members}}
        path = root / row.id / "checkpoint.json"
        work = Publication(path, json.dumps(manifest, indent=1, sort_keys=True).encode(), root / "LATEST", row.id)
        deadline = self._deadline(row, self.settings.commit_timeout_s, ctx.clock.time())
        if deadline - ctx.clock.time() < PUBLISH_MIN_S:
            # The publish may run past the commit deadline, which the members' leases count from
            # (deadline + their grace): renew them first, to the publish's own bound, and publish
            # once every renew has settled (a member resumed before its renew arrived would refuse
            # it). A renew that failed leaves that member's lease as it was.
            until = self._renew_until.setdefault(row.id, ctx.clock.time() + PUBLISH_MIN_S + CALL_MARGIN_S)
            renewed = await fan_out(ctx, row, [Member(m["participant"], m["kind"], m["url"]) for m in members],
                                    "renew", {"checkpoint_id": row.id, "deadline_ts": until}, until)
            if renewed.open:
                return Result(requeue_after=RENEW_LOOK_S)  # the last reply wakes it sooner
            for failure in renewed.failures:
                log.warning("checkpoint %s: a renew before its late publish failed: %s", row.id, failure)
            self._renew_until.pop(row.id, None)
        try:
            # On the checkpoint file pool, never the default executor (a hung write ties up only that pool).
            await confined.run(work.run, timeout=max(deadline - ctx.clock.time(), PUBLISH_MIN_S))
        except PublishFailed as failure:
            return await self._publish_failed(ctx, row, members, deadline, failure)
        except TimeoutError:
            if not work.abandon():  # the thread undoes whatever it still writes
                return await self._publish_failed(ctx, row, members, deadline, PublishFailed(work.writing, None))
        self._publish_tries.pop(row.id, None)
        published = self._move(ctx, row, "published", "checkpoint manifest and LATEST written",
                               manifest_path=str(path))
        await self._write(ctx, row, [_light(m) for m in members], [
            published, self._move(ctx, _after(row, published), "resuming", "published",
                                  deadline=self.settings.resume_timeout_s)])
        return Result()

    async def _publish_failed(self, ctx: Context, row: Row, members: list[Row], deadline: float,
                              failure: PublishFailed) -> Result:
        """Try a transient failure again while tries and the deadline allow; otherwise abort."""
        tries = self._publish_tries.get(row.id, 0) + 1
        if failure.transient and tries < PUBLISH_TRIES and ctx.clock.time() + PUBLISH_RETRY_S < deadline:
            self._publish_tries[row.id] = tries
            log.warning("checkpoint %s: publish try %d of %d failed, trying again in %.1fs: %s",
                        row.id, tries, PUBLISH_TRIES, PUBLISH_RETRY_S, failure.describe())
            return Result(requeue_after=PUBLISH_RETRY_S)
        self._publish_tries.pop(row.id, None)
        detail = failure.describe()
        log.error("checkpoint %s aborted: %s", row.id, detail)  # one line: the reason is in the journal
        await self._write(ctx, row, [_light(m) for m in members], [self._abort(ctx, row, detail)])
        return Result()

    async def _resuming(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        """Resume members in reverse stage order; every member ends ``resumed``."""
        final = "done" if row.state == "resuming" else "aborted"
        step = self._plan(row, members, ctx.clock.time())
        if step is None:
            await self._finish(ctx, row, members, final)
            return Result()
        calls = await self._settled(ctx, row, members, step)
        if calls is None:
            return self._wait(ctx, step.deadline)
        ops = [Transition(MEMBERS, m.id, "resuming", m.version, "resumed", "resume answered",
                          {"detail": None if calls[m.id].state == "succeeded" else
                           f"resume failed ({describe_error(calls[m.id])}); its lease resumes it"})
               for m in step.members]
        stepping = {m.id for m in step.members}
        last = all(m.state == "resumed" or m.id in stepping for m in members)
        if last and not retries(row, final):
            ops.append(self._move(ctx, row, final, "every member resumed"))
            await self._write(ctx, row, members, ops)
            return Result()
        await self._write(ctx, row, members, ops)
        if last:
            # Member rows have no controller of their own: look at this checkpoint again now (the retry).
            return Result(requeue_after=0.0)
        return Result()

    async def _finish(self, ctx: Context, row: Row, members: list[Row], final: str) -> None:
        if retries(row, final):
            await start_retry(ctx, row, members, {"timings": timings(ctx, row)})
        else:
            await ctx.apply(self._move(ctx, row, final, "every member resumed"))


__all__ = ["MEMBERS", "STAGES", "CheckpointController", "CheckpointTimeouts", "PublishFailed", "member_id",
           "next_try_id", "retirement_id", "start_checkpoint"]
