"""How a write transaction reaches each backend.

A :class:`WriteTx` talks to a :class:`Writer`, which runs statements and hands
back fully buffered results (so no cursor outlives a call).

- SQLite: the process has one write connection (SQLite admits a single
  writer anyway), used under an asyncio lock by one transaction at a time.
  ``BEGIN IMMEDIATE`` runs inline with a busy timeout of zero: it takes the
  file lock at once or reports SQLITE_BUSY at once, and the wait for another
  process's lock is a tenacity retry with asyncio sleeps (up to the configured
  busy timeout), never a blocked event loop. Once the lock is held, statements
  run inline too: in WAL mode a statement under the write lock never waits on
  another connection, and it takes microseconds. Only the commit (with the fsync of
  ``synchronous=FULL``) and the event inserts before it go to a dedicated
  thread: one thread hop per transaction. General reads go through the async
  (aiosqlite) engine on their own connections, which WAL lets run beside the
  writer.
- PostgreSQL: a pooled asyncpg connection through SQLAlchemy's async engine.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from .types import dumps, loads

T = TypeVar("T")
Params = dict[str, Any] | Sequence[dict[str, Any]] | None


class Buffered:
    """A statement's result, read to the end inside the call that ran it."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[sa.Row[Any]], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    @classmethod
    def of(cls, result: sa.CursorResult[Any]) -> Buffered:
        return cls(list(result.all()) if result.returns_rows else [], result.rowcount)

    def all(self) -> list[sa.Row[Any]]:
        return self._rows

    def first(self) -> sa.Row[Any] | None:
        return self._rows[0] if self._rows else None

    def one(self) -> sa.Row[Any]:
        if len(self._rows) != 1:
            raise LookupError(f"expected one row, got {len(self._rows)}")
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalars(self) -> list[Any]:
        return [r[0] for r in self._rows]


class Writer(ABC):
    """One write transaction at a time on one connection."""

    #: True once ``finish`` has committed (read when the commit was cancelled part way).
    committed = False

    @abstractmethod
    async def begin(self) -> None:
        """Start the transaction."""

    @abstractmethod
    async def execute(self, stmt: sa.Executable, params: Params = None) -> Buffered:
        """Run one statement inside the transaction."""

    @abstractmethod
    async def finish(self, last: sa.Executable | None, params: Params) -> None:
        """Run ``last`` (the event inserts) and commit, in the same call."""

    @abstractmethod
    async def rollback(self) -> None: ...

    @abstractmethod
    async def savepoint(self) -> Any: ...

    @abstractmethod
    async def release(self, sp: Any) -> None: ...

    @abstractmethod
    async def rollback_to(self, sp: Any) -> None: ...


# -- SQLite -----------------------------------------------------------------------------------

def sqlite_pragmas(dbapi_connection: Any, busy_timeout_ms: int) -> None:
    """The journal's durability settings, applied to every SQLite connection it opens.

    ``isolation_level = None`` hands transaction control to SQLAlchemy's "begin" event.
    """
    dbapi_connection.isolation_level = None
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cur.close()


