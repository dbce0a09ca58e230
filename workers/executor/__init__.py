"""Executors: launch worker ranks and drive them with ordered control RPC.

    from workers.executor import Executor, ExecutorConfig, WorkerSpec, resolve

    executor = Executor.create(ExecutorConfig(workers=(WorkerSpec(Counter, args=(0,)), WorkerSpec(Counter, args=(1,)))))
    try:
        pending = executor.collective_rpc("increment", args=(3,), non_block=True)
        print(resolve(pending, timeout=10))   # results in rank order
    finally:
        executor.shutdown()

Backends: ``uni`` (one worker in the caller's process), ``mp`` (spawned
processes), ``ray`` (Ray actors; Ray is imported only when used), ``http`` (ranks that
are services, ``python -m workers.executor.serve``) and ``auto``
(the default; see :func:`select_backend`). The contract every backend keeps is
described in ``workers.executor._base``; failure semantics in
``workers.executor._failure``.
"""

from workers.executor._base import Executor, SubmittingExecutor
from workers.executor._failure import ExecutorFailedError, ExecutorFailure, FailureListener, FailureState
from workers.executor._future import ExecutorFuture, GroupFuture, resolve
from workers.executor._http import HttpExecutor, ServedWorkerError
from workers.executor._mp import MpExecutor
from workers.executor._mp_child import RemoteWorkerError
from workers.executor._ray import RayExecutor, RayRuntimeLease
from workers.executor._select import create_executor, local_cuda_masks, select_backend
from workers.executor._spec import (
    ExecutorConfig,
    ExecutorConfigError,
    ExecutorLaunchError,
    SpawnPickleError,
    WorkerSpec,
    import_object,
)
from workers.executor._uni import UniExecutor

__all__ = [
    "Executor",
    "ExecutorConfig",
    "ExecutorConfigError",
    "ExecutorFailedError",
    "ExecutorFailure",
    "ExecutorFuture",
    "ExecutorLaunchError",
    "FailureListener",
    "FailureState",
    "GroupFuture",
    "HttpExecutor",
    "MpExecutor",
    "RayExecutor",
    "RayRuntimeLease",
    "RemoteWorkerError",
    "ServedWorkerError",
    "SpawnPickleError",
    "SubmittingExecutor",
    "UniExecutor",
    "WorkerSpec",
    "import_object",
    "create_executor",
    "local_cuda_masks",
    "resolve",
    "select_backend",
]
