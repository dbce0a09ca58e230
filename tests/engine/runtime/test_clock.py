"""The system clock's monotonic time is read from any thread (the trainer host asks it from the
worker thread its blocking calls run on) and agrees with the event loop's own time."""

from __future__ import annotations

import asyncio

from engine.runtime.clock import SystemClock


async def test_system_monotonic_is_read_off_the_loop_and_matches_it() -> None:
    clock = SystemClock()
    loop = asyncio.get_running_loop()
    before = loop.time()
    in_thread = await asyncio.to_thread(clock.monotonic)  # no running loop in that thread
    after = loop.time()
    assert before <= in_thread <= after
