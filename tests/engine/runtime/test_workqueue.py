"""The de-duplicating work queue and its timers, on virtual time."""

from __future__ import annotations

import asyncio

from engine.runtime.clock import VirtualClock
from engine.runtime.workqueue import WorkQueue


async def test_a_key_is_queued_once() -> None:
    q = WorkQueue(VirtualClock())
    for _ in range(3):
        q.add("a")
    q.add("b")
    assert len(q) == 2
    assert await q.get() == "a"
    assert await q.get() == "b"
    assert len(q) == 0


async def test_a_key_is_never_handed_out_twice_while_active_and_no_wakeup_is_lost() -> None:
    q = WorkQueue(VirtualClock())
    q.add("a")
    key = await q.get()
    q.add("a")  # woken while being worked on
    assert len(q) == 0, "must not be handed out concurrently"
    q.done(key)
    assert len(q) == 1
    assert await q.get() == "a"


async def test_timers_fire_in_due_order_and_keep_the_earliest() -> None:
    clock = VirtualClock()
    q = WorkQueue(clock)
    runner = asyncio.create_task(q.run_timers())
    try:
        q.add_after("late", 10)
        q.add_after("soon", 2)
        q.add_after("late", 30)  # a later timer for a key does not replace an earlier one
        await asyncio.sleep(0)
        await clock.advance(1)
        assert len(q) == 0
        await clock.advance(1.5)
        assert len(q) == 1 and await q.get() == "soon"
        await clock.advance(8)
        assert len(q) == 1 and await q.get() == "late"
        await clock.advance(100)
        assert len(q) == 0 and q.timers == 0
    finally:
        runner.cancel()


async def test_an_earlier_timer_wakes_a_sleeping_timer_loop() -> None:
    clock = VirtualClock()
    q = WorkQueue(clock)
    runner = asyncio.create_task(q.run_timers())
    try:
        q.add_after("far", 100)
        await asyncio.sleep(0)
        q.add_after("near", 1)
        await asyncio.sleep(0)
        await clock.advance(1)
        assert await asyncio.wait_for(q.get(), 1) == "near"
    finally:
        runner.cancel()
