"""What a write is fenced by and what a commit hands its listeners (a leaf module: no journal imports)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fence:
    """Who writes: the lease name, the holder, and the epoch the holder claims."""

    lease: str
    holder: str
    epoch: int


@dataclass(frozen=True)
class Committed:
    """One entity write made durable by a commit (handed to commit listeners)."""

    kind: str
    entity_id: str
    from_state: str | None
    to_state: str
    version: int


CommitListener = Callable[[Sequence[Committed]], None]


__all__ = ["CommitListener", "Committed", "Fence"]
