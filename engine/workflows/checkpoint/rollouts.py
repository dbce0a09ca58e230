"""The rollout machine: every attempt of every rollout is a step of its ``rollouts`` row.

States (``journal.machines.ROLLOUTS``) and what :class:`RolloutController` does in each:

- ``pending``: the rollout waits for a slot. Dispatch is admitted only while no checkpoint and no
  restore is open (the protocol's controller sends no new ``/run`` from prepare to resume), a
  healthy environment server has room (``per_environment`` attempts in flight each) and fewer than
  ``max_in_flight`` attempts are in flight in all. Admitted, one write moves the row to
  ``dispatched`` (its ``environment``, ``run_call``, ``dispatched_at``) and creates the ``/run``
  intent; the admission is checked again inside that write, so two dispatches never take one slot.
  That write fills every free slot, not only the row's own: it takes the oldest other ``pending``
  rows (not pinned to an environment by a restore) with it, each to the least busy environment, so
  a queue of thousands is dispatched in a few writes, not one write and three reads per row.
  A row refused a slot is parked in memory and woken when a slot frees (or a checkpoint or restore
  ends, or an environment turns healthy); every resync looks at it again anyway. Once a look found
  no slot for a reason only a commit can change, the rows after it park without reading until
  such a commit comes.
- ``dispatched``: the ``/run`` is an outbox intent that is **not safe to repeat** (a second
  execution of an attempt orphans the first one's agent session), on the ``data`` pool (the look
  its own dispatch commit causes is skipped: until the reply, which wakes it, there is nothing to
  decide). Its body is
  ``{"rollout_id": "<id>" | "<id>-a<N>", "task": <input>}``: attempt N ≥ 1 is named by the
  attempt-qualified id, as the protocol's agents read it. When the call settles:
  ``succeeded`` → ``finished`` (the reply is the ``result``); ``ambiguous`` (in flight when an
  orchestrator died, or the connection broke after the request left) → ``ambiguous``; refused
  before the attempt started (``checkpoint_parked``: a checkpoint closed admission first; or the
  request never left) → back to ``pending`` as the same attempt; any other error → ``errored``,
  ``failures`` + 1. A ``dispatched`` row without a ``run_call`` was sent by someone else (a test's
  own controller) and is left alone.
- ``ambiguous`` and ``errored``: the attempt is retired everywhere (a ``retirements`` request
  ``rerun-…`` naming it, created in the same write that moves the row to ``retiring``), so nothing
  of it can still run or write, before the rollout goes on.
- ``retiring``: if that retirement failed (a participant down past its deadline), it is requested
  again as ``rerun-…-t<N>``, ``forget_retry_s`` after the failure (a ``retiring`` self-edge), so no
  rollout is left retiring for good.
- ``retired`` by its own ``rerun-…`` request → ``failed`` once ``failures`` reached
  ``max_failures`` (the reason names the last error), else → ``pending`` as attempt N + 1, run again
  from its input. A rollout retired by another request (an operator's ``POST
  /v1/rollouts/{id}/retire``) stays ``retired``: what comes next is the operator's (``forget``).

- ``finished`` and ``failed``: done for good, so forgotten everywhere, in batches
  (:mod:`engine.workflows.checkpoint.forgetting`): the forget's end moves them to ``forgotten``.
  A done row that finds a batch open waits in memory for its end. With ``training.batching``, a
  ``finished`` row waits first for a training batch to take it (its ``finished -> finished`` self-edge
  sets ``batch_id``; :mod:`engine.workflows.training.batching`): its result is the job's data.

The row's ``detail`` says why its last attempt ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from journal import Committed, Transition, WriteTx, models, outbox
from journal.machines import CHECKPOINTS, RESTORES, RETIREMENTS
from journal.readiness import deployment_held
from journal.writes import Row
from workers.protocol import EpisodeId, ErrorCode

from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.checkpoint.forgetting import DONE, PREFIX as FORGET_PREFIX, ForgetWaits, request_forget_batch
from engine.workflows.checkpoint.retirement import request_retirement
from engine.workflows.checkpoint.rules import open_workflow

log = logging.getLogger("tidelog.rollouts")

KIND = "rollouts"
RUN_PATH = "/run"
#: Errors that say the attempt never started, so sending it again as the same attempt is safe.
NOT_STARTED = frozenset({ErrorCode.CHECKPOINT_PARKED.value})
#: Seconds an environment that refused a connection is passed over by new dispatches.
COOLDOWN_S = 2.0


@dataclass(frozen=True)
class RolloutSettings:
    """Dispatch bounds and the retry rule (the ``rollouts`` section of the configuration)."""

    max_in_flight: int = 256
    per_environment: int = 32
    max_failures: int = 3
    run_timeout_s: float = 3600.0
    #: Most rollouts one forget request names, and the wait after a failed one.
    forget_batch: int = 1000
    forget_retry_s: float = 5.0
    #: The training deployment whose committed weight version each attempt records (None: no training).
    deployment: str | None = None
    #: ``training.batching.enabled``: a finished rollout is forgotten only once a batch took it.
    batched: bool = False


class Parked(Exception):
    """No slot for a dispatch now; says why (the row waits, parked). ``after``: the seconds until
    a slot may free by itself (an environment's cooldown ends), for the row to look again then."""

    def __init__(self, why: str, after: float | None = None) -> None:
        super().__init__(why)
        self.after = after


@dataclass(frozen=True)
class Slot:
    name: str
    url: str


def run_body(rollout_id: str, attempt: int, task: Any) -> dict[str, Any]:
    """The ``/run`` body of ``attempt`` of ``rollout_id``: the attempt-qualified id and the input."""
    return {"rollout_id": EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key, "task": task}


def rerun_id(rollout_id: str, attempt: int) -> str:
    """The id of the retirement that retires ``attempt`` of ``rollout_id`` before the next one."""
    digest = hashlib.sha256(f"{rollout_id}\x1f{attempt}".encode()).hexdigest()[:24]
    return f"rerun-{digest}"


class RolloutController(BaseController):
    """Runs ``rollouts`` rows (see the module docstring)."""

    kind = KIND

    def __init__(self, settings: RolloutSettings | None = None) -> None:
        self.settings = settings or RolloutSettings()
        # Pending rows refused a slot, oldest first: a wake-up list only (resync covers them too).
        self._parked: dict[str, None] = {}
        # Done rows waiting for the next forget batch (the same: resync covers them too).
        self._done: dict[str, None] = {}
        self._cooling: dict[str, float] = {}
        # Rerun retirement id -> its rollout, for the rollout to look again when it fails (a
        # wake-up only: after a restart the resync finds a row left retiring).
        self._reruns: dict[str, str] = {}
        # Bumped by every commit that wakes parked (dispatch) or done (forget) rows: a row that
        # looked before such a commit and parks after it would miss its wake-up, so it looks again.
        self._slot_wakes = 0
        self._forget_wakes = 0
        # The _slot_wakes / _forget_wakes value at which a look found every slot taken (or a forget
        # batch open): until a commit bumps it, the next rows wait without reading or writing.
        self._full_at: tuple[int, Parked] | None = None
        self._batch_open_at: int | None = None
        # Rows whose next look is known to have nothing to do, skipped once without a read: a row
        # just dispatched (its /run is not even sent; the reply wakes it through ``waiting``), a
        # row done while a forget batch is open (it waits for the next) and a row just forgotten
        # (terminal). Any other wake-up clears the mark first.
        self._unneeded: set[str] = set()
        # Parked rows woken for a free slot and not looked at yet (see _pass_on).
        self._woken: set[str] = set()
        # A dispatch round is being written (and another was asked for meanwhile).
        self._dispatching = False
        self._again = False
        self._enqueue: Callable[[str, str], None] | None = None

    # -- wake-ups -----------------------------------------------------------------------------------

    def attach(self, enqueue: Callable[[str, str], None]) -> None:
        self._enqueue = enqueue

    def on_commit(self, committed: Sequence[Committed]) -> None:
        freed, reopened = 0, False
        for c in committed:
            if c.kind == KIND:
                # A row dispatched (by another row's write) or forgotten no longer waits here; the
                # look this very commit causes has nothing to do (see _unneeded), so it is skipped.
                if c.to_state == "dispatched":
                    self._parked.pop(c.entity_id, None)
                    if c.from_state == "pending":
                        self._unneeded.add(c.entity_id)
                elif c.to_state == "forgotten":
                    self._done.pop(c.entity_id, None)
                    self._unneeded.add(c.entity_id)
                elif self.settings.batched and c.to_state == "finished" and c.from_state != "finished":
                    # Just finished, so no batch has taken it: nothing to do until one does (its
                    # finished -> finished commit wakes it).
                    self._unneeded.add(c.entity_id)
                elif c.to_state in DONE and self._batch_open_at == self._forget_wakes:
                    # Done while a forget batch is open: it waits for the next, as its look would decide.
                    self._done[c.entity_id] = None
                    self._unneeded.add(c.entity_id)
                else:
                    # Any other move (a restore re-pinning it, say) must be looked at: no skip.
                    self._unneeded.discard(c.entity_id)
                    if c.from_state == "pending" and c.to_state != "pending":
                        self._parked.pop(c.entity_id, None)
        for c in committed:
            if c.kind == KIND and c.from_state == "dispatched" and c.to_state != "dispatched":
                freed += 1
            elif c.kind == "checkpoints" and c.to_state in CHECKPOINTS.terminal:
                reopened = True
            elif c.kind == "restores" and c.to_state in RESTORES.terminal:
                reopened = True
            elif c.kind == "participants" and c.to_state == "healthy" and c.from_state != "healthy":
                reopened = True
            elif (c.kind == "services" and c.to_state == "ready") or (c.kind == "engines" and c.to_state == "serving"
                                                                       and c.from_state != "serving"):
                reopened = True  # the deployment may be ready again (dispatch held meanwhile)
            elif (c.kind == "retirements" and c.entity_id.startswith(FORGET_PREFIX)
                  and c.to_state in RETIREMENTS.terminal):
                self._forget_wakes += 1
                self._wake(1, self._done)  # the next batch takes every done row, up to forget_batch
            elif c.kind == "retirements" and c.to_state in RETIREMENTS.terminal and c.entity_id in self._reruns:
                rollout = self._reruns.pop(c.entity_id)
                if c.to_state == "failed" and self._enqueue is not None:
                    self._enqueue(KIND, rollout)
        if reopened or freed:
            self._slot_wakes += 1
        self._wake(self.settings.max_in_flight if reopened else freed, self._parked)

    def _wake(self, n: int, parked: dict[str, None]) -> None:
        if n <= 0 or not parked or self._enqueue is None:
            return
        for entity_id in list(parked)[:n]:
            del parked[entity_id]
            self._unneeded.discard(entity_id)
            if parked is self._parked:
                self._woken.add(entity_id)
            self._enqueue(KIND, entity_id)

    def _pass_on(self, entity_id: str) -> None:
        """A row woken for a free slot that is no longer pending (another round took it after it
        parked): the wake-up goes to the next parked row, so the slot is not left empty."""
        if entity_id in self._woken:
            self._woken.discard(entity_id)
            self._wake(1, self._parked)

    def _wake_later(self, after: float) -> None:
        """Wake one parked row in ``after`` seconds (its round fills every slot free then)."""
        asyncio.get_running_loop().call_later(max(after, 0.0), self._wake, 1, self._parked)

    async def lost(self) -> None:
        """The lease was lost (the loops have stopped): what this controller knew of the rows is
        forgotten, since another leader may change them before this process leads again; the
        resync of the next term looks at every row afresh."""
        self._parked.clear()
        self._done.clear()
        self._unneeded.clear()
        self._woken.clear()
        self._full_at = None
        self._batch_open_at = None
        self._dispatching = self._again = False

    def waiting(self, entity_id: str) -> bool:
        # The row's /run settled: the look it wakes must read the row (never skipped).
        self._unneeded.discard(entity_id)
        return False

    # -- reconcile ----------------------------------------------------------------------------------

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        if entity_id in self._unneeded:
            self._unneeded.discard(entity_id)
            return Result()
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state != "pending":
            self._pass_on(entity_id)
        else:
            self._woken.discard(entity_id)
        if row is None:
            return Result()
        if row.state == "pending":
            return await self._dispatch(ctx, row)
        if row.state == "dispatched":
            return await self._settle(ctx, row)
        if row.state in ("ambiguous", "errored"):
            return await self._retire(ctx, row)
        if row.state == "retired":
            return await self._next(ctx, row)
        if row.state == "retiring":
            return await self._retiring(ctx, row)
        if row.state in DONE:
            return await self._forget(ctx, row)
        return Result()

    # -- pending: admission and dispatch ------------------------------------------------------------

    async def _slots(self, conn: Any, now: float, pinned: str | None = None) -> list[Slot]:
        """The free slots, in dispatch order: each next one on the least busy environment (``pinned``:
        on that one only), as many as ``max_in_flight`` and ``per_environment`` leave; or
        :class:`Parked` saying why there is none."""
        blocker = await open_workflow(conn) or await deployment_held(conn)
        if blocker is not None:
            raise Parked(blocker)
        p, t = models.participants, models.rollouts
        envs = (await conn.execute(sa.select(p.c.id, p.c.url).where(
            p.c.state == "healthy", p.c.kind == "environment").order_by(p.c.id))).all()
        envs = [e for e in envs if pinned is None or e.id == pinned]
        cooling = [self._cooling[e.id] for e in envs if self._cooling.get(e.id, 0.0) > now]
        envs = [e for e in envs if self._cooling.get(e.id, 0.0) <= now]
        if not envs and cooling:
            raise Parked("every environment server that could take it refused an attempt just now",
                         after=min(cooling) - now)
        if not envs:
            raise Parked("no healthy environment server" if pinned is None else
                         f"environment {pinned}, which holds the restored attempt, is not healthy")
        busy = dict((await conn.execute(sa.select(t.c.environment, sa.func.count()).where(
            t.c.state == "dispatched").group_by(t.c.environment))).all())
        room = self.settings.max_in_flight - sum(busy.values())
        if room <= 0:
            raise Parked(f"{self.settings.max_in_flight} attempts in flight (rollouts.max_in_flight)")
        # Least busy first, then by name: a heap of (in flight, name, url), one slot taken at a time.
        heap = [(busy.get(e.id, 0), e.id, e.url) for e in envs if busy.get(e.id, 0) < self.settings.per_environment]
        if not heap:
            # A cooling environment may have room once its cooldown ends, which no commit announces.
            raise Parked(f"every environment server has {self.settings.per_environment} attempts in flight "
                         "(rollouts.per_environment)" + (" or refused an attempt just now" if cooling else ""),
                         after=min(cooling) - now if cooling else None)
        heapq.heapify(heap)
        slots: list[Slot] = []
        while heap and len(slots) < room:
            n, name, url = heapq.heappop(heap)
            slots.append(Slot(name, url))
            if n + 1 < self.settings.per_environment:
                heapq.heappush(heap, (n + 1, name, url))
        return slots

    async def _head(self, tx: WriteTx) -> str | None:
        """The deployment's committed weight version now: what the attempt's policy serves (the
        engine gate serves nothing uncommitted), or ``None`` without training."""
        if self.settings.deployment is None:
            return None
        v = models.weight_versions
        head: str | None = (await tx.execute(sa.select(v.c.id).where(
            v.c.deployment == self.settings.deployment, v.c.state == "committed")
            .order_by(v.c.sequence.desc()).limit(1))).scalar()
        return head

    def _park(self, row: Row, why: Parked, wakes: int) -> Result:
        if self._slot_wakes != wakes:
            return Result(requeue_after=0.0)  # a slot may have freed while it looked: look again now
        log.debug("rollout %s waits: %s", row.id, why)
        self._parked[row.id] = None
        if why.after is not None:
            return Result(requeue_after=why.after)
        if row["restored_on"] is None:
            self._full_at = (wakes, why)  # only a commit (which bumps _slot_wakes) can free a slot
        return Result()

    async def _dispatch(self, ctx: Context, row: Row) -> Result:
        now = ctx.clock.time()
        wakes = self._slot_wakes
        pinned = row["restored_on"]
        if pinned is None:
            if self._full_at is not None and self._full_at[0] == wakes:
                return self._park(row, self._full_at[1], wakes)
            if self._dispatching:
                # A round is being written; it runs once more when it is done, which takes this row if
                # a slot is free (rounds back to back batch dispatches as group commit batches writes).
                self._again = True
                self._parked[row.id] = None
                return Result()
        if pinned is not None:
            try:
                await self._round(ctx, row, pinned, now)
            except Parked as exc:
                return self._park(row, exc, wakes)
            return Result()
        self._dispatching, self._again = True, False
        try:
            try:
                await self._round(ctx, row, None, now)
            except Parked as exc:
                return self._park(row, exc, wakes)
            while self._again:
                self._again = False
                wakes = self._slot_wakes
                try:
                    await self._round(ctx, None, None, ctx.clock.time())
                except Parked as exc:
                    # The rows that asked for this round are parked: a commit that frees a slot
                    # wakes them, or (a cooling environment) a timer does.
                    if exc.after is not None:
                        self._wake_later(exc.after)
                    elif self._slot_wakes == wakes:
                        self._full_at = (wakes, exc)
                    else:
                        self._again = True  # a slot freed meanwhile: look again
                        continue
                    break
        except BaseException:
            self._wake(1, self._parked)  # a failed round must not strand the rows that asked for it
            raise
        finally:
            self._dispatching = self._again = False
        return Result()

    async def _round(self, ctx: Context, first: Row | None, pinned: str | None, now: float) -> list[str]:
        """One write that dispatches ``first`` (if still at the version read, so as the pending row
        it was, pinned or not) and, unless it is ``pinned`` to an environment, the oldest other
        unpinned pending rows, one per free slot; the ids sent. Raises :class:`Parked` (nothing
        written) when no slot is free."""
        async def write(tx: WriteTx) -> list[str]:
            slots = await self._slots(tx, now, pinned)
            t = models.rollouts
            query = sa.select(t.c.id, t.c.version, t.c.attempt, t.c.task).where(t.c.state == "pending")
            mine = None if first is None else sa.and_(t.c.id == first.id, t.c.version == first.version)
            if pinned is not None:
                assert mine is not None
                query = query.where(mine)
            else:
                order: list[Any] = [t.c.created_at, t.c.id]
                if first is not None:
                    order.insert(0, sa.case((t.c.id == first.id, 0), else_=1))
                query = (query.where(t.c.restored_on.is_(None) if mine is None else
                                     sa.or_(mine, t.c.restored_on.is_(None)))
                         .order_by(*order).limit(len(slots)))
            taken = (await tx.execute(query)).all()
            head = await self._head(tx) if taken else None
            intents: list[tuple[outbox.Intent, str]] = []
            moves: list[Transition] = []
            for slot, r in zip(slots, taken):
                intent = outbox.Intent(KIND, r.id, "pending", r.version, slot.url, "POST", RUN_PATH,
                                       body=run_body(r.id, int(r.attempt), r.task),
                                       timeout_s=self.settings.run_timeout_s, repeatable=False, pool="data",
                                       max_attempts=3)
                reason = f"attempt {r.attempt} sent to {slot.name}"
                moves.append(Transition(KIND, r.id, "pending", r.version, "dispatched", reason,
                                        {"environment": slot.name, "run_call": intent.id, "dispatched_at": tx.now,
                                         "ended_at": None, "weight_version": head}))
                intents.append((intent, reason))
            await tx.apply(moves)  # one statement for the batch (same shape), each row still compare-and-set
            await outbox.ensure_all(tx, intents)
            return [r.id for r in taken]
        sent: list[str] = await ctx.write(write)
        return sent

    # -- dispatched: the /run's outcome -------------------------------------------------------------

    async def _settle(self, ctx: Context, row: Row) -> Result:
        if row["run_call"] is None:
            return Result()
        # A group read: the rows whose calls settled in one commit share one query.
        found = await ctx.get(outbox.KIND, row["run_call"])
        if found is None:
            log.error("rollout %s: its /run intent %s is not in the outbox", row.id, row["run_call"][:12])
            return Result()
        attempt, env = int(row["attempt"]), row["environment"]
        if found.state == "succeeded":
            await self._move(ctx, row, "finished", f"attempt {attempt} finished on {env}",
                             result=found["result"])
        elif found.state == "ambiguous":
            await self._move(ctx, row, "ambiguous", f"attempt {attempt}'s /run to {env} has no known outcome "
                             f"(not sent again): {_said(found['error'])}", detail=_said(found["error"]))
        elif found.state == "failed":
            error = found["error"] if isinstance(found["error"], Mapping) else {}
            if error.get("code") in NOT_STARTED or (error.get("type") == "TransportError" and not error.get("sent")):
                # Passed over for a moment (closed by a checkpoint of someone else's, or not
                # answering): sending the attempt straight back would only be refused again.
                if env is not None:
                    self._cooling[env] = ctx.clock.time() + COOLDOWN_S
                await self._move(ctx, row, "pending", f"attempt {attempt} did not start on {env} "
                                 f"({_said(error)}); it is sent again", run_call=None, environment=None)
            else:
                failures = int(row["failures"]) + 1
                await self._move(ctx, row, "errored", f"attempt {attempt} failed on {env}: {_said(error)}",
                                 failures=failures, detail=f"attempt {attempt} on {env}: {_said(error)}")
        return Result()

    async def _move(self, ctx: Context, row: Row, to: str, reason: str, **changes: Any) -> None:
        """One compare-and-set of the row to ``to``; ``ended_at`` is when the attempt ended (none
        for a row that waits for its next dispatch). A declared operation, so the moves of many rows
        committed together go as one statement."""
        values = {**changes, "ended_at": None if to == "pending" else ctx.clock.now()}
        await ctx.apply(Transition(KIND, row.id, row.state, row.version, to, reason[:500], values))

    # -- ambiguous, errored: retire the attempt everywhere ------------------------------------------

    async def _retire(self, ctx: Context, row: Row) -> Result:
        attempt = int(row["attempt"])
        retirement = rerun_id(row.id, attempt)

        async def write(tx: WriteTx) -> None:
            await request_retirement(tx, retirement, "retire", episodes=[EpisodeId(rollout_id=row.id,
                                                                                     attempt=attempt)])
            await tx.transition(KIND, row.id, from_state=row.state, version=row.version, to_state="retiring",
                                reason=f"attempt {attempt} is retired everywhere before the rollout goes on "
                                       f"({retirement})")
        await ctx.write(write)
        self._reruns[retirement] = row.id
        return Result()

    async def _retiring(self, ctx: Context, row: Row) -> Result:
        """A rerun retirement that failed (a participant down past its deadline) is requested again
        as ``<rerun id>-t<N>``, ``forget_retry_s`` after it ended: a rollout is never left retiring."""
        base = rerun_id(row.id, int(row["attempt"]))
        q = models.retirements
        async with ctx.journal.read() as conn:
            tries = (await conn.execute(sa.select(q.c.id, q.c.state, q.c.updated_at).where(
                sa.or_(q.c.id == base, q.c.id.like(f"{base}-t%"))))).all()
        if not tries:
            return Result()  # retired by someone else's request (an operator's): theirs to finish
        number, last = max(((_try_number(base, t.id), t) for t in tries), key=lambda nt: nt[0])
        if last.state != "failed":
            self._reruns[last.id] = row.id
            return Result()  # still running (its end moves the row, or wakes it if it fails), or done
        wait = self.settings.forget_retry_s - (ctx.clock.now() - last.updated_at).total_seconds()
        if wait > 0:
            return Result(requeue_after=wait)
        again = f"{base}-t{number + 1}"
        attempt = int(row["attempt"])

        async def write(tx: WriteTx) -> None:
            await request_retirement(tx, again, "retire", episodes=[EpisodeId(rollout_id=row.id, attempt=attempt)])
            await tx.transition(KIND, row.id, from_state="retiring", version=row.version, to_state="retiring",
                                reason=f"retirement {last.id} failed; retiring attempt {attempt} again ({again})")
        await ctx.write(write)
        self._reruns[again] = row.id
        return Result()

    # -- finished, failed: forgotten everywhere, in batches ------------------------------------------

    async def _forget(self, ctx: Context, row: Row) -> Result:
        if self.settings.batched and row.state == "finished" and row["batch_id"] is None:
            # Its result is what a batch trains on: kept until a batch takes it (that commit wakes it).
            return Result()
        wakes = self._forget_wakes
        if self._batch_open_at == wakes:
            # A batch was open at this generation and none has ended since (each end bumps it):
            # asking again would only be refused, in a write of its own per done row.
            return self._wait_for_batch(row, wakes)

        async def write(tx: WriteTx) -> list[str]:
            return await request_forget_batch(tx, limit=self.settings.forget_batch,
                                              retry_s=self.settings.forget_retry_s, batched=self.settings.batched)
        try:
            named = await ctx.write(write)
        except ForgetWaits as exc:
            if exc.after is not None:
                return Result(requeue_after=exc.after)
            self._batch_open_at = wakes
            return self._wait_for_batch(row, wakes)
        if named:
            self._batch_open_at = wakes
        return Result() if row.id in named else self._wait_for_batch(row, wakes)

    def _wait_for_batch(self, row: Row, wakes: int) -> Result:
        if self._forget_wakes != wakes:
            return Result(requeue_after=0.0)  # the open batch ended while it looked: look again now
        self._done[row.id] = None
        return Result()

    # -- retired: the next attempt, or the end --------------------------------------------------------

    async def _next(self, ctx: Context, row: Row) -> Result:
        attempt, failures = int(row["attempt"]), int(row["failures"])
        q = models.retirements
        async with ctx.journal.read() as conn:
            ours = (await conn.execute(sa.select(q.c.state).where(q.c.id == rerun_id(row.id, attempt)))).scalar()
        if ours is None:
            return Result()  # retired by someone else's request (an operator's): it stays retired
        if failures >= self.settings.max_failures:
            await self._move(ctx, row, "failed", f"failed: {failures} attempt(s) ended in an error "
                             f"(rollouts.max_failures = {self.settings.max_failures}); the last: {row['detail']}")
            return Result()
        await self._move(ctx, row, "pending", f"attempt {attempt} retired; the rollout runs again from its "
                         f"input as attempt {attempt + 1}", attempt=attempt + 1, run_call=None, environment=None,
                         restored_on=None)
        return Result()


def _try_number(base: str, retirement_id: str) -> int:
    """1 for the rerun retirement ``base`` itself, N for ``<base>-tN``."""
    return 1 if retirement_id == base else int(retirement_id.rsplit("-t", 1)[1])


def _said(error: Any) -> str:
    """A recorded call error in a few words: ``HTTP 409 stale_attempt: detail`` or the transport's words."""
    if not isinstance(error, Mapping):
        return "no error recorded"
    if error.get("type") == "RemoteError":
        code = f" {error['code']}" if error.get("code") else ""
        return f"HTTP {error.get('status')}{code}: {str(error.get('detail', ''))[:300]}"
    return f"{error.get('type', 'error')}: {str(error.get('detail', ''))[:300]}"


__all__ = ["KIND", "NOT_STARTED", "RUN_PATH", "Parked", "RolloutController", "RolloutSettings", "open_workflow",
           "rerun_id", "run_body"]
