"""Schema revisions: where the Alembic scripts are, applying them, and the start-up check."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from .database import Journal, JournalURL
from .errors import SchemaMismatch

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported only to apply revisions: the start-up check reads the scripts' own
# ``revision``/``down_revision`` lines (importing Alembic costs ~0.3 s of a restart).
_REVISION = re.compile(r"^revision(?:\s*:[^=\n]*)?\s*=\s*[\"']([^\"']+)[\"']", re.M)
_DOWN = re.compile(r"^down_revision(?:\s*:[^=\n]*)?\s*=\s*(.+)$", re.M)
_QUOTED = re.compile(r"[\"']([^\"']+)[\"']")


def migrations_dir() -> Path:
    """The ``migrations/`` directory (``TIDELOG_MIGRATIONS_DIR`` overrides it)."""
    override = os.environ.get("TIDELOG_MIGRATIONS_DIR")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # Kept out of the ini options on purpose: '%' in a password would break interpolation.
    cfg.attributes["journal_url"] = JournalURL.parse(url).url
    return cfg


def _revisions() -> dict[str, set[str]]:
    """Revision -> the revisions it follows (none for the first; several for a merge), read from
    the scripts under ``migrations/versions``."""
    out: dict[str, set[str]] = {}
    for script in sorted((migrations_dir() / "versions").glob("*.py")):
        text = script.read_text()
        rev, down = _REVISION.search(text), _DOWN.search(text)
        if rev is None or down is None:
            raise RuntimeError(f"{script}: no revision/down_revision line")
        out[rev.group(1)] = set(_QUOTED.findall(down.group(1)))
    return out


def head_revision() -> str:
    """The one revision no other follows."""
    revisions = _revisions()
    heads = set(revisions) - {down for downs in revisions.values() for down in downs}
    if len(heads) != 1:
        raise RuntimeError(f"expected one Alembic head under {migrations_dir()}, found {sorted(heads) or 'none'}")
    return heads.pop()


def known_revisions() -> set[str]:
    return set(_revisions())


def upgrade(url: str, revision: str = "head") -> None:
    """Apply revisions up to ``revision`` (blocking; runs its own event loop)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

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
