"""Audit helpers: query the event log, fold it, and check it against the rows.

Folding an entity's events in sequence order must give its current row:
the first event creates it (``from_state`` NULL, ``version`` 1, every data
column in ``payload.set``), each later one moves ``from_state -> to_state``,
adds one to the version and sets the columns it names. :func:`verify` does
that for every entity of every registered kind and reports each mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from . import models
from .database import Journal
from .writes import jsonable

MAX_PAGE = 1000


@dataclass(frozen=True)
class EventFilter:
    """Filters for the event log; every field is optional and they combine with AND."""

    entity_kind: str | None = None
    entity_id: str | None = None
    to_state: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after_seq: int = 0
    limit: int = 100

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, got {self.limit}")
        if self.after_seq < 0:
            raise ValueError(f"after must be >= 0, got {self.after_seq}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name} must carry a timezone, got {value.isoformat()}")
        if self.since and self.until and self.since > self.until:
            raise ValueError("since must not be later than until")


async def query_events(conn: AsyncConnection, flt: EventFilter) -> list[dict[str, Any]]:
    """One page of events in sequence order, after ``flt.after_seq``."""
    e = models.events
    stmt = sa.select(e).where(e.c.seq > flt.after_seq)
    if flt.entity_kind is not None:
        stmt = stmt.where(e.c.entity_kind == flt.entity_kind)
    if flt.entity_id is not None:
        stmt = stmt.where(e.c.entity_id == flt.entity_id)
    if flt.to_state is not None:
        stmt = stmt.where(e.c.to_state == flt.to_state)
    if flt.since is not None:
        stmt = stmt.where(e.c.ts >= flt.since)
    if flt.until is not None:
        stmt = stmt.where(e.c.ts <= flt.until)
    rows = (await conn.execute(stmt.order_by(e.c.seq).limit(flt.limit))).all()
    return [dict(r._mapping) for r in rows]


@dataclass
class Folded:
    """An entity as its events describe it."""

    state: str
    version: int
    values: dict[str, Any] = field(default_factory=dict)
    updated_at: datetime | None = None
    problems: list[str] = field(default_factory=list)


def fold(events: Sequence[dict[str, Any]]) -> Folded | None:
    """Replay one entity's events (sequence order) into the row they describe."""
    folded: Folded | None = None
    for ev in events:
        payload = ev.get("payload") or {}
        sets = payload.get("set", {})
        if folded is None:
            folded = Folded(ev["to_state"], ev["version"], dict(sets), ev["ts"])
            if ev["from_state"] is not None or ev["version"] != 1:
                folded.problems.append(f"event {ev['seq']}: history does not start with a create")
            continue
        if ev["from_state"] != folded.state:
            folded.problems.append(
                f"event {ev['seq']}: moves from {ev['from_state']!r} but the entity was {folded.state!r}")
        if ev["version"] != folded.version + 1:
            folded.problems.append(
                f"event {ev['seq']}: version {ev['version']} does not follow {folded.version}")
        folded.state = ev["to_state"]
        folded.version = ev["version"]
        folded.values.update(sets)
        folded.updated_at = ev["ts"]
    return folded


@dataclass(frozen=True)
class Mismatch:
    kind: str
    entity_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.entity_id}: {self.detail}"


async def verify(journal: Journal, kinds: Sequence[str] | None = None) -> list[Mismatch]:
    """Fold every entity's events and compare with its row; return every mismatch."""
    out: list[Mismatch] = []
    e = models.events
    names = kinds if kinds is not None else journal.kinds.names()
    # One snapshot for rows and events alike, or concurrent writes look like mismatches.
    async with journal.read(snapshot=True) as conn:
        for name in names:
            ek = journal.kinds.get(name)
            rows = {r.id: r._mapping for r in (await conn.execute(sa.select(ek.table))).all()}
            history: dict[str, list[dict[str, Any]]] = {}
            result = await conn.stream(sa.select(e).where(e.c.entity_kind == name).order_by(e.c.seq))
            async for ev in result:
                history.setdefault(ev.entity_id, []).append(dict(ev._mapping))
            for entity_id in sorted(set(rows) | set(history)):
                out.extend(_compare(ek.name, entity_id, ek.data_columns, rows.get(entity_id),
                                    fold(history.get(entity_id, []))))
    return out


def _compare(kind: str, entity_id: str, columns: Sequence[str], row: Any, folded: Folded | None
             ) -> list[Mismatch]:
    if row is None:
        return [Mismatch(kind, entity_id, "events exist but the row is missing")]
    if folded is None:
        return [Mismatch(kind, entity_id, "row exists with no events (written outside the journal)")]
    out = [Mismatch(kind, entity_id, p) for p in folded.problems]
    if row["state"] != folded.state:
        out.append(Mismatch(kind, entity_id, f"state is {row['state']!r}, events say {folded.state!r}"))
    if row["version"] != folded.version:
        out.append(Mismatch(kind, entity_id, f"version is {row['version']}, events say {folded.version}"))
    if folded.updated_at is not None and row["updated_at"] != folded.updated_at:
        out.append(Mismatch(kind, entity_id,
                            f"updated_at is {row['updated_at']}, last event at {folded.updated_at}"))
    for col in columns:
        actual = jsonable(row[col])
        expected = folded.values.get(col)
        if actual != expected:
            out.append(Mismatch(kind, entity_id, f"column {col} is {actual!r}, events say {expected!r}"))
    return out
