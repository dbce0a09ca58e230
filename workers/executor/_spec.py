"""Configuration values of the executors: ``WorkerSpec``, ``ExecutorConfig`` and their errors.

A ``WorkerSpec`` names a worker class (a class object or an import path
``pkg.mod:Class`` / ``pkg.mod.Class``) with its constructor arguments and
per-worker backend options. The order of ``ExecutorConfig.workers`` is the rank
order. Every field is checked when the value is built, and a bad value raises
:class:`ExecutorConfigError` naming the field, the value and the rule.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "ExecutorConfig",
    "ExecutorConfigError",
    "ExecutorLaunchError",
    "SpawnPickleError",
    "WorkerSpec",
    "import_object",
]


class ExecutorConfigError(ValueError):
    """A configuration value breaks a rule; ``field``, ``value`` and ``rule`` say which."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field}={value!r}: {rule}")
        self.field = field
        self.value = value
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.rule))


class SpawnPickleError(TypeError):
    """A worker spec cannot cross a ``spawn`` boundary (it does not pickle)."""

    def __init__(self, field: str, spec: str, detail: str) -> None:
        super().__init__(f"{field} ({spec}) must be spawn-pickleable: {detail}")
        self.field = field
        self.spec = spec
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.spec, self.detail))


class ExecutorLaunchError(RuntimeError):
    """A worker could not be started; the workers already started were cleaned up.

    ``rank`` is the rank that failed (None when no single rank is to blame); the
    worker's own exception, when there is one, is the ``__cause__``.
    """

    def __init__(self, backend: str, rank: int | None, reason: str) -> None:
        where = "" if rank is None else f" rank {rank}"
        super().__init__(f"{backend} executor{where}: {reason}")
        self.backend = backend
        self.rank = rank
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.backend, self.rank, self.reason))