def sqlite_sync_engine(url: sa.URL, busy_timeout_ms: int, begin: str | None = "IMMEDIATE") -> sa.Engine:
    """An engine with one connection: WAL, FULL, foreign keys, busy timeout; ``BEGIN <begin>``.

    With ``begin=None`` no BEGIN is ever sent, so each statement is its own transaction
    (a reader that must see every commit: an explicit BEGIN would pin its first snapshot,
    since an AUTOCOMMIT connection never ends the transaction it did not know it began).
    """
    # check_same_thread=False: the connection is used by the writer thread and the event
    # loop thread, never both at once (the writer lock and the awaited hops order them).
    engine = sa.create_engine(url.set(drivername="sqlite+pysqlite"), poolclass=sa.pool.StaticPool,
                              json_serializer=dumps, json_deserializer=loads,
                              connect_args={"timeout": busy_timeout_ms / 1000, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        sqlite_pragmas(dbapi_connection, busy_timeout_ms)

    if begin is not None:
        @event.listens_for(engine, "begin")
        def _on_begin(conn: sa.Connection) -> None:
            # Take the write lock up front: a deferred transaction that later upgrades can
            # fail with SQLITE_BUSY instead of waiting on the busy timeout.
            conn.exec_driver_sql(f"BEGIN {begin}")

    return engine


class SqliteWriterThread:
    """The thread that owns the SQLite write connection, and the lock that serializes its users."""

    def __init__(self, url: sa.URL, busy_timeout_ms: int) -> None:
        # The writer never sleeps inside SQLite waiting for the lock (that would stall
        # the event loop): SQLITE_BUSY comes back at once and SqliteWriter.begin waits
        # asynchronously, up to busy_timeout_ms.
        self.engine = sqlite_sync_engine(url, 0)
        self.busy_timeout_s = busy_timeout_ms / 1000
        self._pool: ThreadPoolExecutor | None = None
        self._conn: sa.Connection | None = None
        self._reader_engine = sqlite_sync_engine(url, busy_timeout_ms, begin=None)
        self._reader: sa.Connection | None = None
        self.lock = asyncio.Lock()

    def conn(self) -> sa.Connection:
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def reader(self) -> sa.Connection:
        """A connection for inline point reads (autocommit: each statement is its own snapshot)."""
        if self._reader is None:
            self._reader = self._reader_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._reader

    async def run(self, fn: Callable[[], T]) -> T:
        if self._pool is None:  # first use, or first use after close()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidelog-sqlite-writer")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The thread owns the connection until fn returns (a commit cannot be taken
            # back half way): wait for it, whatever it does, then let the cancel go on.
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except BaseException:  # noqa: BLE001 - fn's own error; the cancel wins
                    break
            raise

    async def close(self) -> None:
        """Close the write connection and stop the thread; idempotent, and a later write starts afresh
        (like ``AsyncEngine.dispose``)."""
        if self._pool is None:
            return

        def close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.engine.dispose()
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            self._reader_engine.dispose()

        await self.run(close)
        pool, self._pool = self._pool, None
        pool.shutdown(wait=True)


def _busy(exc: BaseException) -> bool:
    """SQLITE_BUSY/SQLITE_LOCKED: another connection holds the write lock (worth waiting for)."""
    return isinstance(exc, sa.exc.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


class SqliteWriter(Writer):
    def __init__(self, thread: SqliteWriterThread) -> None:
        self._t = thread
        self._tx: sa.Transaction | None = None

    async def begin(self) -> None:
        conn = self._t.conn()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._t.busy_timeout_s

        async def take_lock() -> None:
            try:
                # Inline: BEGIN IMMEDIATE either takes the file lock at once or reports
                # SQLITE_BUSY at once (busy timeout 0); waiting happens here, off SQLite.
                self._tx = conn.begin()
            except sa.exc.OperationalError:
                if conn.in_transaction():
                    conn.rollback()
                raise

        def next_wait_ends_past_deadline(state: RetryCallState) -> bool:
            return loop.time() + state.upcoming_sleep > deadline

        # While another process holds the lock: waits of 1 ms doubling up to 50 ms, until the next
        # wait would end past the busy timeout; then (or for any other error) the error is raised.
        retrying = AsyncRetrying(stop=next_wait_ends_past_deadline,
                                 wait=wait_exponential(multiplier=0.001, exp_base=2, min=0, max=0.05),
                                 retry=retry_if_exception(_busy), sleep=asyncio.sleep, reraise=True)
        await retrying(take_lock)

    async def execute(self, stmt: sa.Executable, params: Params = None) -> Buffered:
        # Inline on purpose: the write lock is held, so this cannot wait on another writer.
        return Buffered.of(self._t.conn().execute(stmt, params))

    async def finish(self, last: sa.Executable | None, params: Params) -> None:
        def go() -> None:
            tx, self._tx = self._tx, None
            assert tx is not None
            try:
                if last is not None:
                    self._t.conn().execute(last, params)
                tx.commit()
            except BaseException:
                tx.rollback()
                raise
            self.committed = True

        await self._t.run(go)

    async def rollback(self) -> None:
        def go() -> None:
            tx, self._tx = self._tx, None
            if tx is not None:
                tx.rollback()

        await self._t.run(go)

    async def savepoint(self) -> Any:
        return self._t.conn().begin_nested()

    async def release(self, sp: Any) -> None:
        sp.commit()

    async def rollback_to(self, sp: Any) -> None:
        sp.rollback()


# -- PostgreSQL -------------------------------------------------------------------------------

class AsyncWriter(Writer):
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None

    async def begin(self) -> None:
        self._conn = await self._engine.connect()
        try:
            await self._conn.begin()
        except BaseException:
            await self._close(commit=False)
            raise

    async def execute(self, stmt: sa.Executable, params: Params = None) -> Buffered:
        assert self._conn is not None
        return Buffered.of(await self._conn.execute(stmt, params))

    async def finish(self, last: sa.Executable | None, params: Params) -> None:
        assert self._conn is not None
        try:
            if last is not None:
                await self._conn.execute(last, params)
        except BaseException:
            await self._close(commit=False)
            raise
        await self._close(commit=True)

    async def rollback(self) -> None:
        await self._close(commit=False)

    async def _close(self, *, commit: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit:
                await conn.commit()
                self.committed = True
            else:
                await conn.rollback()
        finally:
            await conn.close()

    async def savepoint(self) -> Any:
        assert self._conn is not None
        return await self._conn.begin_nested()

    async def release(self, sp: Any) -> None:
        await sp.commit()

    async def rollback_to(self, sp: Any) -> None:
        await sp.rollback()
