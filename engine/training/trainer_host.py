"""The orchestrator's handle on its trainer: an executor that is built again after it fails.

An executor that failed terminally (its trainer process died, a Ray actor was lost) refuses
every call from then on. :class:`TrainerHost` notices that on the call that fails, shuts the
failed executor down, and builds a fresh one from its factory on the next call. Each build is
a new *generation*: the training controller brings a fresh trainer onto the deployment's latest
verified checkpoint (or has it declare its initial weights) before it trusts anything it says
(engine/controllers/training.py).

Nothing is retried here: the call that met the failure raises it, so a ``train`` that may have
run is never sent twice by this class.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from workers.executor import Executor

log = logging.getLogger("tidelog.training")


class TrainerHost:
    """``rpc`` like an executor's, over the current executor built by ``factory``."""

    def __init__(self, factory: Callable[[], Executor]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._closed = False
        #: How many executors were built; the controller syncs a trainer whose generation it has not seen.
        self.generation = 0

    def _current(self) -> Executor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the trainer host is shut down")
            ex = self._executor
            if ex is not None and ex.failure is not None:
                self._retire(ex, str(ex.failure))
                ex = None
            if ex is None:
                ex = self._factory()
                self._executor = ex
                self.generation += 1
                log.info("trainer executor started (generation %d, backend %s)", self.generation, ex.backend)
            return ex

    def _retire(self, ex: Executor, why: str) -> None:
        log.warning("trainer executor failed (%s); a fresh one is started on the next call", why)
        self._executor = None
        try:
            ex.shutdown()
        except Exception:  # noqa: BLE001 - the failed one is being dropped either way
            log.exception("shutting down the failed trainer executor")

    def rpc(self, rank: int, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
            timeout: float | None = None) -> Any:
        ex = self._current()
        try:
            return ex.rpc(rank, method, args, kwargs, timeout)
        except Exception:
            if ex.failure is not None:
                with self._lock:
                    if self._executor is ex:
                        self._retire(ex, str(ex.failure))
            raise

    def current_generation(self) -> int:
        """The generation the next call runs on (building the executor if there is none)."""
        self._current()
        return self.generation

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown()


__all__ = ["TrainerHost"]
