"""``uni``: at most one worker, constructed and called in the caller's process.

Calls run on one single-thread pool per rank, so they execute in submission
order and a caller's timeout leaves the call running. There is no separate
process, hence no death detector: a worker living in the caller's process dies
with it. ``from_workers`` attaches an existing object; shutdown calls the
worker's optional ``shutdown()`` hook only when the executor owns it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any

from workers.executor._base import SubmittingExecutor
from workers.executor._failure import SHUT_DOWN_MESSAGE
from workers.executor._future import ExecutorFuture
from workers.executor._devices import local_cuda_masks
from workers.executor._spec import ExecutorConfig, ExecutorConfigError, ExecutorLaunchError

__all__ = ["UniExecutor"]

logger = logging.getLogger("tidelog.executor")


def validate_uni_config(config: ExecutorConfig) -> None:
    """Raise ``ExecutorConfigError`` unless ``config`` is one a ``uni`` executor can run."""
    if len(config.workers) > 1:
        raise ExecutorConfigError(
            "ExecutorConfig.workers", f"{len(config.workers)} workers", "the uni backend takes at most one worker"
        )
    if config.options:
        raise ExecutorConfigError("ExecutorConfig.options", dict(config.options), "the uni backend takes no options")
    if config.node_id is not None:
        raise ExecutorConfigError("ExecutorConfig.node_id", config.node_id, "the uni backend cannot place workers")
    if config.gpus_per_worker:
        local_cuda_masks(len(config.workers), config.gpus_per_worker)  # uni keeps the caller's visibility
    for rank, spec in enumerate(config.workers):
        if spec.options:
            raise ExecutorConfigError(
                f"ExecutorConfig.workers[{rank}].options", dict(spec.options), "the uni backend takes no worker options"
            )


class UniExecutor(SubmittingExecutor):
    """One in-process worker with ordered calls (see the module docstring)."""

    backend = "uni"

    def _init_executor(self) -> None:
        validate_uni_config(self.config)
        workers: list[Any] = []
        for rank, spec in enumerate(self.config.workers):
            cls = spec.resolve_class()
            try:
                workers.append(cls(*spec.args, **spec.kwargs))
            except Exception as exc:
                raise ExecutorLaunchError(self.backend, rank, f"constructor of {spec.name} raised {exc!r}") from exc
        self._attach(workers, owned=True)

    @classmethod
    def from_workers(cls, workers: Sequence[Any], *, owned: bool = False) -> UniExecutor:
        """An executor over existing worker objects (at most one); borrowed unless ``owned``."""
        if len(workers) > 1:
            raise ExecutorConfigError("workers", f"{len(workers)} workers", "the uni backend takes at most one worker")
        self = cls.__new__(cls)
        self._setup(ExecutorConfig(backend="uni"))
        self._attach(list(workers), owned=owned)
        return self

    def _attach(self, workers: list[Any], *, owned: bool) -> None:
        self._workers = workers
        self._owned = owned
        self._pools = [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidelog-uni-rank{rank}")
            for rank in range(len(workers))
        ]
        self._shut = False

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> tuple[Any, ...]:
        """The worker objects, in rank order."""
        return tuple(self._workers)

    def _submit(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> ExecutorFuture[Any]:
        future: ExecutorFuture[Any] = ExecutorFuture(f"uni rank {rank} {method!r}")
        self._track(future)
        worker = self._workers[rank]

        def call() -> None:
            try:
                value = getattr(worker, method)(*args, **kwargs)
            except BaseException as exc:  # the worker's exception goes to the caller as raised
                future.set_exception(exc)
            else:
                future.set_result(value)

        try:
            self._pools[rank].submit(call)
        except RuntimeError:
            # The pool refuses work once shutdown began; report the shutdown, not the pool.
            future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))
        return future

    def shutdown(self) -> None:
        """Close; owned workers get their ``shutdown()`` hook after queued calls (bounded by the grace)."""
        if self._shut:
            return
        self._shut = True
        self._failure_state.close()
        deadline = time.monotonic() + self.config.shutdown_grace_s
        for rank, (pool, worker) in enumerate(zip(self._pools, self._workers)):
            hook = getattr(worker, "shutdown", None)
            if self._owned and callable(hook):
                done = pool.submit(hook)
                try:
                    done.result(timeout=max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    logger.warning("uni rank %d: shutdown() hook still running after the grace period", rank)
                except Exception:
                    logger.exception("uni rank %d: shutdown() hook raised", rank)
            pool.shutdown(wait=False)
