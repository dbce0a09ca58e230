"""Typed errors of the trainer worker.

Each error names what was wrong (a job field, a file, a target) and the rule it broke, and
each pickles with its fields intact, because executors carry worker exceptions across
process and Ray boundaries unchanged.
"""

from __future__ import annotations

from typing import Any

_MAX_VALUE_REPR = 80


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_REPR else text[: _MAX_VALUE_REPR - 1] + "…"


class TrainerError(Exception):
    """Base class of every error the trainer raises on purpose."""


class JobError(TrainerError, ValueError):
    """A training job that does not fit the job model: ``field`` held ``value``, breaking ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"job field {field}: {_short(value)} — {rule}")
        self.field = field
        self.value = value
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.rule))


class CheckpointError(TrainerError, ValueError):
    """A checkpoint file that cannot be trusted: ``path`` breaks ``rule`` (truncated, digest, …)."""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"checkpoint {path}: {rule}")
        self.path = path
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.rule))


class StepRecordError(TrainerError, ValueError):
    """A step-record file that is unreadable or malformed: ``path`` breaks ``rule``."""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"step record {path}: {rule}")
        self.path = path
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.rule))


class TargetError(TrainerError, ValueError):
    """A weights target or receiver that is malformed: ``field`` held ``value``, breaking ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"weights target {field}: {_short(value)} — {rule}")
        self.field = field
        self.value = value
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.rule))


class TrainerStateError(TrainerError, RuntimeError):
    """A call the trainer's current state forbids (a job applied twice, a checkpoint of a step
    never taken, weights sent before they were prepared)."""


__all__ = ["CheckpointError", "JobError", "StepRecordError", "TargetError", "TrainerError", "TrainerStateError"]