def import_object(path: str, *, field: str) -> Any:
    """Import ``pkg.mod:Name`` or ``pkg.mod.Name``; errors name ``field``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ExecutorConfigError(field, path, "an import path must look like 'pkg.mod:Name' or 'pkg.mod.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExecutorConfigError(field, path, f"module {module_name!r} cannot be imported ({exc})") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ExecutorConfigError(field, path, f"{module_name!r} has no attribute {attr!r}") from exc
    return target


def _frozen_options(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ExecutorConfigError(field, value, "must be a mapping of option names to values")
    for key in value:
        if not isinstance(key, str) or not key:
            raise ExecutorConfigError(field, value, f"option names must be non-empty strings, got {key!r}")
    return MappingProxyType(dict(value))


def _seconds(value: object, field: str, *, positive: bool) -> float:
    # bool is an int subclass; True seconds is almost certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExecutorConfigError(field, value, "must be a number of seconds")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        rule = "must be a finite number > 0" if positive else "must be a finite number >= 0"
        raise ExecutorConfigError(field, value, rule)
    return seconds


@dataclass(frozen=True, eq=False)
class WorkerSpec:
    """One worker rank: its class, constructor arguments and per-worker options.

    ``worker_cls`` is a class or an import path. ``options`` are backend options
    for this worker only (Ray actor options; for ``mp`` only
    ``cuda_visible_devices``); they override ``ExecutorConfig.options``.
    """

    worker_cls: type | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.worker_cls, str):
            if not self.worker_cls.strip() or (":" not in self.worker_cls and "." not in self.worker_cls):
                raise ExecutorConfigError(
                    "WorkerSpec.worker_cls", self.worker_cls, "an import path must look like 'pkg.mod:Class'"
                )
        elif not isinstance(self.worker_cls, type):
            raise ExecutorConfigError("WorkerSpec.worker_cls", self.worker_cls, "must be a class or an import path")
        if isinstance(self.args, list):
            object.__setattr__(self, "args", tuple(self.args))
        if not isinstance(self.args, tuple):
            raise ExecutorConfigError("WorkerSpec.args", self.args, "must be a tuple of positional arguments")
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise ExecutorConfigError("WorkerSpec.kwargs", self.kwargs, "must be a mapping with string keys")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "options", dict(_frozen_options(self.options, "WorkerSpec.options")))

    @property
    def name(self) -> str:
        """The worker class as ``module:Qualname`` (or the import path as given)."""
        if isinstance(self.worker_cls, str):
            return self.worker_cls
        return f"{self.worker_cls.__module__}:{self.worker_cls.__qualname__}"

    def resolve_class(self) -> type:
        """The worker class, importing it when ``worker_cls`` is a path."""
        if isinstance(self.worker_cls, type):
            return self.worker_cls
        target = import_object(self.worker_cls, field="WorkerSpec.worker_cls")
        if not isinstance(target, type):
            raise ExecutorConfigError("WorkerSpec.worker_cls", self.worker_cls, "must name a class")
        return target

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerSpec):
            return NotImplemented
        return (self.worker_cls, self.args, dict(self.kwargs), dict(self.options)) == (
            other.worker_cls,
            other.args,
            dict(other.kwargs),
            dict(other.options),
        )

    __hash__ = None  # type: ignore[assignment]  # kwargs and options are mutable mappings


@dataclass(frozen=True)
class ExecutorConfig:
    """What ``Executor.create`` builds.

    - ``backend``: ``"auto"`` (default), ``"uni"``, ``"mp"``, ``"ray"``, an import
      path of an ``Executor`` subclass, or the class itself.
    - ``workers``: the ranks, in rank order.
    - ``options``: backend defaults (for Ray, actor options), overridden per
      worker by ``WorkerSpec.options``.
    - ``launch_timeout_s``: one deadline shared by every rank's constructor.
    - ``node_id``: pin every worker to one cluster node (Ray only).
    - ``gpus_per_worker``: declared GPU needs; local backends need whole GPUs
      and hand out disjoint ``CUDA_VISIBLE_DEVICES`` masks, Ray maps it to
      ``num_gpus``.
    - ``shutdown_grace_s``: how long shutdown waits for workers to stop on their
      own (after queued calls) before SIGTERM; ``kill_grace_s``: how long after
      SIGTERM before SIGKILL.
    """

    backend: str | type = "auto"
    workers: tuple[WorkerSpec, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    launch_timeout_s: float = 300.0
    node_id: str | None = None
    gpus_per_worker: float = 0
    shutdown_grace_s: float = 5.0
    kill_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            if not self.backend.strip():
                raise ExecutorConfigError("ExecutorConfig.backend", self.backend, "must not be empty")
        elif not isinstance(self.backend, type):
            raise ExecutorConfigError(
                "ExecutorConfig.backend", self.backend, "must be a backend name, an import path or a class"
            )
        if isinstance(self.workers, list):
            object.__setattr__(self, "workers", tuple(self.workers))
        if not isinstance(self.workers, tuple):
            raise ExecutorConfigError("ExecutorConfig.workers", self.workers, "must be a tuple of WorkerSpec")
        for rank, spec in enumerate(self.workers):
            if not isinstance(spec, WorkerSpec):
                raise ExecutorConfigError(f"ExecutorConfig.workers[{rank}]", spec, "must be a WorkerSpec")
        object.__setattr__(self, "options", dict(_frozen_options(self.options, "ExecutorConfig.options")))
        object.__setattr__(
            self, "launch_timeout_s", _seconds(self.launch_timeout_s, "ExecutorConfig.launch_timeout_s", positive=True)
        )
        object.__setattr__(
            self, "shutdown_grace_s", _seconds(self.shutdown_grace_s, "ExecutorConfig.shutdown_grace_s", positive=False)
        )
        object.__setattr__(
            self, "kill_grace_s", _seconds(self.kill_grace_s, "ExecutorConfig.kill_grace_s", positive=False)
        )
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id):
            raise ExecutorConfigError("ExecutorConfig.node_id", self.node_id, "must be a non-empty string or None")
        gpus = self.gpus_per_worker
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not math.isfinite(gpus) or gpus < 0:
            raise ExecutorConfigError("ExecutorConfig.gpus_per_worker", gpus, "must be a finite number >= 0")

    __hash__ = None  # type: ignore[assignment]  # options is a mutable mapping
