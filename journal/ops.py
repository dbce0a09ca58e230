"""Declarative write operations (a leaf module): a :class:`Create` or a :class:`Transition` says
what to write, :data:`Outcome` what became of a group of them, and :func:`runs` which
neighbours share one shape (so they can go in one statement)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .commits import Committed


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
Outcome = list[Committed | None] | Exception


#: Shortest run of same-shaped operations worth an ``executemany`` (it costs two savepoint statements).
MIN_RUN = 4
#: Longest run in one statement (PostgreSQL: keeps the bind parameters well below its 32767).
MAX_RUN = 500


def runs(ops: Sequence[Op]) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``ops``: each run of ``MIN_RUN`` or more (at most ``MAX_RUN``)
    consecutive operations of one shape (creates of one kind; transitions of one kind setting the
    same columns), each of a different row, is one span; every other operation is a span of its own."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(ops):
        j = i + 1
        shape, seen = _shape(ops[i]), {ops[i].entity_id}
        while j < len(ops) and j - i < MAX_RUN and _shape(ops[j]) == shape and ops[j].entity_id not in seen:
            seen.add(ops[j].entity_id)
            j += 1
        if j - i >= MIN_RUN:
            spans.append((i, j))
        else:
            spans += [(k, k + 1) for k in range(i, j)]
        i = j
    return spans


def _shape(op: Op) -> tuple[str, str, tuple[str, ...]]:
    if isinstance(op, Create):
        return ("create", op.kind, ())
    return ("transition", op.kind, tuple(sorted(op.changes)))


__all__ = ["MAX_RUN", "MIN_RUN", "Create", "Op", "Outcome", "Transition", "runs"]
