"""Reading a journal back in tests: whole-database snapshots, rows, events, a settable clock."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from journal import Journal, models

#: A fixed instant with microseconds, to see that they survive a round trip.
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)


class FakeClock:
    """A journal clock (``Journal.open(url, clock=FakeClock())``) that moves only when told."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


async def snapshot(journal: Journal) -> dict[str, list[dict[str, Any]]]:
    """Every row of every journal table (entity tables of all registered kinds too), in key order."""
    tables = {t.name: t for t in models.metadata.sorted_tables}
    for kind in journal.kinds:
        tables[kind.table.name] = kind.table
    out: dict[str, list[dict[str, Any]]] = {}
    async with journal.read() as conn:
        for name, table in sorted(tables.items()):
            key = list(table.primary_key.columns)
            rows = (await conn.execute(sa.select(table).order_by(*key))).all()
            out[name] = [dict(r._mapping) for r in rows]
    return out


async def events(journal: Journal, kind: str | None = None, entity_id: str | None = None
                 ) -> list[dict[str, Any]]:
    """Events in sequence order, optionally of one kind / one entity."""
    e = models.events
    stmt = sa.select(e).order_by(e.c.seq)
    if kind is not None:
        stmt = stmt.where(e.c.entity_kind == kind)
    if entity_id is not None:
        stmt = stmt.where(e.c.entity_id == entity_id)
    async with journal.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(stmt)).all()]


async def row(journal: Journal, kind: str, entity_id: str) -> dict[str, Any] | None:
    """The entity row as a dict, or ``None``."""
    table = journal.kinds.get(kind).table
    async with journal.read() as conn:
        found = (await conn.execute(sa.select(table).where(table.c.id == entity_id))).first()
    return None if found is None else dict(found._mapping)


async def raw_execute(journal: Journal, sql: str, **params: Any) -> None:
    """Run ``sql`` straight through the engine, behind the journal's back (fault injection)."""
    async with journal.engine.begin() as conn:
        await conn.execute(sa.text(sql), params)
