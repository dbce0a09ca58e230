"""Opening a journal: URL checks, engine set-up per backend, read and write transactions.

SQLite (the embedded default) runs in WAL mode with ``synchronous=FULL``,
foreign keys on and a busy timeout; every write transaction starts with
``BEGIN IMMEDIATE`` so it holds the single writer lock from its first
statement and can never deadlock on a lock upgrade. PostgreSQL runs through
asyncpg at READ COMMITTED; the fence check takes a share lock on the lease row
so a take-over waits for writes already under way under the old epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from . import batch_pg
from .batch import Op, Outcome, apply_groups
from .errors import UnsupportedJournalURL
from .registry import KindRegistry, builtin_kinds
from .types import dumps, loads
from .writer import AsyncWriter, Buffered, SqliteWriter, SqliteWriterThread, Writer, sqlite_pragmas

Backend = Literal["sqlite", "postgresql"]
Clock = Callable[[], datetime]

#: Accepted spellings and the async driver each one maps to.
_SCHEMES: dict[str, tuple[Backend, str]] = {
    "sqlite": ("sqlite", "sqlite+aiosqlite"),
    "sqlite+aiosqlite": ("sqlite", "sqlite+aiosqlite"),
    "postgres": ("postgresql", "postgresql+asyncpg"),
    "postgresql": ("postgresql", "postgresql+asyncpg"),
    "postgresql+asyncpg": ("postgresql", "postgresql+asyncpg"),
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class JournalURL:
    """A validated journal URL: the backend and the async driver URL."""

    backend: Backend
    url: sa.URL

    @classmethod
    def parse(cls, raw: str) -> JournalURL:
        """Parse ``raw``; raise :class:`UnsupportedJournalURL` for anything else."""
        try:
            url = make_url(raw)
        except ArgumentError:
            scheme = raw.split(":", 1)[0] if ":" in raw else raw
            raise UnsupportedJournalURL(scheme) from None
        entry = _SCHEMES.get(url.drivername)
        if entry is None:
            raise UnsupportedJournalURL(url.drivername)
        backend, driver = entry
        url = url.set(drivername=driver)
        if backend == "sqlite" and (not url.database or url.database == ":memory:"):
            raise UnsupportedJournalURL("sqlite (in-memory: the journal must be a file)")
        return cls(backend, url)

    def redacted(self) -> str:
        """The URL with any password hidden, safe for logs and errors."""
        return self.url.render_as_string(hide_password=True)


@dataclass(frozen=True)
class Fence:
    """Who writes: the lease name, the holder, and the epoch the holder claims."""

    lease: str
    holder: str
    epoch: int


@dataclass(frozen=True)
class Committed:
    """One entity write made durable by a commit (handed to commit listeners)."""

    kind: str
    entity_id: str
    from_state: str | None
    to_state: str
    version: int


CommitListener = Callable[[Sequence[Committed]], None]


def _install_sqlite_pragmas(engine: AsyncEngine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        sqlite_pragmas(dbapi_connection, busy_timeout_ms)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        # Reads only: writes go through the writer connection (journal/writer.py).
        conn.exec_driver_sql("BEGIN")


def create_engine(url: JournalURL, *, busy_timeout_ms: int = 5000, pool_size: int = 5) -> AsyncEngine:
    """An async engine for ``url`` with the journal's durability settings."""
    kwargs: dict[str, Any] = {"json_serializer": dumps, "json_deserializer": loads}
    if url.backend == "sqlite":
        kwargs["connect_args"] = {"timeout": busy_timeout_ms / 1000}
    else:
        kwargs["pool_size"] = pool_size
        kwargs["max_overflow"] = pool_size
        kwargs["pool_recycle"] = 1800
    engine = create_async_engine(url.url, **kwargs)
    if url.backend == "sqlite":
        _install_sqlite_pragmas(engine, busy_timeout_ms)
    return engine


