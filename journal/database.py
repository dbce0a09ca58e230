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
import math
import os
import re
import sqlite3
import urllib.parse
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
from .batch import apply_groups
from .commits import CommitListener, Committed, Fence
from .ops import Op, Outcome
from .errors import JournalError, UnsupportedJournalURL
from .registry import KindRegistry, builtin_kinds
from .types import dumps, loads
from .writer import AsyncWriter, Buffered, SqliteWriter, SqliteWriterThread, Writer, sqlite_pragmas

Backend = Literal["sqlite", "postgresql"]
#: What the journal reads its timestamps from (a function; the orchestrator passes its clock's ``now``,
#: :class:`engine.runtime.clock.Clock`).
Now = Callable[[], datetime]
#: The earlier name of :data:`Now`, kept for code that imports it.
Clock = Now

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


class InvalidJournalURL(UnsupportedJournalURL):
    """The journal URL has a known scheme but a part this journal refuses (a query argument, a host).

    ``key`` names the part (``"query argument 'foo'"``), ``rule`` what was wrong. The
    message never carries the URL itself, so no password can reach it.
    """

    def __init__(self, scheme: str, key: str, rule: str) -> None:
        self.scheme = scheme
        self.key = key
        self.rule = rule
        JournalError.__init__(self, f"journal.url: {key}: {rule}")


class JournalNotFound(JournalError):
    """A journal opened for reading does not exist (nothing is created in its place)."""

    def __init__(self, path: str, why: str = "no such file") -> None:
        self.path = path
        super().__init__(f"no journal at {path} ({why}): check journal.url, or run `tidelog migrate` "
                         "(with the same --config) to create one")


