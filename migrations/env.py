"""Alembic environment: runs revisions over the journal's own async engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from journal.database import JournalURL, create_engine
from journal.models import metadata

config = context.config
target_metadata = metadata


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      compare_type=True, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    url = config.attributes["journal_url"]
    engine = create_engine(JournalURL.parse(url.render_as_string(hide_password=False)))
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline SQL generation is not supported; run `tidelog migrate`")
asyncio.run(_main())
