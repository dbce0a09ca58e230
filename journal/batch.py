"""Declarative operations, applied many at a time in one transaction (group commit).

A :class:`Create` or :class:`Transition` says what to write; :func:`apply_groups`
writes many groups of them in one transaction, each group all-or-nothing:

- every operation is checked against its machine and table first; a group
  with a bad operation fails before anything is written;
- on PostgreSQL the compare-and-set updates of a batch that set the same
  columns go out as one ``UPDATE … FROM (VALUES …) RETURNING id`` statement,
  and creates as one ``INSERT … ON CONFLICT DO NOTHING RETURNING id``, so a
  batch costs a handful of round trips however many entities it moves; on
  SQLite each operation runs inline (no round trip to save);
- an operation whose compare-and-set matches no row wrote nothing and fails
  its group with :class:`StaleRow` (or :class:`DuplicateEntity`); when such a
  group had already written other operations, the transaction is rolled back
  and the batch is applied again without the failed groups.

Each successful operation still records its own event, exactly as
:meth:`WriteTx.create` and :meth:`WriteTx.transition` do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from .errors import DuplicateEntity, JournalError, StaleRow

if TYPE_CHECKING:
    from .database import Committed, Fence, Journal
    from .writes import WriteTx


@dataclass(frozen=True)
class Create:
    kind: str
    entity_id: str
    reason: str
    values: Mapping[str, Any] = field(default_factory=dict)
    state: str | None = None
    note: Mapping[str, Any] | None = None
    if_absent: bool = False


@dataclass(frozen=True)
class Transition:
    kind: str
    entity_id: str
    from_state: str
    version: int
    to_state: str
    reason: str
    changes: Mapping[str, Any] = field(default_factory=dict)
    note: Mapping[str, Any] | None = None


Op = Create | Transition
Outcome = list["Committed | None"] | Exception


class _Retry(Exception):
    def __init__(self, failed: dict[int, Exception]) -> None:
        self.failed = failed


async def apply_groups(journal: Journal, groups: Sequence[Sequence[Op]], fence: Fence | None
                       ) -> list[Outcome]:
    """Apply every group in one transaction (each group all-or-nothing); one outcome per group."""
    outcomes: dict[int, Outcome] = {}
    live = list(range(len(groups)))
    while live:
        try:
            async with journal.write(fence) as tx:
                got = await _apply(tx, [groups[i] for i in live])
                partial = {live[j]: r for j, r in enumerate(got)
                           if isinstance(r, _Partial)}
                if partial:
                    raise _Retry({i: p.error for i, p in partial.items()})
                for j, r in enumerate(got):
                    outcomes[live[j]] = r  # type: ignore[assignment]
            live = []
        except _Retry as retry:
            for i, exc in retry.failed.items():
                outcomes[i] = exc
            live = [i for i in live if i not in retry.failed]
    return [outcomes[i] for i in range(len(groups))]


@dataclass
class _Partial:
    error: Exception


async def _apply(tx: WriteTx, groups: Sequence[Sequence[Op]]) -> list[Outcome | _Partial]:
    results: list[Outcome | _Partial] = []
    prepared: list[list[Any] | None] = []
    for group in groups:
        try:
            prepared.append([tx.prepare(op) for op in group])
            results.append([])
        except (JournalError, ValueError) as exc:
            prepared.append(None)
            results.append(exc)
    done: dict[tuple[int, int], bool] = {}
    errors: dict[int, Exception] = {}
    flat = [(g, k, op, prep) for g, ops in enumerate(prepared) if ops is not None
            for k, (op, prep) in enumerate(zip(groups[g], ops))]
    if tx.journal.backend == "postgresql":
        await _apply_postgresql(tx, flat, done, errors)
    else:
        for g, k, op, prep in flat:
            if g in errors:
                continue
            try:
                done[(g, k)] = await tx.execute_prepared(op, prep)
            except (StaleRow, DuplicateEntity) as exc:
                errors[g] = exc
    for g, ops in enumerate(prepared):
        if ops is None:
            continue
        if g in errors:
            wrote = any(done.get((g, k)) for k in range(len(ops)))
            results[g] = _Partial(errors[g]) if wrote else errors[g]
            continue
        out: list[Committed | None] = []
        for k, op in enumerate(groups[g]):
            out.append(tx.record_prepared(op, ops[k]) if done.get((g, k)) else None)
        results[g] = out
    return results


async def _apply_postgresql(tx: WriteTx, flat: list[tuple[int, int, Op, Any]],
                            done: dict[tuple[int, int], bool], errors: dict[int, Exception]) -> None:
    creates: dict[str, list[tuple[int, int, Op, Any]]] = {}
    updates: dict[tuple[str, tuple[str, ...]], list[tuple[int, int, Op, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    for item in flat:
        g, k, op, prep = item
        key = (op.kind, op.entity_id)
        if key in seen:
            # Two operations on one entity in one statement cannot both compare-and-set:
            # run the later one on its own, after the batch statements.
            continue
        seen.add(key)
        if isinstance(op, Create):
            creates.setdefault(op.kind, []).append(item)
        else:
            updates.setdefault((op.kind, tuple(sorted(op.changes))), []).append(item)
    for kind, items in creates.items():
        table = tx.journal.kinds.get(kind).table
        rows = [prep["row"] for _, _, _, prep in items]
        stmt = postgresql.insert(table).values(rows).on_conflict_do_nothing(index_elements=["id"]) \
            .returning(table.c.id)
        inserted = set((await tx.execute(stmt)).scalars())
        for g, k, op, _ in items:
            ok = op.entity_id in inserted
            done[(g, k)] = ok
            if not ok and not (isinstance(op, Create) and op.if_absent):
                errors.setdefault(g, DuplicateEntity(op.kind, op.entity_id))
    for (kind, columns), items in updates.items():
        table = tx.journal.kinds.get(kind).table
        changed = set((await tx.execute(_values_update(table, columns, items))).scalars())
        for g, k, op, _ in items:
            ok = op.entity_id in changed
            done[(g, k)] = ok
            if not ok:
                assert isinstance(op, Transition)
                errors.setdefault(g, await tx.stale(op.kind, op.entity_id, op.from_state, op.version))
    for g, k, op, prep in flat:
        if (g, k) in done or g in errors:
            continue
        try:
            done[(g, k)] = await tx.execute_prepared(op, prep)
        except (StaleRow, DuplicateEntity) as exc:
            errors[g] = exc


def _values_update(table: sa.Table, columns: tuple[str, ...], items: list[tuple[int, int, Op, Any]]
                   ) -> sa.Update:
    c = table.c
    cols = [sa.column("w_id", c.id.type), sa.column("w_state", c.state.type),
            sa.column("w_version", c.version.type), sa.column("n_state", c.state.type),
            sa.column("n_at", c.updated_at.type), *[sa.column(f"c_{n}", c[n].type) for n in columns]]
    data = []
    for _, _, op, prep in items:
        assert isinstance(op, Transition)
        p = prep["params"]
        data.append((op.entity_id, op.from_state, op.version, op.to_state, p["updated_at"],
                     *[p[n] for n in columns]))
    v = sa.values(*cols, name="v").data(data)
    return (sa.update(table)
            .where(c.id == v.c.w_id, c.state == v.c.w_state, c.version == v.c.w_version)
            .values({"state": v.c.n_state, "version": c.version + 1, "updated_at": v.c.n_at,
                     **{n: v.c[f"c_{n}"] for n in columns}})
            .returning(c.id))