class JournalUnreadable(JournalError):
    """A journal opened for reading exists but cannot be read."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        super().__init__(f"cannot read the journal at {path}: {why}")


class ReadOnlyJournal(JournalError):
    """A write was attempted on a journal opened with ``read_only=True``."""

    def __init__(self) -> None:
        super().__init__("this journal was opened read-only: writes are refused")


def _one_of(*allowed: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return check


def _int_at_least(lo: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        try:
            ok = int(value) >= lo
        except ValueError:
            ok = False
        return None if ok else f"must be an integer of at least {lo}"
    return check


def _positive_seconds(value: str) -> str | None:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    return None if math.isfinite(seconds) and seconds > 0 else "must be a positive, finite number of seconds"


def _non_empty(value: str) -> str | None:
    return None if value else "must not be empty"


#: The query arguments each backend accepts, and the check of each one's value. Anything
#: else is refused at parse time: the driver would otherwise fail on it at first connect
#: (asyncpg: ``TypeError: connect() got an unexpected keyword argument``) or, worse, ignore it
#: (SQLite). A SQLite journal takes none: its busy timeout is ``journal.busy_timeout_ms``.
QUERY_ARGUMENTS: dict[Backend, dict[str, Callable[[str], str | None]]] = {
    "sqlite": {},
    "postgresql": {
        "ssl": _one_of("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
        "host": _non_empty,  # a Unix socket directory, or several hosts (host=a:5432&host=b:5432)
        "passfile": _non_empty,
        "target_session_attrs": _one_of("any", "primary", "standby", "prefer-standby", "read-write",
                                        "read-only"),
        "prepared_statement_cache_size": _int_at_least(0),
        "command_timeout": _positive_seconds,
    },
}
#: Query arguments that may be given more than once.
_REPEATABLE = {"host"}

#: ``scheme://user:password@rest``, the password running to the LAST ``@`` before the query:
#: a password may hold ``/`` and ``@`` (SQLAlchemy's own parser ends it at the first ``@`` and
#: takes the rest of it for the host, which then shows in errors and in ``redacted()``).
_WITH_PASSWORD = re.compile(r"^(?P<scheme>[\w+]+)://(?P<user>[^:/@?]*):(?P<password>[^?]*)@(?P<rest>[^@?]*(?:\?.*)?)$",
                            re.DOTALL)


def _split_url(raw: str) -> sa.URL:
    """``make_url``, except that a password runs to the last ``@`` before the query.

    A password already percent-encoded (``s3cr%40t``) is decoded once, as ``make_url`` does.
    """
    m = _WITH_PASSWORD.match(raw)
    if m is None:
        return make_url(raw)
    url = make_url(f"{m['scheme']}://{m['rest']}")
    return url.set(username=urllib.parse.unquote(m["user"]), password=urllib.parse.unquote(m["password"]))


@dataclass(frozen=True)
class JournalURL:
    """A validated journal URL: the backend and the async driver URL.

    Accepted: ``sqlite[+aiosqlite]:///PATH`` (a file, never in-memory, no query arguments) and
    ``postgres[ql][+asyncpg]://USER[:PASSWORD]@HOST[:PORT]/DB[?ARGS]`` with only the arguments
    in :data:`QUERY_ARGUMENTS`. A password may contain ``/`` and ``@`` as they are (it runs to
    the last ``@`` before the query; a ``?`` in a password, and an ``@`` in the host or database
    part of a URL with a password, must be percent-encoded).
    """

    backend: Backend
    url: sa.URL

    @classmethod
    def parse(cls, raw: str) -> JournalURL:
        """Parse ``raw``; raise :class:`UnsupportedJournalURL` (or its subclass
        :class:`InvalidJournalURL`, naming the part and the rule) for anything else."""
        try:
            url = _split_url(raw)
        except (ArgumentError, ValueError):
            scheme = raw.split(":", 1)[0] if ":" in raw else raw
            raise UnsupportedJournalURL(scheme) from None
        entry = _SCHEMES.get(url.drivername)
        if entry is None:
            raise UnsupportedJournalURL(url.drivername)
        backend, driver = entry
        url = url.set(drivername=driver)
        if backend == "sqlite" and (not url.database or url.database == ":memory:"):
            raise UnsupportedJournalURL("sqlite (in-memory: the journal must be a file)")
        if url.host is not None and "@" in url.host:
            raise InvalidJournalURL(driver, "host", "contains '@' (percent-encode an '@' or '?' in the password "
                                                    "as %40 or %3F)")
        known = QUERY_ARGUMENTS[backend]
        shown = ", ".join(sorted(known)) or "none; the busy timeout is journal.busy_timeout_ms"
        for key, value in url.query.items():
            if key not in known:
                # The value is never shown: it may be a secret (?password=...).
                raise InvalidJournalURL(driver, f"query argument {key!r}",
                                        f"not known to a {backend} journal (known: {shown})")
            values = (value,) if isinstance(value, str) else tuple(value)
            if len(values) > 1 and key not in _REPEATABLE:
                raise InvalidJournalURL(driver, f"query argument {key!r}", "given more than once")
            for one in values:
                rule = known[key](one)
                if rule is not None:
                    raise InvalidJournalURL(driver, f"query argument {key}={one!r}", rule)
        return cls(backend, url)

    def redacted(self) -> str:
        """The URL with any password hidden, safe for logs and errors."""
        return self.url.render_as_string(hide_password=True)

    def scrub(self, text: str) -> str:
        """``text`` with every occurrence of the password (raw and percent-encoded) replaced by ``***``."""
        password = self.url.password
        if password:
            for form in {str(password), urllib.parse.quote(str(password), safe=""),
                         urllib.parse.quote_plus(str(password))}:
                text = text.replace(form, "***")
        return text


def _install_sqlite_pragmas(engine: AsyncEngine, busy_timeout_ms: int, read_only: bool = False) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if read_only:
            _read_only_pragmas(dbapi_connection, busy_timeout_ms)
        else:
            sqlite_pragmas(dbapi_connection, busy_timeout_ms)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        # Reads only: writes go through the writer connection (journal/writer.py).
        conn.exec_driver_sql("BEGIN")


def _read_only_pragmas(dbapi_connection: Any, busy_timeout_ms: int) -> None:
    """A read-only SQLite connection: no journal-mode or sync change (those write), queries only."""
    dbapi_connection.isolation_level = None
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA query_only=ON")
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cur.close()


def _sqlite_uri(path: str, immutable: bool) -> str:
    return f"file:{urllib.parse.quote(path)}?mode=ro" + ("&immutable=1" if immutable else "")


def sqlite_read_only_url(url: JournalURL) -> sa.URL:
    """The driver URL that opens ``url``'s SQLite file read-only, creating nothing.

    The file must exist (else :class:`JournalNotFound`). It is opened with ``mode=ro``, so
    no database file is ever created; in WAL mode SQLite still needs the ``-shm`` (and
    ``-wal``) beside it, which it can create in a writable directory or use when they are
    there. Where neither holds (a read-only mount after a clean shutdown: no ``-wal``, no
    ``-shm``, no way to create them) the file is opened ``immutable=1``: nobody can be
    writing it, and with no write-ahead log the file alone is the whole journal. A ``-wal``
    with content that cannot be opened is refused (:class:`JournalUnreadable`), never
    silently skipped.
    """
    assert url.backend == "sqlite" and url.url.database
    path = os.path.abspath(url.url.database)
    if not os.path.exists(path):
        raise JournalNotFound(path)
    if not os.path.isfile(path):
        raise JournalNotFound(path, "not a regular file")
    immutable = False
    try:
        _probe(_sqlite_uri(path, immutable=False))
    except sqlite3.DatabaseError as exc:
        wal = path + "-wal"
        has_log = os.path.exists(wal) and os.path.getsize(wal) > 0
        if has_log or os.access(os.path.dirname(path), os.W_OK) or "unable to open" not in str(exc):
            why = str(exc)
            if has_log:
                why += f" (its write-ahead log {wal} cannot be read from this directory)"
            raise JournalUnreadable(path, why) from None
        try:
            _probe(_sqlite_uri(path, immutable=True))
        except sqlite3.DatabaseError as again:
            raise JournalUnreadable(path, str(again)) from None
        immutable = True
    query = {"uri": "true", "mode": "ro", **({"immutable": "1"} if immutable else {})}
    return sa.URL.create("sqlite+aiosqlite", database=f"file:{urllib.parse.quote(path)}", query=query)


def _probe(uri: str) -> None:
    conn = sqlite3.connect(uri, uri=True)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    finally:
        conn.close()


def create_engine(url: JournalURL, *, busy_timeout_ms: int = 5000, pool_size: int = 5,
                  read_only: bool = False) -> AsyncEngine:
    """An async engine for ``url`` with the journal's durability settings.

    ``read_only=True``: SQLite opens the existing file read-only (see :func:`sqlite_read_only_url`;
    raises :class:`JournalNotFound` or :class:`JournalUnreadable` at once); PostgreSQL sessions
    start with ``default_transaction_read_only=on``.
    """
    kwargs: dict[str, Any] = {"json_serializer": dumps, "json_deserializer": loads}
    driver_url = url.url
    if url.backend == "sqlite":
        kwargs["connect_args"] = {"timeout": busy_timeout_ms / 1000}
        if read_only:
            driver_url = sqlite_read_only_url(url)
    else:
        kwargs["pool_size"] = pool_size
        kwargs["max_overflow"] = pool_size
        kwargs["pool_recycle"] = 1800
        if read_only:
            kwargs["connect_args"] = {"server_settings": {"default_transaction_read_only": "on"}}
    engine = create_async_engine(driver_url, **kwargs)
    if url.backend == "sqlite":
        _install_sqlite_pragmas(engine, busy_timeout_ms, read_only)
    return engine


class Journal:
    """The durable store: a connection pool, the kind registry, a clock and commit listeners.

    Writes happen only in :meth:`write` transactions, through :class:`journal.WriteTx`.
    A journal opened ``read_only`` refuses them (:class:`ReadOnlyJournal`).
    """

    def __init__(self, engine: AsyncEngine, url: JournalURL, *, kinds: KindRegistry | None = None,
                 clock: Now = utcnow, actor: str = "tidelog", busy_timeout_ms: int = 5000,
                 read_only: bool = False) -> None:
        self.engine = engine
        self.url = url
        self.kinds = kinds if kinds is not None else builtin_kinds()
        self.clock = clock
        self.actor = actor
        self.read_only = read_only
        self._listeners: list[CommitListener] = []
        # A read-only journal has no writer (and its point reads go through ``engine``).
        self._sqlite_writer = (SqliteWriterThread(url.url, busy_timeout_ms)
                               if url.backend == "sqlite" and not read_only else None)

    @classmethod
    def open(cls, raw_url: str, *, kinds: KindRegistry | None = None, clock: Now = utcnow,
             actor: str = "tidelog", busy_timeout_ms: int = 5000, pool_size: int = 5,
             read_only: bool = False) -> Journal:
        """Build a journal for ``raw_url`` (no connection is made until first use).

        ``read_only=True`` (the CLI's ``status``, ``events``, ``verify``, ``replay``): writes are
        refused, and a SQLite journal must already exist: it is never created, and is opened so
        that a read-only file on a read-only mount can still be read (see
        :func:`sqlite_read_only_url`). Raises :class:`JournalNotFound` / :class:`JournalUnreadable`
        at once when it cannot be; a PostgreSQL server is still only reached at first use.
        """
        url = JournalURL.parse(raw_url)
        engine = create_engine(url, busy_timeout_ms=busy_timeout_ms, pool_size=pool_size, read_only=read_only)
        return cls(engine, url, kinds=kinds, clock=clock, actor=actor, busy_timeout_ms=busy_timeout_ms,
                   read_only=read_only)

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
        Commit listeners run after the commit. A read-only journal raises :class:`ReadOnlyJournal`.
        """
        if self.read_only:
            raise ReadOnlyJournal()
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
        See :mod:`journal.batch`. A read-only journal raises :class:`ReadOnlyJournal`.
        """
        if self.read_only:
            raise ReadOnlyJournal()
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
