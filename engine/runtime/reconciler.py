"""The reconciler: level-triggered controllers over journal rows.

Contract for a controller (see docs/architecture.md, "Adding a workflow"):

- it is registered for one entity kind and is handed an entity id;
- it reads what it needs from the journal, decides, and writes the next step
  (transitions and RPC intents) through ``ctx.write``; it keeps no state
  between calls and never relies on having seen an earlier event;
- reconciling the same row twice in a row writes nothing the second time;
- it returns ``Result(requeue_after=…)`` to be looked at again later.

Keys (``kind:id``) reach the de-duplicating queue from journal commits in this
process, from completed RPC intents, from ``requeue_after`` timers and from a
periodic full resync of every non-terminal row. Start-up and take-over are just
a full resync: there is no separate recovery path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import sqlalchemy as sa

from journal import Committed, Journal, LeaseLost, StaleRow, WriteTx
from journal.batch import Op
from journal.writes import Row

from engine.runtime.clock import Clock
from engine.runtime.committer import GroupCommitter, NotLeader
from engine.runtime.groupread import GroupReader
from engine.runtime.metrics import Metrics
from engine.runtime.workqueue import WorkQueue

log = logging.getLogger("tidelog.reconciler")
T = TypeVar("T")


@dataclass(frozen=True)
class Result:
    """What a reconcile asks for next: nothing, or another look after ``requeue_after`` seconds."""

    requeue_after: float | None = None


class Context:
    """What a controller may use: the journal (reads), fenced group-committed writes, the clock."""

    def __init__(self, journal: Journal, committer: GroupCommitter, clock: Clock) -> None:
        self.journal = journal
        self.clock = clock
        self._committer = committer
        self._reader = GroupReader(journal)
        self._sender: Callable[[Sequence[Row]], None] | None = None

    def attach_sender(self, send: Callable[[Sequence[Row]], None]) -> None:
        """Let controllers claim the calls they write (see :attr:`claims`); ``send`` takes them."""
        self._sender = send

    @property
    def claims(self) -> bool:
        """Whether writes may create repeatable calls already ``inflight``
        (``outbox.ensure_all(..., claim=ctx.claims)``): only where a dispatcher takes them
        through :meth:`send` after the commit."""
        return self._sender is not None

    def send(self, calls: Sequence[Row]) -> None:
        """Hand calls this orchestrator created ``inflight`` (committed) to its dispatcher."""
        if calls:
            if self._sender is None:
                raise RuntimeError("calls were claimed at creation, but no dispatcher is attached to send them")
            self._sender(calls)

    async def write(self, fn: Callable[[WriteTx], Awaitable[T]]) -> T:
        """Run ``fn`` in a fenced (group-committed) write transaction."""
        return await self._committer.run(fn)

    async def apply(self, *ops: Op) -> list[Committed | None]:
        """Write declarative operations, all-or-nothing, batched with other controllers' writes."""
        return await self._committer.apply(*ops)

    async def get(self, kind: str, entity_id: str) -> Row | None:
        return await self._reader.get(kind, entity_id)


class Controller(Protocol):
    """What the reconciler runs for one kind (the contract in this module's docstring).

    ``waiting``, ``on_commit`` and ``attach`` are the optional hooks; :class:`BaseController` gives
    each its do-nothing default, so a controller subclasses it and overrides what it needs."""

    kind: str

    async def reconcile(self, ctx: Context, entity_id: str) -> Result: ...

    def waiting(self, entity_id: str) -> bool:
        """Whether the row still waits on other calls: a call's reply then does not wake it (a
        fan-out is looked at once, when its last reply is in, not once per reply)."""
        ...

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """Every commit of this process, before any wake-up (for an in-memory view of its calls)."""
        ...

    def attach(self, enqueue: Callable[[str, str], None]) -> None:
        """Called once at registration with the reconciler's ``enqueue(kind, id)``: a controller
        that parks rows (waiting for capacity) wakes them with it. A wake-up only: a parked row
        is also looked at again by its ``requeue_after`` and by every resync."""
        ...


class BaseController:
    """The optional hooks' defaults: never waiting, no interest in commits, nothing to wake."""

    kind: str

    def waiting(self, entity_id: str) -> bool:
        return False

    def on_commit(self, committed: Sequence[Committed]) -> None:
        return None

    def attach(self, enqueue: Callable[[str, str], None]) -> None:
        return None


def key_of(kind: str, entity_id: str) -> str:
    return f"{kind}:{entity_id}"


