"""Injectable time: the reconciler, the dispatcher and the leader loop never read the wall clock directly.

``SystemClock`` is the real thing. ``VirtualClock`` only moves when a test
calls :meth:`VirtualClock.advance`; sleepers wake in due order, so timer logic
is tested without waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time as _time
from datetime import datetime, timedelta, timezone
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """Timezone-aware UTC now."""

    def time(self) -> float:
        """Unix seconds (what deadlines written to rows and sent to participants are in)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of this clock's time."""


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        # The event loop's own time source (asyncio's loop.time() is time.monotonic()), read without
        # a loop: the trainer host asks it from the worker thread its blocking calls run on.
        return _time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """A clock for tests: time stands still until :meth:`advance`."""

    def __init__(self, start: datetime | None = None) -> None:
        self._start = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
        self._t = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> datetime:
        return self._start + timedelta(seconds=self._t)

    def time(self) -> float:
        """The start's Unix timestamp plus the offset: moves only on :meth:`advance`."""
        return self._start.timestamp() + self._t

    def monotonic(self) -> float:
        return self._t

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._t + seconds, next(self._seq), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper due on the way, in order."""
        for _ in range(20):  # let tasks that are about to sleep register first
            await asyncio.sleep(0)
        target = self._t + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            due, _, fut = heapq.heappop(self._sleepers)
            self._t = max(self._t, due)
            if not fut.done():
                fut.set_result(None)
            for _ in range(20):  # let the woken task run up to its next await
                await asyncio.sleep(0)
        self._t = target
        for _ in range(20):
            await asyncio.sleep(0)
