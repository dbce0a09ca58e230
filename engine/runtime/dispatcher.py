"""The dispatcher: runs RPC intents from the outbox and records their outcomes.

Loop: claim due ``pending`` intents (``pending -> inflight``, fenced, group
committed), call each with bounded concurrency outside any transaction, then
record the outcome and wake the owning entity. A repeatable call its writer
created already ``inflight`` (claimed at creation) is handed over with
:meth:`Dispatcher.send` after its commit and skips the claim:

- a 2xx reply: ``inflight -> succeeded`` with the reply;
- a non-2xx reply with a 4xx status: ``inflight -> failed`` with status, code
  and detail — typed protocol errors are the controller's to decide on;
- a transport error or a 5xx: back to ``pending`` with exponential backoff
  while attempts remain, then ``failed``. A call that is not safe to repeat
  and may have reached the remote becomes ``ambiguous`` instead: it is never
  sent again.

Each connection pool has its own bound on calls in flight (``concurrency`` for ``control``,
``data_concurrency`` for ``data``) and is claimed for separately, so long data calls (a rollout's
``/run`` lasts its episode) never hold the slots a checkpoint's control calls need.

Before each send the dispatcher checks that it still holds a valid lease;
if not, the intent is left ``inflight`` for the next leader's recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from journal import Fence, Journal, LeaseLost, StaleRow, Transition, outbox
from journal.writes import Row

from engine.runtime.clock import Clock
from engine.runtime.crash import pause_point
from engine.runtime.committer import GroupCommitter, NotLeader
from engine.runtime.metrics import Metrics
from engine.runtime.rpc import RemoteError, RpcClient, RpcError, TransportError

log = logging.getLogger("tidelog.dispatcher")

OnDone = Callable[[str, str], None]
#: Shared bodies kept in memory (a fan-out needs one; a few fan-outs may overlap).
BODY_CACHE = 64
#: Reads of a shared body before its call is given up as not sent.
BODY_READ_TRIES = 4


def _worth_recording_again(exc: BaseException) -> bool:
    """A database error, not an answer (stale row, lost lease) nor a cancellation."""
    return isinstance(exc, Exception) and not isinstance(exc, (StaleRow, LeaseLost, NotLeader))


class Dispatcher:
    def __init__(self, journal: Journal, committer: GroupCommitter, rpc: RpcClient, clock: Clock,
                 fence: Callable[[], Fence | None], on_done: OnDone, *, concurrency: int = 32,
                 data_concurrency: int | None = None, batch: int = 64, poll_s: float = 1.0, backoff_base_s: float = 0.5,
                 backoff_cap_s: float = 30.0, metrics: Metrics | None = None) -> None:
        self._journal = journal
        self._committer = committer
        self._rpc = rpc
        self._clock = clock
        self._fence = fence
        self._on_done = on_done
        self._limits: dict[outbox.Pool, int] = {"control": concurrency,
                                        "data": concurrency if data_concurrency is None else data_concurrency}
        self._sems = {pool: asyncio.Semaphore(n) for pool, n in self._limits.items()}
        self._batch = batch
        self._poll_s = poll_s
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._metrics = metrics or Metrics()
        self._wake = asyncio.Event()
        self._calls: set[asyncio.Task[None]] = set()
        self._by_pool: dict[outbox.Pool, set[asyncio.Task[None]]] = {pool: set() for pool in self._limits}
        # Shared bodies by id (content-addressed, so never stale); the bytes every call of a fan-out sends.
        self._bodies: OrderedDict[str, bytes] = OrderedDict()
        self._reading: dict[str, asyncio.Future[bytes]] = {}
        self._running = False
        self._slots_wanted = False

    def wake(self) -> None:
        self._wake.set()

    def send(self, calls: Sequence[Row]) -> None:
        """Send calls their writer created ``inflight`` (claimed at creation, committed).

        While the dispatcher is not running (stopping, or stepped down) they are left
        ``inflight``: the next leader's recovery re-sends them, like any claimed call.
        """
        if not self._running:
            log.warning("not sending %d rpc calls claimed at creation: the dispatcher is not running", len(calls))
            return
        self._start(list(calls))

    def on_commit(self, committed: Any) -> None:
        """Journal commit listener: a new or re-queued intent wakes the dispatcher."""
        for c in committed:
            if c.kind == outbox.KIND and c.to_state == "pending":
                self._wake.set()
                return

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def recover(self) -> list[Row]:
        """Settle intents a previous process left ``inflight`` (see :func:`journal.outbox.recover_inflight`)."""
        rows: list[Row] = await self._committer.run(outbox.recover_inflight)
        for row in rows:
            if row.state == "ambiguous":
                log.warning("rpc %s %s%s for %s %s is ambiguous after restart; not re-sent",
                            row["method"], row["target"], row["path"], row["entity_kind"], row["entity_id"])
                self._on_done(row["entity_kind"], row["entity_id"])
        return rows

    async def run(self) -> None:
        """Dispatch until cancelled; in-flight calls are awaited on cancellation for a clean stop.

        A database error in one pass is logged and the pass is tried again after
        ``poll_s``: the dispatcher only stops when it is cancelled.
        """
        self._running = True
        try:
            while True:
                try:
                    if await self._pass():
                        continue  # there may be more due right now
                    await self._sleep_until_due()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("dispatcher pass failed; trying again in %.1fs", self._poll_s)
                    await self._clock.sleep(self._poll_s)
        finally:
            self._running = False
            if self._calls:
                await asyncio.gather(*list(self._calls), return_exceptions=True)

    def _room(self, pool: outbox.Pool) -> int:
        return self._limits[pool] - len(self._by_pool[pool])

    async def _pass(self) -> bool:
        """Claim what is due and start the calls, pool by pool; True when a pool's claim was full."""
        self._wake.clear()
        full = False
        # A pool with every slot taken: a finished call wakes the loop (else only commits and
        # timers do, so a fan-out's hundreds of replies do not each cost a look at the outbox).
        self._slots_wanted = any(self._room(pool) <= 0 for pool in self._limits)
        for pool in self._limits:
            limit = min(self._room(pool), self._batch)
            if limit > 0:
                full = await self._pass_pool(pool, limit) or full
        return full

    async def _pass_pool(self, pool: outbox.Pool, limit: int) -> bool:
        claiming = asyncio.ensure_future(self._claim(limit, pool))
        try:
            claimed = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # A claim that committed must still be sent (or settled by recovery as
            # ambiguous): start its calls before stopping; run() awaits them.
            try:
                self._start(await claiming)
            except Exception:  # noqa: BLE001 - the claim itself failed: nothing was claimed
                pass
            raise
        self._start(claimed)
        return len(claimed) == limit

    async def _claim(self, limit: int, pool: outbox.Pool) -> list[Row]:
        """Read what is due in ``pool``, then claim each row with its own compare-and-set, all in one
        commit (on PostgreSQL one statement). A row moved meanwhile is stale and skipped."""
        async with self._journal.read() as conn:
            rows = await outbox.due(conn, self._clock.now(), limit=limit, pool=pool)
        outcomes = await self._committer.apply_each([outbox.claim(r) for r in rows])
        claimed = [outbox.claimed(r) for r, got in zip(rows, outcomes) if not isinstance(got, Exception)]
        errors = [got for got in outcomes if isinstance(got, Exception) and not isinstance(got, StaleRow)]
        if errors and not claimed:
            raise errors[0]  # fenced off or the database failed: the run loop logs it and waits
        return claimed

    def _start(self, claimed: list[Row]) -> None:
        for row in claimed:
            task = asyncio.create_task(self._call(row), name=f"tidelog-rpc-{row.id[:12]}")
            self._calls.add(task)
            self._by_pool[row["pool"] if row["pool"] in self._by_pool else "control"].add(task)
            task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        for tasks in self._by_pool.values():
            tasks.discard(task)
        if self._slots_wanted:
            self._wake.set()

    async def _sleep_until_due(self) -> None:
        delay = self._poll_s
        async with self._journal.read() as conn:
            due = await outbox.next_due(conn)
        if due is not None:
            delay = min(delay, max(0.0, (due - self._clock.now()).total_seconds()))
        # What is due and was not claimed waits for a slot of its pool: a finished call wakes the loop.
        if delay <= 0 and any(self._room(pool) <= 0 for pool in self._limits):
            delay = self._poll_s
        if delay <= 0:
            return
        waker = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self._clock.sleep(delay))
        try:
            await asyncio.wait({waker, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
            sleeper.cancel()

    async def _content(self, body_id: str) -> bytes:
        """The bytes of a shared body, read once per id (calls of one fan-out wait on the same read)."""
        cached = self._bodies.get(body_id)
        if cached is not None:
            self._bodies.move_to_end(body_id)
            return cached
        reading = self._reading.get(body_id)
        if reading is None:
            reading = self._reading[body_id] = asyncio.ensure_future(self._read_body(body_id))
            # Retrieved even when every waiter was cancelled, so a failed read is not logged as lost.
            reading.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(reading)

    async def _read_body(self, body_id: str) -> bytes:
        async def read() -> dict[str, bytes]:
            async with self._journal.read() as conn:
                return await outbox.read_bodies(conn, [body_id])

        # A database hiccup must not cost the call its attempt (a prepare has only one): up to
        # BODY_READ_TRIES reads, 0.05 s, 0.1 s, 0.2 s apart on the injectable clock; the last error is raised.
        retrying = AsyncRetrying(stop=stop_after_attempt(BODY_READ_TRIES), wait=wait_exponential(multiplier=0.05),
                                 retry=retry_if_exception_type(Exception), sleep=self._clock.sleep, reraise=True)
        try:
            found: dict[str, bytes] = await retrying(read)
        finally:
            self._reading.pop(body_id, None)
        if body_id not in found:
            raise LookupError(f"shared rpc body {body_id[:12]} is not in rpc_bodies")
        self._bodies[body_id] = found[body_id]
        while len(self._bodies) > BODY_CACHE:
            self._bodies.popitem(last=False)
        return found[body_id]

    async def _call(self, row: Row) -> None:
        owner = (row["entity_kind"], row["entity_id"])
        async with self._sems[row["pool"] if row["pool"] in self._sems else "control"]:
            if self._fence() is None:
                # Lease gone between claim and send: leave it inflight for the next leader.
                log.warning("not sending rpc %s: lease no longer held", row.id[:12])
                return
            # A pause here (tests: TIDELOG_PAUSE_AT) outlives the lease check just made: the
            # participants' epoch fence is what refuses the call then.
            pause_point(f"send:{row['path']}")
            started = time.perf_counter()
            try:
                content = None if row["body_id"] is None else await self._content(row["body_id"])
            except Exception as exc:  # noqa: BLE001 - a database error or a missing body
                # Nothing was sent: retried like a connection refused while attempts remain.
                log.warning("shared body of rpc %s unavailable: %s", row.id[:12], exc)
                await self._record_error(row, TransportError(row["target"], row["method"], row["path"],
                                                             f"shared body unavailable: {exc}", sent=False))
                self._on_done(*owner)
                return
            try:
                result = await self._rpc.call(
                    row["target"], row["method"], row["path"], row["body"], timeout_s=row["timeout_s"],
                    idempotency_key=row.id, pool=row["pool"], repeatable=row["repeatable"], content=content)
            except RpcError as exc:
                self._metrics.rpc_calls.labels(method=row["path"], outcome=type(exc).__name__).inc()
                self._metrics.rpc_seconds.labels(method=row["path"]).observe(time.perf_counter() - started)
                await self._record_error(row, exc)
            else:
                self._metrics.rpc_calls.labels(method=row["path"], outcome="ok").inc()
                self._metrics.rpc_seconds.labels(method=row["path"]).observe(time.perf_counter() - started)
                await self._record(outbox.succeeded(row, result), row)
        self._on_done(*owner)

    async def _record_error(self, row: Row, exc: RpcError) -> None:
        error = exc.as_dict()
        attempts: int = row["attempts"]
        if isinstance(exc, RemoteError) and not exc.retryable:
            reason = f"remote refused: HTTP {exc.status} {exc.code or ''}".rstrip()
            await self._record(outbox.failed(row, error, reason=reason), row)
            return
        maybe_sent = exc.sent if isinstance(exc, TransportError) else True
        if not row["repeatable"] and maybe_sent:
            await self._record(Transition(outbox.KIND, row.id, "inflight", row.version, "ambiguous",
                                          f"not safe to repeat and outcome unknown: {exc}", {"error": error}), row)
            return
        if attempts >= row["max_attempts"]:
            await self._record(outbox.failed(row, error, reason=f"gave up after {attempts} attempts: {exc}"), row)
            return
        at = self._clock.now() + outbox.backoff(attempts, base_s=self._backoff[0], cap_s=self._backoff[1])
        await self._record(outbox.retried(row, error, at=at), row)

    async def _record(self, op: Transition, row: Row, *, tries: int = 5) -> None:
        """Record an outcome (one compare-and-set, group-committed with other outcomes)."""
        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.warning("recording the outcome of rpc %s failed; retrying", row.id[:12], exc_info=exc)

        # A database error is retried (0.1 s, 0.2 s, ... apart on the injectable clock, ``tries`` in
        # all); a stale row or a lost lease is an answer, not an error, and is never retried.
        retrying = AsyncRetrying(stop=stop_after_attempt(tries), wait=wait_exponential(multiplier=0.1),
                                 retry=retry_if_exception(_worth_recording_again), before_sleep=log_retry,
                                 sleep=self._clock.sleep, reraise=True)
        try:
            await retrying(self._committer.apply, op)
        except StaleRow as exc:
            # Another orchestrator (after a take-over) settled this intent first.
            log.warning("outcome of rpc %s not recorded: %s", row.id[:12], exc)
        except (LeaseLost, NotLeader) as exc:
            # Fenced: the intent stays inflight and the next leader's recovery settles it.
            log.warning("outcome of rpc %s not recorded, lease lost: %s", row.id[:12], exc)
        except Exception:
            # Left inflight: the next election's recovery settles it (re-send if repeatable).
            log.exception("outcome of rpc %s not recorded after %d tries", row.id[:12], tries)
