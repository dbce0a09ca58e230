"""The SQLite writer's wait for a write lock another connection holds: ``BEGIN IMMEDIATE`` reports
SQLITE_BUSY at once and :meth:`SqliteWriter.begin` retries (tenacity, waits of 1 ms doubling up to
50 ms) until the lock is free, or raises the busy error once the next wait would end past the busy
timeout. The event loop is never blocked meanwhile."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from journal.writer import SqliteWriter, SqliteWriterThread


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection to the same file, holding its write lock."""
    conn = sqlite3.connect(tmp_path / "j.db", isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x INTEGER)")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def writer_thread(tmp_path: Path, busy_timeout_ms: int) -> SqliteWriterThread:
    return SqliteWriterThread(sa.make_url(f"sqlite+aiosqlite:///{tmp_path / 'j.db'}"), busy_timeout_ms)


async def test_begin_waits_for_the_lock_and_takes_it_once_free(
        tmp_path: Path, holder: sqlite3.Connection) -> None:
    thread = writer_thread(tmp_path, 5000)
    writer = SqliteWriter(thread)
    try:
        begin = asyncio.ensure_future(writer.begin())
        ticks = 0
        while ticks < 20:  # the loop keeps running while begin waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert not begin.done()
        holder.execute("COMMIT")
        await asyncio.wait_for(begin, 5)
        await writer.execute(sa.text("INSERT INTO t VALUES (1)"))
        await writer.finish(None, None)
        assert writer.committed
        assert holder.execute("SELECT x FROM t").fetchall() == [(1,)]
    finally:
        await thread.close()


async def test_begin_raises_the_busy_error_once_the_next_wait_would_pass_the_busy_timeout(
        tmp_path: Path, holder: sqlite3.Connection) -> None:
    # Waits of 1, 2, 4, 8, 16 and 32 ms (63 ms) fit in 100 ms; the next (50 ms) would end past it.
    thread = writer_thread(tmp_path, 100)
    writer = SqliteWriter(thread)
    try:
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="locked|busy"):
            await writer.begin()
        elapsed = time.monotonic() - started
        assert 0.063 <= elapsed < 2
        assert not thread.conn().in_transaction()
    finally:
        await thread.close()
