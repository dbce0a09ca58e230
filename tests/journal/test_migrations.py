"""Schema: the Alembic revisions match the models, run both ways, and the start-up check says what to do."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from journal import Journal, SchemaMismatch, models, schema
from tests.support.journal_state import raw_execute

TABLES = {"events", "leases", "rpc_calls", "participants"}


def _diffs(conn: sa.Connection) -> list[Any]:
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return list(compare_metadata(context, models.metadata))


def _tables(conn: sa.Connection) -> set[str]:
    return set(sa.inspect(conn).get_table_names())


async def test_models_and_migrations_agree(journal: Journal) -> None:
    async with journal.engine.connect() as conn:
        assert await conn.run_sync(_diffs) == []


async def test_upgrade_downgrade_upgrade(fresh_url: str) -> None:
    journal = Journal.open(fresh_url)
    try:
        async with journal.engine.connect() as conn:
            assert await conn.run_sync(_tables) & TABLES == set()
        await asyncio.to_thread(schema.upgrade, fresh_url)
        assert await schema.current_revision(journal) == schema.head_revision()
        async with journal.engine.connect() as conn:
            assert await conn.run_sync(_tables) >= TABLES
        async with journal.write() as tx:
            await tx.create("participants", "p1", reason="before downgrade", values={"url": "u"})

        await journal.dispose()  # no connection of ours may hold the tables during DDL
        await asyncio.to_thread(schema.downgrade, fresh_url, "base")
        async with journal.engine.connect() as conn:
            assert await conn.run_sync(_tables) & TABLES == set()
        assert await schema.current_revision(journal) is None

        await journal.dispose()
        await asyncio.to_thread(schema.upgrade, fresh_url)
        assert await schema.check_schema(journal) == schema.head_revision()
        async with journal.engine.connect() as conn:
            assert await conn.run_sync(_diffs) == []
        # The re-created schema works, starts empty, and its event log is append-only again.
        async with journal.write() as tx:
            assert await tx.get("participants", "p1") is None
            await tx.create("participants", "p1", reason="after upgrade", values={"url": "u"})
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            await raw_execute(journal, "DELETE FROM events")
    finally:
        await journal.dispose()


async def test_upgrade_is_idempotent(journal_url: str) -> None:
    await asyncio.to_thread(schema.upgrade, journal_url)  # already at head: nothing to do
    journal = Journal.open(journal_url)
    try:
        assert await schema.check_schema(journal) == schema.head_revision()
    finally:
        await journal.dispose()


async def test_check_schema_on_an_unmigrated_database_says_run_migrate(fresh_url: str) -> None:
    journal = Journal.open(fresh_url)
    try:
        with pytest.raises(SchemaMismatch) as info:
            await schema.check_schema(journal)
        assert info.value.current is None and info.value.head == schema.head_revision()
        assert "tidelog migrate" in info.value.hint
        assert "empty (never migrated)" in str(info.value)
    finally:
        await journal.dispose()


async def test_check_schema_after_downgrade_to_base_says_run_migrate(fresh_url: str) -> None:
    await asyncio.to_thread(schema.upgrade, fresh_url)
    await asyncio.to_thread(schema.downgrade, fresh_url, "base")
    journal = Journal.open(fresh_url)
    try:
        with pytest.raises(SchemaMismatch, match="tidelog migrate"):
            await schema.check_schema(journal)
    finally:
        await journal.dispose()


async def test_check_schema_on_a_newer_schema_says_upgrade_tidelog(journal: Journal) -> None:
    assert await schema.check_schema(journal) == schema.head_revision()
    await raw_execute(journal, "UPDATE alembic_version SET version_num = 'f00dcafe0099'")
    with pytest.raises(SchemaMismatch) as info:
        await schema.check_schema(journal)
    assert info.value.current == "f00dcafe0099"
    assert "newer Tidelog" in info.value.hint and "tidelog migrate" not in info.value.hint


def test_revisions_form_one_line_ending_at_head() -> None:
    known = schema.known_revisions()
    assert schema.head_revision() in known
    assert "0001" in known


def test_the_start_up_check_reads_the_same_revisions_as_alembic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # schema.head_revision/known_revisions read the scripts' lines instead of importing Alembic.
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory(str(schema.migrations_dir()))
    assert schema.head_revision() == scripts.get_current_head()
    assert schema.known_revisions() == {s.revision for s in scripts.walk_revisions()}
    # Two heads (a branch) are refused, not guessed between.
    versions = tmp_path / "versions"
    versions.mkdir()
    for rev, down in (("a1", None), ("b1", "a1"), ("b2", "a1")):
        (versions / f"{rev}.py").write_text(f'revision = "{rev}"\ndown_revision = {down!r}\n'.replace("'", '"'))
    monkeypatch.setenv("TIDELOG_MIGRATIONS_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"expected one Alembic head.*\['b1', 'b2'\]"):
        schema.head_revision()
    # A merge revision (a tuple) joins them; annotated lines, as newer Alembic templates write them.
    (versions / "c1.py").write_text('revision: str = "c1"\ndown_revision: tuple[str, str] = ("b1", "b2")\n')
    assert schema.head_revision() == "c1" and schema.known_revisions() == {"a1", "b1", "b2", "c1"}
