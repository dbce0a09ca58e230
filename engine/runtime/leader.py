"""The leader-lease loop: at most one active orchestrator per journal.

The loop tries to take (or renew) the lease every ``renew_s`` seconds. The
fence it hands out is valid only while the local monotonic clock says the lease
has not run out since the last successful renewal, with a safety margin; so a
process that was stopped (SIGSTOP, a long GC pause, a partition) knows it lost
the lease the moment it runs again, before it sends or writes anything. The
journal checks the same fence inside every write transaction, which covers the
rest: a stale leader's write is refused and rolled back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from journal import Fence, Journal, LeaseLost, lease

from engine.runtime.clock import Clock

log = logging.getLogger("tidelog.leader")

LEASE_NAME = lease.ORCHESTRATOR


class Leader:
    def __init__(self, journal: Journal, holder: str, clock: Clock, *, ttl_s: float = 10.0,
                 renew_s: float = 3.0, name: str = LEASE_NAME,
                 on_elected: Callable[[Fence], Awaitable[None]] | None = None,
                 on_lost: Callable[[], Awaitable[None]] | None = None) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError(f"lease renew_s ({renew_s}) must be > 0 and below ttl_s ({ttl_s})")
        self.journal = journal
        self.holder = holder
        self.name = name
        self._clock = clock
        self._ttl = ttl_s
        self._renew = renew_s
        # Stop trusting the lease a little before the journal would, to absorb clock drift.
        self._margin = min(1.0, ttl_s * 0.1)
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._fence: Fence | None = None
        #: The epoch this process last held; calls keep carrying it after a loss, so a
        #: remote that has seen a newer leader refuses them.
        self.last_epoch: int | None = None
        #: The journal's line of leaders, as the last acquisition read it (sent beside the epoch).
        self.last_lineage: str | None = None
        self._valid_until = 0.0
        self._generation = 0
        self._kick = asyncio.Event()

    @property
    def epoch(self) -> int | None:
        fence = self.fence()
        return None if fence is None else fence.epoch

    @property
    def is_leader(self) -> bool:
        return self.fence() is not None

    def fence(self) -> Fence | None:
        """The current fence, or ``None`` if this process may no longer act as leader."""
        if self._fence is None or self._clock.monotonic() >= self._valid_until:
            return None
        return self._fence

    def lost(self, exc: LeaseLost | None = None) -> None:
        """A write found the lease gone: stop trusting it now and let the loop step down."""
        if self._fence is not None:
            log.warning("lease lost: %s", exc or "refused by the journal")
        self._valid_until = 0.0
        self._generation += 1  # a renewal already under way must not revive the lease
        self._kick.set()

    async def run(self) -> None:
        """Hold or wait for the lease until cancelled; steps down at once when it is lost."""
        try:
            while True:
                self._kick.clear()
                await self._tick()
                sleeper = asyncio.ensure_future(self._clock.sleep(self._renew))
                kicked = asyncio.ensure_future(self._kick.wait())
                try:
                    await asyncio.wait({sleeper, kicked}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
                    kicked.cancel()
        finally:
            if self._fence is not None:
                await self._step_down()

    async def release(self, fence: Fence) -> bool:
        """Give ``fence``'s lease up (graceful shutdown) so a standby takes over without waiting."""
        self._fence = None
        self._valid_until = 0.0
        return await lease.release(self.journal, fence)

    async def _tick(self) -> None:
        if self._fence is not None and self.fence() is None:
            # Our own view says the lease ran out (we were paused or a write was fenced).
            await self._step_down()
        started = self._clock.monotonic()
        generation = self._generation
        try:
            if self._fence is not None:
                state = await lease.renew(self.journal, self._fence, self._ttl)
            else:
                got = await lease.acquire(self.journal, self.name, self.holder, self._ttl)
                if got is None:
                    return
                state = got
        except LeaseLost as exc:
            log.warning("lease renewal refused: %s", exc)
            await self._step_down()
            return
        except Exception:
            log.exception("lease loop: journal unavailable")
            if self._fence is not None and self.fence() is None:
                await self._step_down()
            return
        if generation != self._generation:
            # lost() was called while this renewal ran: step down rather than trust it.
            await self._step_down()
            return
        self._valid_until = started + self._ttl - self._margin
        if self._fence is None or self._fence.epoch != state.epoch:
            self._fence = state.fence()
            self.last_epoch = state.epoch
            self.last_lineage = state.lineage or self.last_lineage
            log.info("leader lease held", extra={"holder": self.holder, "epoch": state.epoch})
            if self._on_elected is not None:
                await self._on_elected(self._fence)

    async def _step_down(self) -> None:
        was = self._fence
        self._fence = None
        self._valid_until = 0.0
        if was is not None:
            log.warning("stepping down", extra={"holder": self.holder, "epoch": was.epoch})
            if self._on_lost is not None:
                await self._on_lost()