class Reconciler:
    """Runs registered controllers over a de-duplicating work queue with bounded concurrency."""

    def __init__(self, journal: Journal, committer: GroupCommitter, clock: Clock, *,
                 concurrency: int = 16, resync_interval_s: float = 30.0,
                 metrics: Metrics | None = None,
                 error_backoff_s: tuple[float, float] = (0.5, 60.0)) -> None:
        self.journal = journal
        self.clock = clock
        self.queue = WorkQueue(clock)
        self.controllers: dict[str, Controller] = {}
        self.ctx = Context(journal, committer, clock)
        self._concurrency = concurrency
        self._resync_interval_s = resync_interval_s
        self._metrics = metrics or Metrics()
        self._failures: dict[str, int] = {}
        self._backoff = error_backoff_s
        self._lease_lost: asyncio.Event = asyncio.Event()
        self._running = False
        self._draining = False
        self._busy: set[asyncio.Task[None]] = set()

    # -- registration and wake-ups ---------------------------------------------------------
    def register(self, controller: Controller) -> None:
        if controller.kind in self.controllers:
            raise ValueError(f"a controller for {controller.kind!r} is already registered")
        self.journal.kinds.get(controller.kind)  # the kind must exist
        self.controllers[controller.kind] = controller
        controller.attach(self.enqueue)

    def enqueue(self, kind: str, entity_id: str) -> None:
        if kind in self.controllers:
            self.queue.add(key_of(kind, entity_id))

    def call_done(self, kind: str, entity_id: str) -> None:
        """The dispatcher finished a call owned by ``kind``/``entity_id``: look at it again, unless
        its controller says it is still waiting on other calls (:meth:`Controller.waiting`)."""
        controller = self.controllers.get(kind)
        if controller is not None and controller.waiting(entity_id):
            return
        self.enqueue(kind, entity_id)

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """Journal commit listener: every entity written in this process is looked at again."""
        for c in committed:
            self.enqueue(c.kind, c.entity_id)

    async def resync(self) -> int:
        """Queue every non-terminal row of every controlled kind; returns how many."""
        n = 0
        async with self.journal.read() as conn:
            for kind in self.controllers:
                ek = self.journal.kinds.get(kind)
                ids = (await conn.execute(sa.select(ek.table.c.id)
                                          .where(ek.table.c.state.in_(sorted(ek.machine.active))))).scalars()
                for entity_id in ids:
                    self.enqueue(kind, entity_id)
                    n += 1
        return n

    # -- running ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Reconcile until cancelled, or until a write finds the lease lost (raises LeaseLost)."""
        self._running = True
        self._draining = False
        self._lease_lost.clear()
        tasks = [asyncio.create_task(self.queue.run_timers(), name="tidelog-timers"),
                 asyncio.create_task(self._resync_loop(), name="tidelog-resync")]
        tasks += [asyncio.create_task(self._worker(i), name=f"tidelog-reconcile-{i}")
                  for i in range(self._concurrency)]
        lost = asyncio.create_task(self._lease_lost.wait())
        try:
            await asyncio.wait([lost, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if self._lease_lost.is_set():
                raise LeaseLost("orchestrator", "", 0, None, None, "a write found the lease lost")
        finally:
            self._running = False
            lost.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _resync_loop(self) -> None:
        while True:
            try:
                n = await self.resync()
                log.debug("resync queued %d entities", n)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A journal hiccup: the next resync will catch up; keep the loop alive.
                log.exception("resync failed; trying again in %.1fs", self._resync_interval_s)
            await self.clock.sleep(self._resync_interval_s)

    async def _worker(self, _n: int) -> None:
        while not self._draining:
            key = await self.queue.get()
            if self._draining:
                self.queue.done(key)
                self.queue.add(key)
                return
            # Shielded so that draining lets a reconcile already under way finish.
            task = asyncio.create_task(self._reconcile_done(key))
            self._busy.add(task)
            task.add_done_callback(self._busy.discard)
            await asyncio.shield(task)

    async def _reconcile_done(self, key: str) -> None:
        try:
            await self.reconcile_key(key)
        finally:
            self.queue.done(key)

    async def drain(self, grace_s: float) -> None:
        """Take no new keys; let reconciles under way finish for up to ``grace_s``, then cancel them.

        A reconcile that finishes after the lease was lost has its writes refused by
        the fence, and any call it makes carries its old epoch, which a remote that
        has seen the new leader refuses.
        """
        self._draining = True
        busy = list(self._busy)
        if busy:
            _, pending = await asyncio.wait(busy, timeout=grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def reconcile_key(self, key: str) -> None:
        kind, _, entity_id = key.partition(":")
        controller = self.controllers[kind]
        started = time.perf_counter()
        outcome = "ok"
        try:
            result = await controller.reconcile(self.ctx, entity_id)
            self._failures.pop(key, None)
            if result.requeue_after is not None:
                self.queue.add_after(key, result.requeue_after)
        except StaleRow as exc:
            # Someone else moved the row: re-read and decide again, at once.
            outcome = "stale"
            log.debug("stale row, reconciling again: %s", exc)
            self.queue.add(key)
        except (LeaseLost, NotLeader) as exc:
            outcome = "fenced"
            log.warning("write refused, this orchestrator is no longer the leader: %s", exc)
            self._lease_lost.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = "error"
            n = self._failures.get(key, 0) + 1
            self._failures[key] = n
            delay = min(self._backoff[1], self._backoff[0] * 2 ** (n - 1))
            log.exception("reconcile of %s failed (attempt %d); retrying in %.1fs", key, n, delay)
            self.queue.add_after(key, delay)
        finally:
            self._metrics.reconciles.labels(kind=kind, outcome=outcome).inc()
            self._metrics.reconcile_seconds.labels(kind=kind).observe(time.perf_counter() - started)
