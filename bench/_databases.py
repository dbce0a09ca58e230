"""A fresh journal database per benchmark part, for the benches in this folder (run as scripts).

PostgreSQL: ``TIDELOG_BENCH_POSTGRES_URL`` (default the local trust server) names the admin
database; each part creates its own database and drops it when done.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy as sa

from journal import schema


def pg_admin_url() -> str:
    return os.environ.get("TIDELOG_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


class Database:
    """A fresh, migrated journal database of one backend; dropped (PostgreSQL) when closed."""

    def __init__(self, backend: str, tmp: Path, prefix: str) -> None:
        self.backend, self.tmp = backend, tmp
        self.name = f"{prefix}_{uuid.uuid4().hex[:10]}"

    async def __aenter__(self) -> str:
        if self.backend == "sqlite":
            url = f"sqlite+aiosqlite:///{self.tmp / (self.name + '.db')}"
        else:
            conn = await asyncpg.connect(pg_admin_url())
            try:
                await conn.execute(f'CREATE DATABASE "{self.name}"')
            finally:
                await conn.close()
            url = (sa.make_url(pg_admin_url()).set(drivername="postgresql+asyncpg", database=self.name)
                   .render_as_string(hide_password=False))
        await asyncio.to_thread(schema.upgrade, url)
        return url

    async def __aexit__(self, *_exc: Any) -> None:
        if self.backend == "postgresql":
            conn = await asyncpg.connect(pg_admin_url())
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            finally:
                await conn.close()
