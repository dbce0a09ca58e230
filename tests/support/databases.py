"""Throwaway journal databases for the test suites: SQLite files and PostgreSQL databases.

Everything here hands out plain URL strings, so a test can pass the same URL to
a subprocess (``tidelog --journal-url ...``) as to :meth:`journal.Journal.open`.

PostgreSQL: the admin URL comes from ``TIDELOG_TEST_POSTGRES_URL`` (any spelling
:class:`journal.JournalURL` accepts), else :data:`DEFAULT_POSTGRES_URL`. One
:class:`PostgresServer` per test session migrates a template database once and
clones it per test with ``CREATE DATABASE ... TEMPLATE`` (a copy, much faster
than running the migrations again). A clone still costs a few hundred
milliseconds of server I/O, so a few are made ahead, in background threads,
while earlier tests run. Every database it created is dropped (``WITH (FORCE)``,
so a subprocess still connected cannot keep one alive) when the test ends, and
whatever is left, the template included, when the session ends.

The helpers are blocking; they run their own event loop in a worker thread, so
they are safe to call from sync code and from inside a running loop alike.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar


from journal import schema
from journal.database import JournalURL

ENV_URL = "TIDELOG_TEST_POSTGRES_URL"
#: Set to 1 (CI) to fail instead of skip when the PostgreSQL server does not answer.
ENV_REQUIRE = "TIDELOG_TEST_REQUIRE_POSTGRES"
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
PROBE_TIMEOUT_S = 2.0
ADMIN_TIMEOUT_S = 30.0
#: Migrated clones made ahead of need (they are created concurrently on the server).
PREFETCH = 4

T = TypeVar("T")


def blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` in a worker thread and wait for it.

    ``journal.schema.upgrade`` (through ``migrations/env.py``) calls
    ``asyncio.run``, which refuses to run inside a running loop; a worker thread
    has none.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="tidelog-test-db") as pool:
        return pool.submit(fn, *args).result()


def run_async(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``factory()`` makes to completion on a private loop in a worker thread."""
    return blocking(lambda: asyncio.run(factory()))


def migrate(url: str) -> None:
    """Apply every revision to ``url`` (blocking)."""
    blocking(schema.upgrade, url)


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def postgres_admin_url() -> str:
    return os.environ.get(ENV_URL) or DEFAULT_POSTGRES_URL


def postgres_required() -> bool:
    return os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes")


class PostgresServer:
    """Creates and drops the databases of one test session on one PostgreSQL server."""

    def __init__(self, admin_url: str) -> None:
        self.admin = JournalURL.parse(admin_url).url
        self.prefix = f"tidelog_test_{secrets.token_hex(4)}"
        self.template_name = f"{self.prefix}_tpl"
        self.unavailable: str | None = None
        self._template_ready = False
        self._created: list[str] = []
        self._counter = 0
        self._force = True
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(PREFETCH, thread_name_prefix="tidelog-test-pg")
        self._ready: deque[Future[str]] = deque()
        self._background: list[Future[Any]] = []

    # -- connection --------------------------------------------------------------------
    @property
    def redacted(self) -> str:
        return self.admin.render_as_string(hide_password=True)

    def url_for(self, database: str) -> str:
        """A journal URL for ``database`` on this server (password included: it is for use)."""
        return self.admin.set(database=database).render_as_string(hide_password=False)

    def _dsn(self) -> str:
        return self.admin.set(drivername="postgresql").render_as_string(hide_password=False)

    async def _admin(self, *statements: str, timeout: float = ADMIN_TIMEOUT_S) -> list[Any]:
        import asyncpg

        conn = await asyncpg.connect(self._dsn(), timeout=timeout)
        try:
            # CREATE/DROP DATABASE cannot run in a transaction; asyncpg autocommits.
            return [await conn.fetchval(sql) for sql in statements]
        finally:
            await conn.close()

    def probe(self) -> str | None:
        """``None`` when the server answers within :data:`PROBE_TIMEOUT_S`, else why not."""
        async def go() -> int:
            (version,) = await asyncio.wait_for(
                self._admin("SHOW server_version_num", timeout=PROBE_TIMEOUT_S), PROBE_TIMEOUT_S + 0.5)
            return int(version)

        try:
            version = run_async(go)
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable", with its reason
            self.unavailable = f"{type(exc).__name__}: {exc}".strip()
            return self.unavailable
        self._force = version >= 130000  # DROP DATABASE ... WITH (FORCE) is PostgreSQL 13+
        return None

    # -- databases ---------------------------------------------------------------------
    def _new_name(self) -> str:
        with self._lock:
            self._counter += 1
            return f"{self.prefix}_{self._counter}"

    def _create(self, name: str, template: str) -> None:
        with self._lock:
            self._created.append(name)
        run_async(lambda: self._admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))

    def ensure_template(self) -> str:
        """The migrated template database, created and migrated on first use."""
        with self._lock:
            ready = self._template_ready
        if not ready:
            self._create(self.template_name, "template0")
            migrate(self.url_for(self.template_name))
            with self._lock:
                self._template_ready = True
        return self.template_name

    def _clone(self, template: str) -> str:
        name = self._new_name()
        self._create(name, template)
        return name

    def create_migrated(self) -> str:
        """A new database at the head revision (made ahead when possible); returns its name."""
        template = self.ensure_template()
        with self._lock:
            if not self._ready:
                self._ready.append(self._workers.submit(self._clone, template))
            next_one = self._ready.popleft()
            while len(self._ready) < PREFETCH:
                self._ready.append(self._workers.submit(self._clone, template))
        return next_one.result()

    def create_empty(self) -> str:
        """A new database with no journal schema at all; returns its name."""
        name = self._new_name()
        self._create(name, "template0")
        return name

    def drop_later(self, name: str) -> None:
        """Drop ``name`` in the background (:meth:`drop_all` waits for it)."""
        with self._lock:
            self._background.append(self._workers.submit(self.drop, name))

    def drop(self, name: str) -> None:
        force = " WITH (FORCE)" if self._force else ""
        run_async(lambda: self._admin(f'DROP DATABASE IF EXISTS "{name}"{force}'))
        with self._lock:
            if name in self._created:
                self._created.remove(name)
            if name == self.template_name:
                self._template_ready = False

    def drop_all(self) -> None:
        """Drop every database this session created, the template last; raise if any remain."""
        with self._lock:
            pending = list(self._ready) + self._background
            self._ready.clear()
        for future in pending:
            future.cancel()
        self._workers.shutdown(wait=True)  # a clone being made is finished, then dropped below
        with self._lock:
            names = sorted(self._created, key=lambda n: n == self.template_name)
        failures = []
        for name in names:
            try:
                self.drop(name)
            except Exception as exc:  # noqa: BLE001 - try them all, then report
                failures.append(f"{name}: {exc}")
        if failures:
            raise RuntimeError("could not drop test databases on "
                               f"{self.redacted}: " + "; ".join(failures))
