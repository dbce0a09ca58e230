"""Schema revisions: where the Alembic scripts are, applying them, and the start-up check."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from .database import Journal, JournalURL
from .errors import SchemaMismatch


def migrations_dir() -> Path:
    """The ``migrations/`` directory (``TIDELOG_MIGRATIONS_DIR`` overrides it)."""
    override = os.environ.get("TIDELOG_MIGRATIONS_DIR")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # Kept out of the ini options on purpose: '%' in a password would break interpolation.
    cfg.attributes["journal_url"] = JournalURL.parse(url).url
    return cfg


def head_revision() -> str:
    head = ScriptDirectory(str(migrations_dir())).get_current_head()
    if head is None:
        raise RuntimeError(f"no Alembic revisions under {migrations_dir()}")
    return head


def known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory(str(migrations_dir())).walk_revisions()}


def upgrade(url: str, revision: str = "head") -> None:
    """Apply revisions up to ``revision`` (blocking; runs its own event loop)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


async def current_revision(journal: Journal) -> str | None:
    async with journal.read() as conn:
        has_table = await conn.run_sync(lambda c: sa.inspect(c).has_table("alembic_version"))
        if not has_table:
            return None
        value = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar()
    return None if value is None else str(value)


async def check_schema(journal: Journal) -> str:
    """Return the revision, or raise :class:`SchemaMismatch` saying what to run."""
    head = head_revision()
    current = await current_revision(journal)
    if current == head:
        return current
    if current is None or current in known_revisions():
        raise SchemaMismatch(current, head, "run `tidelog migrate` (with the same --config) first")
    raise SchemaMismatch(current, head, "the journal was migrated by a newer Tidelog; "
                                        "run that version, or upgrade this installation")
