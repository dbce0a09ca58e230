"""The orchestrator: journal + leader lease + reconciler + dispatcher (+ HTTP API in ``serve``), and
the registered workflow families built on them (:mod:`engine.runtime.workflow`).

Only the lease holder runs the reconciler and the dispatcher. On election (and
on take-over) it recovers intents left in flight, queues every non-terminal
row (start-up is just a full resync) and starts both loops. When the lease is
lost, both stop at once; a write already under way is refused by the journal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Sequence
from typing import Any

from journal import Fence, Journal, LeaseLost, schema

import engine.workflows  # noqa: F401 - registers the built-in families
from engine.config import Settings
from engine.runtime.clock import Clock, SystemClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.crash import CrashHooks
from engine.runtime.dispatcher import Dispatcher
from engine.runtime.leader import Leader
from engine.runtime.metrics import Metrics
from engine.runtime.reconciler import Controller, Reconciler
from engine.runtime.rpc import RpcClient
from engine.runtime.transport import Transport
from engine.runtime.workflow import Deps, Parts, Workflow, register_kinds, registered

log = logging.getLogger("tidelog.service")


def open_journal(settings: Settings, clock: Clock | None = None, actor: str = "tidelog") -> Journal:
    """The configured journal, knowing every registered workflow's kinds."""
    c = clock or SystemClock()
    journal = Journal.open(settings.journal.url, clock=c.now, actor=actor,
                           busy_timeout_ms=settings.journal.busy_timeout_ms, pool_size=settings.journal.pool_size)
    register_kinds(journal.kinds)
    return journal


