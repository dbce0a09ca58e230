"""The orchestrator's handle on its trainer: an executor that is built again after it fails.

An executor that failed terminally (its trainer process died, a Ray actor was lost) refuses
every call from then on. :class:`TrainerHost` builds a fresh one from its factory only when
asked, by :meth:`TrainerHost.ensure`: each build is a new *generation*, whose trainer holds its
initial weights. Calls never build one: a call to a failed (or released) trainer raises
:class:`TrainerUnavailable`. So a sequence of calls that decides from the trainer's state and
then acts on it (health, then load, then train) can never silently continue on a fresh
trainer that holds other weights; only the controller's sync points call ``ensure``, and then
bring the new trainer onto the deployment's latest verified checkpoint (or have it declare its
initial weights) before trusting anything it says (engine/workflows/training/controller.py).

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


class TrainerUnavailable(RuntimeError):
    """No live trainer: it failed, was released, or was never started (a sync point starts one)."""


class TrainerHost:
    """``rpc`` like an executor's, over the current executor built by ``factory`` (see the module docs)."""

    def __init__(self, factory: Callable[[], Executor]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._closed = False
        #: How many executors were built.
        self.generation = 0

    def ensure(self) -> bool:
        """Have a live trainer: build one if there is none or it failed. True when a new one was built."""
        with self._lock:
            if self._closed:
                raise TrainerUnavailable("the trainer host is shut down")
            ex = self._executor
            if ex is not None and ex.failure is None:
                return False
            if ex is not None:
                self._retire(ex, str(ex.failure))
            self._executor = self._factory()
            self.generation += 1
            log.info("trainer executor started (generation %d, backend %s)", self.generation,
                     self._executor.backend)
            return True

    def _retire(self, ex: Executor, why: str) -> None:
        log.warning("trainer executor stopped (%s); the next sync point starts a fresh one", why)
        if self._executor is ex:
            self._executor = None
        try:
            ex.shutdown()
        except Exception:  # noqa: BLE001 - the failed one is being dropped either way
            log.exception("shutting down the trainer executor")

    def rpc(self, rank: int, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
            timeout: float | None = None) -> Any:
        with self._lock:
            ex = self._executor
            if self._closed or ex is None or ex.failure is not None:
                why = "shut down" if self._closed else "not started" if ex is None else str(ex.failure)
                raise TrainerUnavailable(f"no live trainer ({why}); {method} was not sent")
        return ex.rpc(rank, method, args, kwargs, timeout)

    def release(self, why: str = "released") -> None:
        """Stop the current trainer; the next sync point starts a new generation.

        For a leader that lost its lease (another orchestrator may now lead and start its own
        trainer over the same step record: this one must not keep training next to it), and for
        a trainer that stopped answering or holds weights no journal state accounts for.
        """
        with self._lock:
            ex = self._executor
            if ex is None:
                return
            self._retire(ex, why)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown()


__all__ = ["TrainerHost", "TrainerUnavailable"]
