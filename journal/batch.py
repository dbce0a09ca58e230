"""Declarative operations, applied many at a time in one transaction (group commit).

A :class:`Create` or :class:`Transition` says what to write; :func:`apply_groups`
writes many groups of them in one transaction, each group all-or-nothing:

- every operation is checked against its machine and table first; a group
  with a bad operation fails before anything is written;
- the operations run one after another in one transaction (on SQLite each is
  an inline statement; on PostgreSQL a batch of single transitions of one
  kind goes instead as one statement, see :mod:`journal.batch_pg`);
- an operation whose compare-and-set matches no row wrote nothing and fails
  its group with :class:`StaleRow` (or :class:`DuplicateEntity`); when such a
  group had already written other operations, the transaction is rolled back
  and the batch is applied again without the failed groups.

Each successful operation still records its own event, exactly as
:meth:`WriteTx.create` and :meth:`WriteTx.transition` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .commits import Committed, Fence
from .errors import ConstraintViolation, DuplicateEntity, JournalError, StaleRow
from .ops import Create, Op, Outcome, Transition, runs

if TYPE_CHECKING:
    from .database import Journal
    from .writes import WriteTx


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
            # Only the first group that failed after writing is known to fail on its own:
            # a later failure may have come from that group's write, now rolled back.
            # Drop it and apply everything else again; each pass drops one group.
            first = min(retry.failed)
            outcomes[first] = retry.failed[first]
            live = [i for i in live if i != first]
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
    for start, end in runs([op for _, _, op, _ in flat]):
        span = flat[start:end]
        # A run of one shape goes at once (SQLite executemany, PostgreSQL one statement) when every
        # row in it is written; else one by one.
        if end - start > 1 and not any(g in errors for g, _, _, _ in span) and await tx.execute_prepared_many(
                [op for _, _, op, _ in span], [prep for _, _, _, prep in span]):
            done.update({(g, k): True for g, k, _, _ in span})
            continue
        for g, k, op, prep in span:
            if g in errors:
                continue
            try:
                done[(g, k)] = await tx.execute_prepared(op, prep)
            except (StaleRow, DuplicateEntity, ConstraintViolation) as exc:
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


# Create, Op, Outcome and Transition live in journal.ops; they are named here too, where they were first.
__all__ = ["Create", "Op", "Outcome", "Transition", "apply_groups"]