class Orchestrator:
    """Everything but the HTTP API; tests and the crash harness run it directly.

    ``workflows`` (default: every registered one) are built in order, each from the settings and
    the shared parts (:class:`~engine.runtime.workflow.Deps`); ``controllers`` replace the built
    controller of their kind (a test's own); the families named in ``unbuilt`` are not built (their
    routes still answer reads; a test leaves ``discovery`` unbuilt to keep its own participants rows);
    ``transport`` is what the RPC client sends over (default real HTTP; a test's in-process remote).
    """

    def __init__(self, settings: Settings, *, journal: Journal | None = None, clock: Clock | None = None,
                 controllers: list[Controller] | None = None, workflows: Sequence[Workflow] | None = None,
                 unbuilt: Collection[str] = (),
                 transport: Transport | None = None) -> None:
        self.settings = settings
        #: The workflow families this orchestrator serves (routes, kinds), built or not.
        self.workflows: tuple[Workflow, ...] = tuple(registered() if workflows is None else workflows)
        self.clock = clock or SystemClock()
        self.holder = settings.orchestrator.holder()
        self.journal = journal or open_journal(settings, self.clock, actor=self.holder)
        self.metrics = Metrics()
        self.leader = Leader(self.journal, self.holder, self.clock, ttl_s=settings.orchestrator.lease_ttl_s,
                             renew_s=settings.orchestrator.lease_renew_s, on_elected=self._elected,
                             on_lost=self._lost)
        self.committer = GroupCommitter(self.journal, self.leader.fence, max_batch=settings.reconciler.max_batch,
                                        on_lease_lost=self.leader.lost, metrics=self.metrics)
        r = settings.rpc
        self.rpc = RpcClient(token=settings.token(), epoch=lambda: self.leader.last_epoch,
                             lineage=lambda: self.leader.last_lineage,
                             control_pool=r.control_pool, control_per_host=r.control_per_host,
                             data_pool=r.data_pool, transport_tries=r.transport_tries,
                             retry_backoff_s=r.retry_backoff_s, transport=transport, clock=self.clock)
        self.reconciler = Reconciler(self.journal, self.committer, self.clock,
                                     concurrency=settings.reconciler.concurrency,
                                     resync_interval_s=settings.reconciler.resync_interval_s,
                                     metrics=self.metrics)
        d = settings.dispatcher
        self.dispatcher = Dispatcher(self.journal, self.committer, self.rpc, self.clock, self.leader.fence,
                                     self.reconciler.call_done, concurrency=d.concurrency,
                                     data_concurrency=d.data_concurrency, batch=d.batch,
                                     poll_s=d.poll_s, backoff_base_s=d.backoff_base_s,
                                     backoff_cap_s=d.backoff_cap_s, metrics=self.metrics)
        # Controllers claim the repeatable calls they write; this dispatcher sends them after the commit.
        self.reconciler.ctx.attach_sender(self.dispatcher.send)
        register_kinds(self.journal.kinds, self.workflows)
        given = list(controllers or [])
        deps = Deps(settings, self.rpc, self.metrics, self.clock, frozenset(c.kind for c in given),
                    write=self.committer.run, holder=self.holder, read=self.journal.read, rebuilt=self._rebuilt,
                    replace_engine=self._replace_engine)
        #: Each built family's parts, by workflow name (a family its settings leave off is absent).
        self.parts: dict[str, Parts] = {}
        skip = set(unbuilt)
        for wf in self.workflows:
            if wf.build is None or wf.name in skip:
                continue
            parts = wf.build(deps)
            if parts is not None:
                self.parts[wf.name] = parts
        for controller in [*(c for p in self.parts.values() for c in p.controllers if c.kind not in deps.replaced),
                           *given]:
            self.reconciler.register(controller)
        # Crash hooks run first, so an armed hook kills the process before any wake-up.
        self.journal.add_commit_listener(CrashHooks())
        # A controller that keeps an in-memory view of its calls hears every commit (before wake-ups).
        for controller in self.reconciler.controllers.values():
            self.journal.add_commit_listener(controller.on_commit)
        self.journal.add_commit_listener(self.reconciler.on_commit)
        self.journal.add_commit_listener(self.dispatcher.on_commit)
        self._work: list[asyncio.Task[None]] = []
        self._draining = False  # set while _stop_work winds the loops down
        self._leader_task: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()

    def handle(self, name: str) -> Any:
        """The built family ``name``'s own object (``Parts.handle``), or ``None`` when it is not built."""
        parts = self.parts.get(name)
        return None if parts is None else parts.handle

    @property
    def is_leader(self) -> bool:
        return self.leader.is_leader

    async def check_schema(self) -> str:
        return await schema.check_schema(self.journal)

    async def start(self) -> None:
        await self.check_schema()
        self._leader_task = asyncio.create_task(self.leader.run(), name="tidelog-leader")

    async def _elected(self, fence: Fence) -> None:
        await self._stop_work()
        log.info("elected leader", extra={"holder": fence.holder, "epoch": fence.epoch})
        self.metrics.leader.set(1)
        self.metrics.epoch.set(fence.epoch)
        try:
            for parts in self.parts.values():
                for step in parts.on_elected:
                    await self.committer.run(step)
            await self.dispatcher.recover()
        except (LeaseLost, Exception):
            log.exception("start-up recovery failed; stepping down")
            self.leader.lost()
            return
        # The dispatcher first: it must be running before a controller hands it calls it claimed.
        self._work = [asyncio.create_task(self._supervise("dispatcher", self.dispatcher.run()),
                                          name="tidelog-dispatcher"),
                      asyncio.create_task(self._supervise("reconciler", self.reconciler.run()),
                                          name="tidelog-reconciler")]
        for name, parts in self.parts.items():
            if parts.run is not None:
                self._work.append(asyncio.create_task(self._supervise(name, parts.run()), name=f"tidelog-{name}"))

    async def _supervise(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """Run one of the leader's loops; if it ever ends on its own, step down.

        Stepping down and being elected again (epoch + 1) is the one recovery path:
        it reloads every non-terminal row and settles in-flight intents.
        """
        try:
            await work
        except asyncio.CancelledError:
            raise
        except LeaseLost as exc:
            self.leader.lost(exc)
            return
        except Exception:
            if self._draining:
                log.warning("%s ended with an error while stopping", name, exc_info=True)
                return
            log.exception("%s stopped unexpectedly; stepping down so that recovery restarts it", name)
        else:
            if self._draining:
                return  # the drain cancelled a reconcile past its grace, which ends the loop
            log.error("%s returned unexpectedly; stepping down", name)
        self.leader.lost()

    def working(self) -> bool:
        """False when this process leads but one of its loops is not running."""
        if not self.is_leader:
            return True
        return len(self._work) >= 2 and not any(t.done() for t in self._work)

    async def _rebuilt(self, why: str) -> None:
        """A stack is rebuilt (:attr:`Deps.rebuilt`): each built family's ``on_rebuild``, in order."""
        for parts in self.parts.values():
            if parts.on_rebuild is not None:
                await parts.on_rebuild(why)

    async def _replace_engine(self, engine: str, why: str) -> bool:
        """:attr:`Deps.replace_engine`: the first built family that takes it on."""
        for parts in self.parts.values():
            if parts.replace_engine is not None and await parts.replace_engine(engine, why):
                return True
        return False

    async def not_ready(self) -> str | None:
        """Why a built family is not ready (``/readyz``), or ``None``."""
        for parts in self.parts.values():
            why = None if parts.not_ready is None else await parts.not_ready()
            if why:
                return why
        return None

    async def _lost(self) -> None:
        self.metrics.leader.set(0)
        await self._stop_work()
        for parts in self.parts.values():
            if parts.on_lost is not None:
                await parts.on_lost()

    async def _stop_work(self) -> None:
        """Drain reconciles and in-flight calls for up to the grace period each, then cancel."""
        work, self._work = self._work, []
        if not work:
            return
        grace = self.settings.orchestrator.shutdown_grace_s
        self._draining = True
        try:
            try:
                await self.reconciler.drain(grace)
            finally:
                for t in work:
                    t.cancel()
                # The dispatcher awaits its calls when cancelled; bound that wait too.
                _, pending = await asyncio.wait(work, timeout=grace)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*work, return_exceptions=True)
        finally:
            self._draining = False  # also when this stop is itself cancelled part-way

    async def stop(self) -> None:
        """Graceful stop: finish in-flight work within the grace period, release the lease."""
        fence = self.leader.fence()
        if fence is not None:
            for name, parts in self.parts.items():
                if parts.before_stop is not None:
                    try:
                        await parts.before_stop()
                    except Exception:
                        log.exception("%s: stopping before the loops failed", name)
        await self._stop_work()
        if self._leader_task is not None:
            self._leader_task.cancel()
            await asyncio.gather(self._leader_task, return_exceptions=True)
        await self.committer.close()
        try:
            if fence is not None:
                await self.leader.release(fence)
        except Exception:
            log.exception("could not release the lease; a standby takes over when it lapses")
        await self.rpc.close()
        for parts in self.parts.values():
            if parts.close is not None:
                await parts.close()
        await self.journal.dispose()
        self.stopped.set()
