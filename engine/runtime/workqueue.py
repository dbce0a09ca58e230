"""A de-duplicating work queue of entity keys with delayed re-queues.

Invariants:
- a key is at most once in the queue;
- a key handed out by :meth:`WorkQueue.get` is never handed out again until
  :meth:`WorkQueue.done` is called for it (no key is reconciled concurrently);
- a key added while it is being worked on is queued again once it is done,
  so no wake-up is lost;
- :meth:`WorkQueue.add_after` keeps only the earliest pending timer per key.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque

from engine.runtime.clock import Clock


class WorkQueue:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._queue: deque[str] = deque()
        self._queued: set[str] = set()
        self._active: set[str] = set()
        self._dirty: set[str] = set()
        self._ready = asyncio.Event()
        self._timers: list[tuple[float, int, str]] = []
        self._timer_due: dict[str, float] = {}
        self._timer_changed = asyncio.Event()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def timers(self) -> int:
        return len(self._timer_due)

    def add(self, key: str) -> None:
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.append(key)
            self._ready.set()

    def add_after(self, key: str, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        due = self._clock.monotonic() + delay_s
        current = self._timer_due.get(key)
        if current is not None and current <= due:
            return
        self._timer_due[key] = due
        heapq.heappush(self._timers, (due, next(self._seq), key))
        self._timer_changed.set()

    async def get(self) -> str:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        key = self._queue.popleft()
        self._queued.discard(key)
        self._active.add(key)
        if not self._queue:
            self._ready.clear()
        else:
            self._ready.set()
        return key

    def done(self, key: str) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    async def run_timers(self) -> None:
        """Move due timers into the queue; runs until cancelled."""
        while True:
            now = self._clock.monotonic()
            while self._timers and self._timers[0][0] <= now:
                due, _, key = heapq.heappop(self._timers)
                if self._timer_due.get(key) == due:
                    del self._timer_due[key]
                    self.add(key)
            self._timer_changed.clear()
            if not self._timers:
                await self._timer_changed.wait()
                continue
            delay = self._timers[0][0] - now
            sleeper = asyncio.ensure_future(self._clock.sleep(delay))
            changed = asyncio.ensure_future(self._timer_changed.wait())
            try:
                await asyncio.wait({sleeper, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                changed.cancel()
