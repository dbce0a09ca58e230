"""A write cancelled while it commits: the commit is not torn, and the journal stays usable."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from journal import Committed, Journal, audit, models
from tests.support.backends import only_sqlite


@only_sqlite
async def test_a_write_cancelled_mid_commit_finishes_and_is_announced(journal: Journal) -> None:
    heard: list[Committed] = []
    journal.add_commit_listener(heard.extend)
    thread = journal._sqlite_writer
    assert thread is not None
    # Fault injection: make the writer thread slow (as a slow fsync would be) so that the
    # cancel lands while the commit is running there. Nothing else is replaced.
    original = thread.run

    async def slow_run(fn):  # type: ignore[no-untyped-def]
        def slow():  # type: ignore[no-untyped-def]
            import time
            time.sleep(0.2)
            return fn()
        return await original(slow)

    thread.run = slow_run  # type: ignore[method-assign]

    async def write(name: str) -> None:
        async with journal.write() as tx:
            await tx.create("participants", name, reason="configured", values={"url": "http://h"})

    first = asyncio.create_task(write("p1"))
    await asyncio.sleep(0.05)
    first.cancel()
    try:
        await first
    except asyncio.CancelledError:
        pass
    thread.run = original  # type: ignore[method-assign]
    await write("p2")  # the connection is free and not left inside a transaction
    async with journal.read() as conn:
        ids = (await conn.execute(sa.select(models.participants.c.id).order_by("id"))).scalars().all()
    assert ids == ["p1", "p2"]
    assert [c.entity_id for c in heard] == ["p1", "p2"], "a commit that took must be announced"
    assert await audit.verify(journal) == []


async def test_verify_sees_one_snapshot_while_writes_go_on(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create("participants", "p0", reason="configured", values={"url": "http://h"})
    stop = asyncio.Event()

    async def churn() -> None:
        version, state = 1, "pending"
        while not stop.is_set():
            async with journal.write() as tx:
                await tx.transition("participants", "p0", from_state=state, version=version,
                                    to_state="unreachable", reason="probe failed",
                                    changes={"probe_failures": version})
            version, state = version + 1, "unreachable"
            await asyncio.sleep(0)

    writer = asyncio.create_task(churn())
    try:
        for _ in range(10):
            assert await audit.verify(journal) == []
    finally:
        stop.set()
        await writer
