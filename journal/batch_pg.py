"""PostgreSQL: a batch of independent transitions as one self-committing statement.

When every group of a batch is a single :class:`Transition` of one kind setting
the same columns (the common case: many entities each taking their next step),
the batch needs no explicit transaction. One statement does everything, and it
commits by itself:

.. code-block:: sql

    WITH v(...) AS (VALUES …),                              -- one row per transition
         f AS (SELECT 1 FROM leases WHERE … FOR SHARE),     -- the fence, when fenced
         u AS (UPDATE t SET … FROM v WHERE <compare-and-set> AND EXISTS (SELECT 1 FROM f)
               RETURNING t.id, t.version),
         ev AS (INSERT INTO events … SELECT … FROM u JOIN v … ORDER BY v.ord RETURNING entity_id)
    SELECT entity_id FROM ev

Every transition that matched gets its event in the same statement (so in the
same implicit transaction); one that did not match wrote nothing, which is all
a single-operation group needs. That is one round trip per batch, and one for a
lone sequential transition.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import models
from .batch import Outcome, Transition
from .errors import JournalError, LeaseLost
from .writes import WriteTx

if TYPE_CHECKING:
    from .database import Committed, Fence, Journal

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


def eligible(journal: Journal, groups: Sequence[Sequence[Any]]) -> tuple[str, tuple[str, ...]] | None:
    """The (kind, columns) when the batch can go as one statement, else ``None``."""
    if journal.backend != "postgresql" or not groups or len(groups) > MAX_ROWS:
        return None
    shape: tuple[str, tuple[str, ...]] | None = None
    seen: set[str] = set()
    for group in groups:
        if len(group) != 1 or not isinstance(group[0], Transition):
            return None
        op = group[0]
        this = (op.kind, tuple(sorted(op.changes)))
        if shape is None:
            shape = this
        if this != shape or op.entity_id in seen or 8 + len(this[1]) > 30:
            return None
        seen.add(op.entity_id)
    return shape


@lru_cache(maxsize=128)
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


async def apply_one_statement(journal: Journal, groups: Sequence[Sequence[Any]], fence: Fence | None,
                              shape: tuple[str, tuple[str, ...]]) -> list[Outcome]:
    """Apply an :func:`eligible` batch in one self-committing statement."""
    kind, columns = shape
    table = journal.kinds.get(kind).table
    planner = WriteTx(journal, None, fence)  # used only to check operations and build payloads
    outcomes: list[Outcome | None] = [None] * len(groups)
    params: dict[str, Any] = {}
    live: list[tuple[int, Transition, dict[str, Any]]] = []
    for g, (op,) in enumerate(groups):
        try:
            prep = planner.prepare(op)
        except (JournalError, ValueError) as exc:
            outcomes[g] = exc
            continue
        i = len(live)
        live.append((g, op, prep))
        params.update({f"w_id_{i}": op.entity_id, f"w_state_{i}": op.from_state, f"w_version_{i}": op.version,
                       f"n_state_{i}": op.to_state, f"e_reason_{i}": op.reason,
                       f"e_payload_{i}": prep["payload"], f"ord_{i}": i,
                       **{f"c_{n}_{i}": op.changes[n] for n in columns}})
    committed: list[Committed] = []
    if live:
        params.update({"now": planner.now, "kind": kind,
                       "actor": fence.holder if fence else journal.actor, "epoch": fence.epoch if fence else None})
        if fence is not None:
            params.update({"f_name": fence.lease, "f_holder": fence.holder, "f_epoch": fence.epoch})
        stmt = _statement(table, columns, pad(params, transition_value_names(columns), len(live)), fence is not None)
        async with journal.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            written = set((await conn.execute(stmt, params)).scalars())
        from .database import Committed

        missing = [(g, op) for g, op, _ in live if op.entity_id not in written]
        if missing:
            await _diagnose(journal, fence, planner, missing, outcomes, written)
        for g, op, _ in live:
            if op.entity_id in written:
                done = Committed(kind, op.entity_id, op.from_state, op.to_state, op.version + 1)
                committed.append(done)
                outcomes[g] = [done]
    journal._notify(committed)
    return [o if o is not None else [] for o in outcomes]


async def _diagnose(journal: Journal, fence: Fence | None, planner: WriteTx,
                    missing: list[tuple[int, Transition]], outcomes: list[Outcome | None],
                    written: set[str]) -> None:
    """Say why each unmatched transition wrote nothing: a lost lease, else a stale row."""
    async with journal.engine.connect() as conn:
        if fence is not None and not written:
            lease = models.leases
            row = (await conn.execute(sa.select(lease.c.holder, lease.c.epoch, lease.c.expires_at)
                                      .where(lease.c.name == fence.lease))).first()
            if row is None or (row.holder, row.epoch) != (fence.holder, fence.epoch) \
                    or row.expires_at <= planner.now:
                raise LeaseLost(fence.lease, fence.holder, fence.epoch, row.holder if row else None,
                                row.epoch if row else None, "refused by the fence in a batched write")
        for g, op in missing:
            t = journal.kinds.get(op.kind).table
            found = (await conn.execute(sa.select(t.c.state, t.c.version).where(t.c.id == op.entity_id))).first()
            from .errors import StaleRow

            outcomes[g] = StaleRow(op.kind, op.entity_id, op.from_state, op.version,
                                   None if found is None else found.state,
                                   None if found is None else found.version)
