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
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import models
from .commits import Committed, Fence
from .errors import JournalError, LeaseLost
from .ops import Outcome, Transition
from .statements_pg import MAX_ROWS, pad, transition_statement, transition_value_names
from .writes import WriteTx

if TYPE_CHECKING:
    from .database import Journal

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
        stmt = transition_statement(table, columns, pad(params, transition_value_names(columns), len(live)), fence is not None)
        async with journal.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            written = set((await conn.execute(stmt, params)).scalars())

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
