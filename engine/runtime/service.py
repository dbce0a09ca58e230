"""The orchestrator: journal + leader lease + reconciler + dispatcher (+ HTTP API in ``serve``).

Only the lease holder runs the reconciler and the dispatcher. On election (and
on take-over) it recovers intents left in flight, queues every non-terminal
row (start-up is just a full resync) and starts both loops. When the lease is
lost, both stop at once; a write already under way is refused by the journal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from journal import Fence, Journal, LeaseLost, schema

from engine.runtime.clock import Clock, SystemClock
from engine.runtime.committer import GroupCommitter
from engine.config import Settings
from engine.workflows.checkpoint.checkpoint import CheckpointController, CheckpointSettings
from engine.workflows.checkpoint.restore import RestoreController, RestoreSettings
from engine.workflows.checkpoint.retirement import RetirementController, RetirementSettings
from engine.workflows.discovery.controller import DiscoveryController, DiscoverySettings, sync_configured
from engine.workflows.training.engine_gate import sync_engines
from engine.runtime.crash import CrashHooks
from engine.runtime.dispatcher import Dispatcher
from engine.runtime.leader import Leader
from engine.runtime.metrics import Metrics
from engine.runtime.reconciler import Controller, Reconciler
from engine.runtime.rpc import RpcClient
from engine.workflows.training.wiring import TrainingParts, build_training

log = logging.getLogger("tidelog.service")


def open_journal(settings: Settings, clock: Clock | None = None, actor: str = "tidelog") -> Journal:
    c = clock or SystemClock()
    return Journal.open(settings.journal.url, clock=c.now, actor=actor,
                        busy_timeout_ms=settings.journal.busy_timeout_ms, pool_size=settings.journal.pool_size)


class Orchestrator:
    """Everything but the HTTP API; tests and the crash harness run it directly."""

    def __init__(self, settings: Settings, *, journal: Journal | None = None, clock: Clock | None = None,
                 controllers: list[Controller] | None = None, with_discovery: bool = True) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.holder = settings.orchestrator.holder()
        self.journal = journal or open_journal(settings, self.clock, actor=self.holder)
        self.metrics = Metrics()
        self.leader = Leader(self.journal, self.holder, self.clock, ttl_s=settings.orchestrator.lease_ttl_s,
                             renew_s=settings.orchestrator.lease_renew_s, on_elected=self._elected,
                             on_lost=self._lost)
        self.committer = GroupCommitter(self.journal, self.leader.fence, max_batch=settings.reconciler.max_batch,
                                        on_lease_lost=self.leader.lost)
        r = settings.rpc
        self.rpc = RpcClient(token=settings.token(), epoch=lambda: self.leader.last_epoch,
                             control_pool=r.control_pool, control_per_host=r.control_per_host,
                             data_pool=r.data_pool, transport_tries=r.transport_tries,
                             retry_backoff_s=r.retry_backoff_s)
        self.reconciler = Reconciler(self.journal, self.committer, self.clock,
                                     concurrency=settings.reconciler.concurrency,
                                     resync_interval_s=settings.reconciler.resync_interval_s,
                                     metrics=self.metrics)
        d = settings.dispatcher
        self.dispatcher = Dispatcher(self.journal, self.committer, self.rpc, self.clock, self.leader.fence,
                                     self.reconciler.call_done, concurrency=d.concurrency, batch=d.batch,
                                     poll_s=d.poll_s, backoff_base_s=d.backoff_base_s,
                                     backoff_cap_s=d.backoff_cap_s, metrics=self.metrics)
        # Controllers claim the repeatable calls they write; this dispatcher sends them after the commit.
        self.reconciler.ctx.attach_sender(self.dispatcher.send)
        self.discovery: DiscoveryController | None = None
        if with_discovery:
            ds = settings.discovery
            self.discovery = DiscoveryController(self.rpc, DiscoverySettings(
                ds.probe_timeout_s, ds.probe_tries, ds.interval_s, ds.max_backoff_s), self.metrics)
            self.reconciler.register(self.discovery)
        c = settings.checkpoint
        # The checkpoint workflows' controllers, unless a caller (a test) passes its own for a kind.
        given = {controller.kind for controller in controllers or []}
        builtin: list[Controller] = [
            CheckpointController(CheckpointSettings(c.prepare_timeout_s, c.commit_timeout_s, c.resume_timeout_s)),
            RestoreController(RestoreSettings(c.restore_timeout_s, c.resume_timeout_s)),
            RetirementController(RetirementSettings(c.retire_timeout_s))]
        #: The training half (``training.enabled``): trainer host, engines, their controllers.
        self.training: TrainingParts | None = None
        if settings.training.enabled and "training_jobs" not in given:
            self.training = build_training(settings)
            builtin += [self.training.controller, self.training.gate]
        for controller in [*(b for b in builtin if b.kind not in given), *(controllers or [])]:
            self.reconciler.register(controller)
        self.with_discovery = with_discovery
        # Crash hooks run first, so an armed hook kills the process before any wake-up.
        self.journal.add_commit_listener(CrashHooks())
        # A controller that keeps an in-memory view of its calls hears every commit (before wake-ups).
        for controller in self.reconciler.controllers.values():
            listener = getattr(controller, "on_commit", None)
            if listener is not None:
                self.journal.add_commit_listener(listener)
        self.journal.add_commit_listener(self.reconciler.on_commit)
        self.journal.add_commit_listener(self.dispatcher.on_commit)
        self._work: list[asyncio.Task[None]] = []
        self._draining = False  # set while _stop_work winds the loops down
        self._leader_task: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self.leader.is_leader

    async def check_schema(self) -> str:
        return await schema.check_schema(self.journal)

    async def start(self) -> None:
        await self.check_schema()
        await self.rpc.start()
        self._leader_task = asyncio.create_task(self.leader.run(), name="tidelog-leader")

    async def _elected(self, fence: Fence) -> None:
        await self._stop_work()
        log.info("elected leader", extra={"holder": fence.holder, "epoch": fence.epoch})
        self.metrics.leader.set(1)
        self.metrics.epoch.set(fence.epoch)
        try:
            if self.with_discovery:
                configured: Mapping[str, str] = {p.name: p.url for p in self.settings.participants}

                async def sync(tx: Any) -> list[str]:
                    return await sync_configured(tx, configured)

                await self.committer.run(sync)
            if self.training is not None:
                t = self.settings.training
                engines: Mapping[str, str] = {e.name: e.url for e in t.engines}

                async def sync_gate(tx: Any) -> list[str]:
                    return await sync_engines(tx, t.deployment, engines)

                await self.committer.run(sync_gate)
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
        return len(self._work) == 2 and not any(t.done() for t in self._work)

    async def _lost(self) -> None:
        self.metrics.leader.set(0)
        await self._stop_work()
        if self.training is not None:
            # The next leader starts its own trainer; this one's must not train beside it.
            await asyncio.to_thread(self.training.host.release)

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
        if self.training is not None:
            await self.training.close()
        await self.journal.dispose()
        self.stopped.set()
