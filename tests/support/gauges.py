"""A test entity kind with every awkward column type, and short spellings of batch operations.

``gauges`` has a text, an integer (NOT NULL, default 0), a float, a big integer, a
JSON and a timestamp column, so the PostgreSQL ``UPDATE … FROM (VALUES …)`` path
of :mod:`journal.batch` sees every bind cast it has to get right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from journal import Create, EntityKind, Journal, StateMachine, Transition, builtin_kinds, models
from journal.types import JSONValue, UTCDateTime

G = "gauges"

GAUGES = StateMachine.build(
    G,
    initial=["new"],
    edges={"new": ["on", "dead"], "on": ["on", "off", "dead"], "off": ["on", "dead"]},
    terminal=["dead"],
)

gauge_metadata = sa.MetaData()
gauges = sa.Table(
    G, gauge_metadata, *models.entity_columns(),
    sa.Column("label", sa.Text, nullable=True),
    sa.Column("hits", sa.Integer, nullable=False, default=0),
    sa.Column("ratio", sa.Float, nullable=True),
    sa.Column("big", sa.BigInteger, nullable=True),
    sa.Column("data", JSONValue(), nullable=True),
    sa.Column("seen_at", UTCDateTime(), nullable=True),
)
GAUGE_KIND = EntityKind(G, gauges, GAUGES)


async def open_gauge_journal(make_journal: Callable[..., Journal], **kwargs: Any) -> Journal:
    """``make_journal(**kwargs)`` with the gauges kind registered and its table created."""
    kinds = builtin_kinds()
    kinds.register(GAUGE_KIND)
    journal = make_journal(kinds=kinds, **kwargs)
    async with journal.engine.begin() as conn:
        await conn.run_sync(gauge_metadata.create_all)
    return journal


def C(entity_id: str, *, if_absent: bool = False, **values: Any) -> Create:  # noqa: N802
    """Create a gauge (state ``new``, version 1)."""
    return Create(G, entity_id, "made", values, if_absent=if_absent)


def T(entity_id: str, from_state: str, version: int, to_state: str,  # noqa: N802
      note: dict[str, Any] | None = None, **changes: Any) -> Transition:
    """Move a gauge ``from_state``/``version`` to ``to_state``."""
    return Transition(G, entity_id, from_state, version, to_state, "moved", changes, note)


async def seed(journal: Journal, *ids: str, **values: Any) -> None:
    """Create each gauge and move it new -> on, so every one sits at ``on`` v2."""
    outcomes = await journal.apply([[C(i, **values), T(i, "new", 1, "on")] for i in ids])
    assert all(isinstance(o, list) for o in outcomes), outcomes
