"""What the checkpoint family's rows are called as they move: terminal states (from the machines)
and stage names (prepare stages, retire order), shared by its routes and the CLI's progress lines."""

from __future__ import annotations

from journal import machines

from engine.workflows.checkpoint.checkpoint import STAGES
from engine.workflows.checkpoint.retirement import RETIRE_ORDER

#: The terminal states of each workflow row kind, as its machine declares them.
TERMINAL: dict[str, tuple[str, ...]] = {
    m.kind: tuple(sorted(m.terminal)) for m in (machines.CHECKPOINTS, machines.RESTORES, machines.RETIREMENTS)}
#: The name of each stage index of a staged row (checkpoints: prepare stages; retirements: retire order).
STAGE_NAMES: dict[str, tuple[str, ...]] = {"checkpoints": STAGES,
                                           "retirements": tuple("+".join(k) for k in RETIRE_ORDER)}

__all__ = ["STAGE_NAMES", "TERMINAL"]
