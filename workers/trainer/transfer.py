"""Moving the trainer's weights to inference engines through a weights directory on disk.

A *target* names a weight version and the directory that holds it: a :class:`WeightsTarget`
or a mapping ``{"version": str, "directory": str}``. :func:`prepare` writes the model there
with :func:`workers.policy.save_weights` (the format the reference engine and
``update_weights_from_disk`` read). :func:`send` then has each receiver load that directory:
a receiver is an object with a ``load_weights(path)`` method, or a plain callable taking the
path. Receivers are called in order, synchronously; an asynchronous receiver (one returning
an awaitable) is refused, because the trainer runs inside an executor rank with no event loop
of its own — an orchestrator drives async engines itself, from the prepared directory.

``send`` checks first that the directory verifies (:func:`workers.policy.load_weights`) and
holds the target's version, so a receiver never loads a half-written or different version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from workers.policy import Policy, WeightsError, load_weights, save_weights
from workers.trainer.errors import TargetError, TrainerStateError


@runtime_checkable
class WeightsReceiver(Protocol):
    """Anything that loads a weights directory (an engine adapter, a test double, …)."""

    def load_weights(self, path: str) -> object: ...


Receiver = WeightsReceiver | Callable[[str], object]


@dataclass(frozen=True)
class WeightsTarget:
    """A weight version and the directory its weights are written to."""

    version: str
    directory: str

    def __post_init__(self) -> None:
        if not isinstance(self.version, str) or not self.version:
            raise TargetError("version", self.version, "must be a non-empty string")
        if not isinstance(self.directory, str) or not self.directory:
            raise TargetError("directory", self.directory, "must be a non-empty path string")

    @classmethod
    def parse(cls, target: WeightsTarget | Mapping[str, Any]) -> WeightsTarget:
        """``target`` as a :class:`WeightsTarget`; refuses anything else with :class:`TargetError`."""
        if isinstance(target, WeightsTarget):
            return target
        if not isinstance(target, Mapping):
            raise TargetError("target", target, "must be a WeightsTarget or a mapping")
        unknown = set(target) - {"version", "directory"}
        if unknown:
            raise TargetError(sorted(unknown)[0], target[sorted(unknown)[0]], "is not a target field")
        directory = target.get("directory")
        if isinstance(directory, Path):
            directory = str(directory)
        return cls(version=target.get("version"), directory=directory)  # type: ignore[arg-type]


def prepare(model: Policy, target: WeightsTarget) -> str:
    """Write ``model`` as ``target.version`` into ``target.directory``; returns the weights digest."""
    return save_weights(model, target.directory, target.version)


def send(target: WeightsTarget, receivers: Sequence[Receiver]) -> int:
    """Have every receiver load the prepared ``target`` (see the module docs); returns how many did."""
    try:
        _, meta = load_weights(target.directory)
    except WeightsError as exc:
        raise TrainerStateError(f"weights {target.version!r} are not prepared in "
                                f"{target.directory}: {exc}") from None
    if meta["version"] != target.version:
        raise TrainerStateError(f"{target.directory} holds version {meta['version']!r}, "
                                f"not the target's {target.version!r}; prepare it first")
    for index, receiver in enumerate(receivers):
        if isinstance(receiver, WeightsReceiver):
            result = receiver.load_weights(target.directory)
        elif callable(receiver):
            result = receiver(target.directory)
        else:
            raise TargetError(f"receivers[{index}]", receiver,
                              "must have load_weights(path) or be callable")
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited: close it so Python does not warn
            raise TargetError(f"receivers[{index}]", receiver,
                              "returned an awaitable; async receivers are driven by the caller")
    return len(receivers)


__all__ = ["Receiver", "WeightsReceiver", "WeightsTarget", "prepare", "send"]