class Journal:
    """The durable store: a connection pool, the kind registry, a clock and commit listeners.

    Writes happen only in :meth:`write` transactions, through :class:`journal.WriteTx`.
    """

    def __init__(self, engine: AsyncEngine, url: JournalURL, *, kinds: KindRegistry | None = None,
                 clock: Clock = utcnow, actor: str = "tidelog", busy_timeout_ms: int = 5000) -> None:
        self.engine = engine
        self.url = url
        self.kinds = kinds if kinds is not None else builtin_kinds()
        self.clock = clock
        self.actor = actor
        self._listeners: list[CommitListener] = []
        self._sqlite_writer = (SqliteWriterThread(url.url, busy_timeout_ms) if url.backend == "sqlite" else None)

    @classmethod
    def open(cls, raw_url: str, *, kinds: KindRegistry | None = None, clock: Clock = utcnow,
             actor: str = "tidelog", busy_timeout_ms: int = 5000, pool_size: int = 5) -> Journal:
        """Build a journal for ``raw_url`` (no connection is made until first use)."""
        url = JournalURL.parse(raw_url)
        engine = create_engine(url, busy_timeout_ms=busy_timeout_ms, pool_size=pool_size)
        return cls(engine, url, kinds=kinds, clock=clock, actor=actor, busy_timeout_ms=busy_timeout_ms)

    @property
    def backend(self) -> Backend:
        return self.url.backend

    def add_commit_listener(self, listener: CommitListener) -> None:
        """Call ``listener`` after every commit that wrote entity rows (never inside a transaction)."""
        self._listeners.append(listener)

    def remove_commit_listener(self, listener: CommitListener) -> None:
        self._listeners.remove(listener)

    def _notify(self, committed: Sequence[Committed]) -> None:
        if committed:
            for listener in list(self._listeners):
                listener(committed)

    @asynccontextmanager
    async def read(self, *, snapshot: bool = False) -> AsyncIterator[AsyncConnection]:
        """A read-only transaction (SQLite: deferred, never takes the writer lock).

        ``snapshot=True`` makes every statement see the same committed state
        (PostgreSQL: REPEATABLE READ; SQLite's deferred read transaction already does).
        """
        async with self.engine.connect() as conn:
            if snapshot and self.backend == "postgresql":
                conn = await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                yield conn

    @asynccontextmanager
    async def write(self, fence: Fence | None = None) -> AsyncIterator[WriteTx]:
        """One write transaction; commits on normal exit, rolls back on any exception.

        With a ``fence``, the holder must still hold the lease at that epoch, unexpired:
        the check is folded into the first compare-and-set, or made by its own
        statement before any other write (see :meth:`WriteTx.ensure_fence`); on
        failure :class:`~journal.errors.LeaseLost` is raised and nothing is written.
        Commit listeners run after the commit.
        """
        async with self._writer() as writer:
            tx = WriteTx(self, writer, fence, fence_pending=fence is not None)
            await writer.begin()
            try:
                yield tx
                await tx.settle()
            except BaseException:
                await writer.rollback()
                raise
            try:
                await writer.finish(*tx.pending_events())
            except asyncio.CancelledError:
                # Cancelled while committing: the commit finished first (see
                # SqliteWriterThread.run); if it took, the listeners must still hear it.
                if writer.committed:
                    self._notify(tx.committed)
                raise
        self._notify(tx.committed)

    @asynccontextmanager
    async def _writer(self) -> AsyncIterator[Writer]:
        if self._sqlite_writer is None:
            yield AsyncWriter(self.engine)
            return
        async with self._sqlite_writer.lock:
            yield SqliteWriter(self._sqlite_writer)

    async def apply(self, groups: Sequence[Sequence[Op]], fence: Fence | None = None) -> list[Outcome]:
        """Apply groups of declarative operations in one transaction, each group all-or-nothing.

        Returns one outcome per group: the committed writes (``None`` for a create
        ``if_absent`` that found its row) or the exception that refused the group.
        See :mod:`journal.batch`.
        """
        shape = batch_pg.eligible(self, groups)
        if shape is not None:
            return await batch_pg.apply_one_statement(self, groups, fence, shape)
        return await apply_groups(self, groups, fence)

    async def fetch(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> Buffered:
        """Run one small read (a point lookup) and return its rows.

        SQLite answers it inline on a dedicated read connection: in WAL mode a
        reader never waits for the writer, and a primary-key lookup takes
        microseconds, far less than a hop to a driver thread. PostgreSQL uses
        a pooled connection. Use :meth:`read` for scans and paging.
        """
        if self._sqlite_writer is None:
            async with self.engine.connect() as conn:
                return Buffered.of(await conn.execute(stmt, params))
        reader = self._sqlite_writer.reader()
        return Buffered.of(reader.execute(stmt, params))

    async def dispose(self) -> None:
        if self._sqlite_writer is not None:
            await self._sqlite_writer.close()
        await self.engine.dispose()


# Imported late for the type annotation above without an import cycle at module load.
from .writes import WriteTx  # noqa: E402
