"""Entity kinds: which table and which state machine belong to a kind name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import sqlalchemy as sa

from . import machines, models
from .errors import InvalidColumn, UnknownEntityKind
from .machines import StateMachine

#: Columns the transition primitive manages itself; callers may never set them.
MANAGED = frozenset({"id", "state", "version", "created_at", "updated_at"})


@dataclass(frozen=True)
class EntityKind:
    """A kind of entity: its table (with the standard entity columns) and machine."""

    name: str
    table: sa.Table
    machine: StateMachine

    def __post_init__(self) -> None:
        missing = MANAGED - set(self.table.c.keys())
        if missing:
            raise ValueError(f"{self.name}: table {self.table.name} lacks entity columns {sorted(missing)}")
        if self.machine.kind != self.name:
            raise ValueError(f"{self.name}: machine is for {self.machine.kind!r}")

    @cached_property  # read on every write; a kind's table never changes
    def data_columns(self) -> tuple[str, ...]:
        """Columns the events record and folding rebuilds (everything but the managed ones)."""
        return tuple(c for c in self.table.c.keys() if c not in MANAGED)

    def check_columns(self, values: dict[str, object]) -> None:
        for col in values:
            if col in MANAGED:
                raise InvalidColumn(self.name, col, "is managed by the journal and cannot be set directly")
            if col not in self.table.c:
                raise InvalidColumn(self.name, col, f"is not a column of {self.table.name}")

    def check_not_null(self, values: dict[str, object]) -> None:
        """Refuse ``None`` for a NOT NULL column before the database would (and fail a whole batch)."""
        for col, value in values.items():
            if value is None and not self.table.c[col].nullable:
                raise InvalidColumn(self.name, col, "may not be NULL (it is NOT NULL and has no default)")

    def defaults(self) -> dict[str, object]:
        """The value each data column takes when a create does not name it (a new dict each call)."""
        return dict(self._defaults)

    @cached_property
    def _defaults(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.data_columns:
            default = self.table.c[name].default
            arg = getattr(default, "arg", None)
            out[name] = arg if default is not None and not callable(arg) else None
        return out


class KindRegistry:
    """The kinds a journal knows. Later workflows register theirs at start-up."""

    def __init__(self) -> None:
        self._kinds: dict[str, EntityKind] = {}

    def register(self, kind: EntityKind) -> None:
        existing = self._kinds.get(kind.name)
        if existing is not None and existing != kind:
            raise ValueError(f"entity kind {kind.name!r} is already registered differently")
        self._kinds[kind.name] = kind

    def get(self, name: str) -> EntityKind:
        try:
            return self._kinds[name]
        except KeyError:
            raise UnknownEntityKind(name, self._kinds) from None

    def __contains__(self, name: object) -> bool:
        return name in self._kinds

    def __iter__(self) -> Iterator[EntityKind]:
        return iter(self._kinds.values())

    def names(self) -> list[str]:
        return sorted(self._kinds)


def builtin_kinds() -> KindRegistry:
    reg = KindRegistry()
    reg.register(EntityKind("participants", models.participants, machines.PARTICIPANTS))
    reg.register(EntityKind("rpc_calls", models.rpc_calls, machines.RPC_CALLS))
    for table, machine in ((models.checkpoints, machines.CHECKPOINTS),
                           (models.checkpoint_members, machines.CHECKPOINT_MEMBERS),
                           (models.rollouts, machines.ROLLOUTS), (models.restores, machines.RESTORES),
                           (models.retirements, machines.RETIREMENTS),
                           (models.training_jobs, machines.TRAINING_JOBS), (models.engines, machines.ENGINES),
                           (models.weight_versions, machines.WEIGHT_VERSIONS),
                           (models.training_batches, machines.TRAINING_BATCHES),
                           (models.services, machines.SERVICES)):
        reg.register(EntityKind(machine.kind, table, machine))
    return reg
