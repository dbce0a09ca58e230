"""A custom executor defined only in the tests, selected by ``training.executor.backend`` as an import
path (the seed's custom-executor contract): an ``Executor`` built on ``SubmittingExecutor`` whose ranks
are objects in the caller's process, one thread each, calls in submission order. Its launch options
are its own (``label``); every launch is recorded in :data:`LAUNCHES` for the tests to read."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from workers.executor import ExecutorConfigError, ExecutorFuture, ExecutorLaunchError, SubmittingExecutor

#: (label, ranks) of every executor launched in this process.
LAUNCHES: list[tuple[str, int]] = []


class ThreadRanksExecutor(SubmittingExecutor):
    backend = "thread-ranks"

    def _init_executor(self) -> None:
        unknown = set(self.config.options) - {"label"}
        if unknown:
            raise ExecutorConfigError("ExecutorConfig.options", dict(self.config.options),
                                      f"thread-ranks knows only 'label', not {sorted(unknown)}")
        self._workers: list[Any] = []
        for rank, spec in enumerate(self.config.workers):
            try:
                self._workers.append(spec.resolve_class()(*spec.args, **spec.kwargs))
            except Exception as exc:
                raise ExecutorLaunchError(self.backend, rank, f"constructor raised {exc!r}") from exc
        self._pools = [concurrent.futures.ThreadPoolExecutor(max_workers=1) for _ in self._workers]
        LAUNCHES.append((str(self.config.options.get("label", "")), len(self._workers)))

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                timeout: float | None) -> ExecutorFuture[Any]:
        future: ExecutorFuture[Any] = ExecutorFuture(f"thread-ranks rank {rank} {method!r}")
        self._track(future)

        def call() -> None:
            try:
                future.set_result(getattr(self._workers[rank], method)(*args, **kwargs))
            except BaseException as exc:  # the worker's own exception, as raised
                future.set_exception(exc)

        self._pools[rank].submit(call)
        return future

    def shutdown(self) -> None:
        self._failure_state.close()
        for pool in self._pools:
            pool.shutdown(wait=False)
