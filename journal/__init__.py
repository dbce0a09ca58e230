"""Tidelog's journal: the durable store and nothing else.

Public API: open a :class:`Journal`, write in ``async with journal.write(fence)``
through :class:`WriteTx` (``create``/``transition``), queue RPC intents with
:mod:`journal.outbox`, hold the leader lease with :mod:`journal.lease`, and
audit with :mod:`journal.audit`. This package imports no HTTP, Ray or torch.
"""

from .commits import Committed, Fence
from .database import (
    InvalidJournalURL,
    Journal,
    JournalNotFound,
    JournalUnreadable,
    JournalURL,
    ReadOnlyJournal,
    utcnow,
)
from .errors import (
    ConstraintViolation,
    DuplicateEntity,
    EntityNotFound,
    IllegalTransition,
    InvalidColumn,
    InvalidPayload,
    JournalError,
    LeaseLost,
    SchemaMismatch,
    StaleRow,
    UnknownEntityKind,
    UnknownState,
    UnsupportedJournalURL,
)
from .machines import StateMachine
from .registry import EntityKind, KindRegistry, builtin_kinds
from .ops import Create, Transition
from .writes import Row, WriteTx

__all__ = [
    "Committed", "ConstraintViolation", "Create", "DuplicateEntity", "EntityKind", "EntityNotFound", "Fence", "IllegalTransition",
    "InvalidColumn", "InvalidJournalURL", "InvalidPayload", "Journal", "JournalError", "JournalNotFound",
    "JournalURL", "JournalUnreadable", "KindRegistry", "LeaseLost", "ReadOnlyJournal", "Row", "SchemaMismatch", "StaleRow", "StateMachine", "Transition", "UnknownEntityKind",
    "UnknownState", "UnsupportedJournalURL", "WriteTx", "builtin_kinds", "utcnow",
]
