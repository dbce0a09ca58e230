"""PostgreSQL: the statements a batch of transitions or creates is written with (a leaf module).

A batch is padded up to one of a few fixed row counts (:data:`SIZES`) with rows of NULLs that
write nothing, so each statement is built and prepared once per connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import sqlalchemy as sa

from . import models


#: Rows per statement: keeps the bind parameters well below PostgreSQL's 32767.
MAX_ROWS = 1000
#: The row counts statements are built for. A batch is padded up to the next one with rows of
#: NULLs (a NULL id matches no row and inserts nothing, so they write nothing and get no event),
#: so a handful of statements, each built and prepared once per connection, serve every size.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, MAX_ROWS)


def padded(rows: int) -> int:
    """The statement size for ``rows`` rows (``rows`` itself above the largest size)."""
    return next((size for size in SIZES if size >= rows), rows)


def pad(params: dict[str, Any], names: Sequence[str], rows: int) -> int:
    """Add NULL parameters for the padding rows after ``rows``; returns the padded size."""
    size = padded(rows)
    for i in range(rows, size):
        params.update({f"{name}_{i}": None for name in names})
    return size


def transition_value_names(columns: Sequence[str]) -> list[str]:
    """The per-row parameter names of a transition statement setting ``columns``."""
    return ["w_id", "w_state", "w_version", "n_state", "e_reason", "e_payload", "ord", *[f"c_{n}" for n in columns]]


def create_value_names(table: sa.Table) -> list[str]:
    """The per-row parameter names of a create statement for ``table``."""
    return [*table.c.keys(), "e_reason", "e_payload", "ord"]
_EVENT_COLS = ("entity_kind", "entity_id", "from_state", "to_state", "version", "reason", "actor", "epoch",
               "payload", "ts")


@lru_cache(maxsize=128)
def create_statement(table: sa.Table, rows: int) -> sa.TextClause:
    """``rows`` creates of ``table`` and their events: ``WITH v AS (VALUES …), r AS (INSERT … ON
    CONFLICT (id) DO NOTHING RETURNING id), ev AS (INSERT INTO events …) SELECT entity_id FROM ev``.

    Parameters per row ``i``: every column as ``<column>_i``, ``e_reason_i``, ``e_payload_i``,
    ``ord_i``; shared: ``now``, ``kind``, ``actor``, ``epoch``. A row whose id exists is left
    alone and gets no event (so fewer ids come back).
    """
    c = table.c
    ev = models.events.c
    names = list(c.keys())
    value_cols = create_value_names(table)
    types: dict[str, Any] = {**{n: c[n].type for n in names}, "e_reason": ev.reason.type,
                             "e_payload": ev.payload.type, "ord": sa.Integer()}
    tuples = ", ".join("(" + ", ".join(f":{name}_{i}" for name in value_cols) + ")" for i in range(rows))
    cols = ", ".join(names)
    sql = (f"WITH v ({', '.join(value_cols)}) AS (VALUES {tuples}), "
           f"r AS (INSERT INTO {table.name} ({cols}) SELECT {cols} FROM v WHERE v.id IS NOT NULL "
           f"ON CONFLICT (id) DO NOTHING "
           f"RETURNING id), "
           f"ev AS (INSERT INTO events ({', '.join(_EVENT_COLS)}) "
           f"SELECT :kind, v.id, NULL, v.state, 1, v.e_reason, :actor, :epoch, v.e_payload, :now "
           f"FROM r JOIN v ON v.id = r.id ORDER BY v.ord RETURNING entity_id) "
           f"SELECT entity_id FROM ev")
    binds = [sa.bindparam(f"{name}_{i}", type_=types[name]) for i in range(rows) for name in value_cols]
    binds += [sa.bindparam("now", type_=ev.ts.type), sa.bindparam("kind", type_=ev.entity_kind.type),
              sa.bindparam("actor", type_=ev.actor.type), sa.bindparam("epoch", type_=ev.epoch.type)]
    return sa.text(sql).bindparams(*binds)


def transition_statement(table: sa.Table, columns: tuple[str, ...], rows: int, fenced: bool) -> sa.TextClause:
    """``rows`` compare-and-set transitions setting ``columns`` and their events, in one statement."""
    return _statement(table, columns, rows, fenced)


@lru_cache(maxsize=128)
def _statement(table: sa.Table, columns: tuple[str, ...], rows: int, fenced: bool) -> sa.TextClause:
    c = table.c
    ev = models.events.c
    lease = models.leases.c
    value_cols = transition_value_names(columns)
    types: dict[str, Any] = {"w_id": c.id.type, "w_state": c.state.type, "w_version": c.version.type,
                             "n_state": c.state.type, "e_reason": ev.reason.type, "e_payload": ev.payload.type,
                             "ord": sa.Integer(), **{f"c_{n}": c[n].type for n in columns}}
    tuples = ", ".join("(" + ", ".join(f":{name}_{i}" for name in value_cols) + ")" for i in range(rows))
    sets = ", ".join([f"{n} = v.c_{n}" for n in columns]
                     + ["state = v.n_state", "version = t.version + 1", "updated_at = :now"])
    fence_cte = ("f AS (SELECT 1 FROM leases WHERE name = :f_name AND holder = :f_holder "
                 "AND epoch = :f_epoch AND expires_at > :now FOR SHARE), ") if fenced else ""
    fence_cond = " AND EXISTS (SELECT 1 FROM f)" if fenced else ""
    sql = (f"WITH v ({', '.join(value_cols)}) AS (VALUES {tuples}), {fence_cte}"
           f"u AS (UPDATE {table.name} AS t SET {sets} FROM v WHERE t.id = v.w_id AND t.state = v.w_state "
           f"AND t.version = v.w_version{fence_cond} RETURNING t.id, t.version), "
           f"ev AS (INSERT INTO events ({', '.join(_EVENT_COLS)}) "
           f"SELECT :kind, v.w_id, v.w_state, v.n_state, u.version, v.e_reason, :actor, :epoch, "
           f"v.e_payload, :now FROM u JOIN v ON v.w_id = u.id ORDER BY v.ord RETURNING entity_id) "
           f"SELECT entity_id FROM ev")
    binds = [sa.bindparam(f"{name}_{i}", type_=types[name]) for i in range(rows) for name in value_cols]
    binds += [sa.bindparam("now", type_=c.updated_at.type), sa.bindparam("kind", type_=ev.entity_kind.type),
              sa.bindparam("actor", type_=ev.actor.type), sa.bindparam("epoch", type_=ev.epoch.type)]
    if fenced:
        binds += [sa.bindparam("f_name", type_=lease.name.type), sa.bindparam("f_holder", type_=lease.holder.type),
                  sa.bindparam("f_epoch", type_=lease.epoch.type)]
    return sa.text(sql).bindparams(*binds)


__all__ = ["MAX_ROWS", "SIZES", "create_statement", "create_value_names", "pad", "padded",
           "transition_statement", "transition_value_names"]
