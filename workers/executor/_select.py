"""Backend selection: ``Executor.create`` and the ``auto`` rules.

An explicit backend wins: ``"uni"``, ``"mp"``, ``"ray"``, ``"http"`` (ranks served by
``python -m workers.executor.serve``; never chosen by ``auto``), an import path of an
``Executor`` subclass, or the class. ``"auto"`` decides, in this order:

1. fractional ``gpus_per_worker`` -> error (only Ray reserves GPU fractions;
   select ``ray`` explicitly);
2. executor ``options``, a ``node_id``, or worker options other than
   ``cuda_visible_devices`` -> ``ray`` (they are cluster or actor requirements);
3. no workers -> error;
4. more than one worker inside a Ray placement group -> ``ray``; Ray is only
   inspected through ``sys.modules``: it is never imported or started to decide;
5. a worker's ``cuda_visible_devices`` -> ``mp`` (masks need their own process);
6. exactly one worker -> ``uni``, otherwise ``mp``.

Declared whole GPUs (``gpus_per_worker``) for ``uni``/``mp`` are checked
against local CUDA (through torch, imported only then); too few is an error,
never a silent switch to Ray. Installed GPUs or a set ``RAY_ADDRESS`` alone do
not select Ray. Every decision is logged on ``tidelog.executor`` with the
backend and the reason.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from workers.executor import _base
from workers.executor._base import Executor
from workers.executor._devices import local_cuda_masks
from workers.executor._spec import ExecutorConfig, ExecutorConfigError, import_object

__all__ = ["BUILTIN_BACKENDS", "create_executor", "local_cuda_masks", "select_backend"]

logger = logging.getLogger("tidelog.executor")

BUILTIN_BACKENDS = ("uni", "mp", "ray", "http")


def _builtin(name: str) -> type[Executor]:
    if name == "uni":
        from workers.executor._uni import UniExecutor

        return UniExecutor
    if name == "mp":
        from workers.executor._mp import MpExecutor

        return MpExecutor
    if name == "http":
        from workers.executor._http import HttpExecutor

        return HttpExecutor
    from workers.executor._ray import RayExecutor

    return RayExecutor


def _in_ray_placement_group() -> bool:
    ray: Any = sys.modules.get("ray")
    util: Any = sys.modules.get("ray.util")
    if ray is None or util is None:
        return False  # Ray was never imported here, so there is no Ray context to join
    try:
        return bool(ray.is_initialized()) and util.get_current_placement_group() is not None
    except Exception:
        return False


def _auto(config: ExecutorConfig) -> tuple[str, str]:
    gpus = config.gpus_per_worker
    if gpus and gpus != int(gpus):
        raise ExecutorConfigError(
            "ExecutorConfig.gpus_per_worker", gpus, "auto places whole GPUs only; select backend 'ray' for fractions"
        )
    if config.options:
        return "ray", f"executor options {sorted(config.options)} are Ray actor options"
    if config.node_id is not None:
        return "ray", f"node_id={config.node_id!r} is a cluster placement requirement"
    for rank, spec in enumerate(config.workers):
        extra = sorted(set(spec.options) - {"cuda_visible_devices"})
        if extra:
            return "ray", f"worker {rank} options {extra} are Ray actor options"
    count = len(config.workers)
    if count == 0:
        raise ExecutorConfigError("ExecutorConfig.workers", (), "auto needs at least one WorkerSpec")
    if count > 1 and _in_ray_placement_group():
        return "ray", f"{count} workers inside an existing Ray placement group"
    if any("cuda_visible_devices" in spec.options for spec in config.workers):
        return "mp", "per-worker cuda_visible_devices masks need separate processes"
    if count == 1:
        return "uni", "exactly one local worker"
    return "mp", f"{count} local workers"


def select_backend(config: ExecutorConfig) -> tuple[type[Executor], str]:
    """The executor class ``config`` selects and the reason (for the log)."""
    backend = config.backend
    if isinstance(backend, type):
        if not issubclass(backend, Executor):
            raise ExecutorConfigError("ExecutorConfig.backend", backend, "a class must be an Executor subclass")
        return backend, "explicit class"
    if backend == "auto":
        name, reason = _auto(config)
        if config.gpus_per_worker and name in ("uni", "mp"):
            local_cuda_masks(len(config.workers), config.gpus_per_worker)  # too few GPUs is an error here
        return _builtin(name), f"auto: {reason}"
    if backend in BUILTIN_BACKENDS:
        return _builtin(backend), "explicit"
    if backend == "local":
        # The old thread-pool backend was removed, not aliased.
        raise ExecutorConfigError("ExecutorConfig.backend", backend, "removed; use 'auto' or 'uni' with one worker")
    if ":" not in backend and "." not in backend:
        raise ExecutorConfigError(
            "ExecutorConfig.backend", backend, "must be 'auto', 'uni', 'mp', 'ray' or an import path 'pkg.mod:Class'"
        )
    target = import_object(backend, field="ExecutorConfig.backend")
    if not isinstance(target, type) or not issubclass(target, Executor):
        raise ExecutorConfigError("ExecutorConfig.backend", backend, "must name an Executor subclass")
    return target, "explicit import path"


def create_executor(config: ExecutorConfig) -> Executor:
    """Select the backend for ``config``, log the choice, and build the executor."""
    cls, reason = select_backend(config)
    logger.info("executor backend %s selected (%s) for %d worker(s)", cls.backend, reason, len(config.workers))
    return cls(config)


# Executor.create builds through this module; installed here so _base never imports it back.
_base.install_factory(create_executor)
