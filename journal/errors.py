"""Typed errors raised by the journal.

Every error that refuses a write is raised *before* anything is written, or
from inside the transaction so that the transaction rolls back: a caller that
catches one of these can rely on the journal being unchanged by the refused
operation.
"""

from __future__ import annotations

from collections.abc import Iterable


class JournalError(Exception):
    """Base class of every error the journal raises on purpose."""


class UnknownEntityKind(JournalError):
    """The entity kind has no registered table and state machine."""

    def __init__(self, kind: str, known: Iterable[str]) -> None:
        self.kind = kind
        self.known = sorted(known)
        super().__init__(f"unknown entity kind {kind!r}; registered kinds: {', '.join(self.known)}")


class UnknownState(JournalError):
    """A state name that the kind's state machine does not define."""

    def __init__(self, kind: str, state: str, states: Iterable[str]) -> None:
        self.kind = kind
        self.state = state
        super().__init__(f"{kind}: {state!r} is not a state of this machine (states: {', '.join(sorted(states))})")


class IllegalTransition(JournalError):
    """The edge ``from_state -> to_state`` is not in the kind's state machine."""

    def __init__(self, kind: str, entity_id: str, from_state: str | None, to_state: str,
                 allowed: Iterable[str]) -> None:
        self.kind = kind
        self.entity_id = entity_id
        self.from_state = from_state
        self.to_state = to_state
        self.allowed = sorted(allowed)
        super().__init__(
            f"{kind} {entity_id!r}: illegal transition {from_state!r} -> {to_state!r}; "
            f"allowed from {from_state!r}: {', '.join(self.allowed) or '(none, terminal)'}"
        )


class StaleRow(JournalError):
    """The compare-and-set found the row in another state or version.

    The caller should re-read the row and decide again; nothing was written.
    """

    def __init__(self, kind: str, entity_id: str, expected_state: str, expected_version: int,
                 actual_state: str | None, actual_version: int | None) -> None:
        self.kind = kind
        self.entity_id = entity_id
        self.expected_state = expected_state
        self.expected_version = expected_version
        self.actual_state = actual_state
        self.actual_version = actual_version
        found = ("no such row" if actual_state is None
                 else f"found {actual_state!r} v{actual_version}")
        super().__init__(
            f"{kind} {entity_id!r}: stale row, expected {expected_state!r} v{expected_version}, {found}"
        )


class EntityNotFound(JournalError):
    def __init__(self, kind: str, entity_id: str) -> None:
        self.kind = kind
        self.entity_id = entity_id
        super().__init__(f"{kind} {entity_id!r} does not exist")


class DuplicateEntity(JournalError):
    def __init__(self, kind: str, entity_id: str) -> None:
        self.kind = kind
        self.entity_id = entity_id
        super().__init__(f"{kind} {entity_id!r} already exists")


class ConstraintViolation(JournalError):
    """A create the database refused for a reason other than its id: a unique index over
    other columns (``constraint``, where the database names it) already holds a row like it."""

    def __init__(self, kind: str, entity_id: str, constraint: str | None, detail: str) -> None:
        self.kind = kind
        self.entity_id = entity_id
        self.constraint = constraint
        self.detail = detail
        where = f" ({constraint})" if constraint else ""
        super().__init__(f"{kind} {entity_id!r} refused by a unique index{where}: {detail}")


class InvalidColumn(JournalError):
    """A write named a column the kind's table does not have, or one it may not set."""

    def __init__(self, kind: str, column: str, rule: str) -> None:
        self.kind = kind
        self.column = column
        super().__init__(f"{kind}: column {column!r} {rule}")


class InvalidPayload(JournalError):
    """A JSON value that the journal refuses to store (NaN, infinities, unserialisable types)."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        super().__init__(f"{where}: {reason}")


class LeaseLost(JournalError):
    """The writer no longer holds the leader lease at the epoch it claims.

    Raised inside the write transaction, so the transaction rolls back and the
    fenced writer changes nothing.
    """

    def __init__(self, name: str, holder: str, epoch: int, current_holder: str | None,
                 current_epoch: int | None, reason: str) -> None:
        self.name = name
        self.holder = holder
        self.epoch = epoch
        self.current_holder = current_holder
        self.current_epoch = current_epoch
        super().__init__(
            f"lease {name!r}: {holder!r} at epoch {epoch} may not write ({reason}; "
            f"lease now held by {current_holder!r} at epoch {current_epoch})"
        )


class UnsupportedJournalURL(JournalError):
    """The journal URL names a database this journal cannot use."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        super().__init__(
            f"journal.url: scheme {scheme!r} is not supported; use "
            "'sqlite+aiosqlite:///PATH' (embedded) or 'postgresql+asyncpg://USER@HOST:PORT/DB'"
        )


class SchemaMismatch(JournalError):
    """The database schema is not the one this code was written for."""

    def __init__(self, current: str | None, head: str, hint: str) -> None:
        self.current = current
        self.head = head
        self.hint = hint
        shown = current or "empty (never migrated)"
        super().__init__(f"journal schema is {shown}, this code needs {head}: {hint}")
