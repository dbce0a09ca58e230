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

A trainer that keeps failing is not started again for ever: each build after a failure (the
executor's ``failure`` set: its process died, its actor was lost) is allowed by a
:class:`~engine.runtime.restarts.RestartPolicy` (``training.recovery``: by default at most 3 within
5 minutes, after 1, 2 and 4 s, on the orchestrator's clock). Until its delay has passed ``ensure``
raises :class:`TrainerRestartPending` with the time left (the controller waits it out on the clock,
so the journal sees a slower restart, not a different one); past the policy the host gives up
(:attr:`gave_up` says why, ``/readyz`` answers 503 with it) and every ``ensure`` raises, until the
orchestrator is restarted. A release (a lost lease, a trainer that stopped answering or holds unaccounted steps)
is this orchestrator's decision, not a failure, and is not counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from workers.executor import Executor

from engine.runtime.clock import Clock, SystemClock
from engine.runtime.restarts import RestartPolicy

log = logging.getLogger("tidelog.training")


class TrainerUnavailable(RuntimeError):
    """No live trainer: it failed, was released, or was never started (a sync point starts one)."""


class TrainerRestartPending(TrainerUnavailable):
    """The trainer failed and its restart waits for the policy's delay: ask again in ``delay_s``."""

    def __init__(self, message: str, delay_s: float) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class TrainerHost:
    """``rpc`` like an executor's, over the current executor built by ``factory`` (see the module docs)."""

    def __init__(self, factory: Callable[[], Executor], policy: RestartPolicy | None = None,
                 clock: Clock | None = None) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._closed = False
        #: How many executors were built.
        self.generation = 0
        self._policy = policy
        self._clock: Clock = clock or SystemClock()
        # The failure the next build restarts from (None: nothing failed since the last build), and
        # when the policy lets that build happen (the clock's monotonic time).
        self._failed: str | None = None
        self._due: float | None = None
        #: Why the host stopped starting trainers (past ``training.recovery``), or ``None``.
        self.gave_up: str | None = None

    def ensure(self) -> bool:
        """Have a live trainer: build one if there is none or it failed. True when a new one was built.

        Raises :class:`TrainerRestartPending` while a restart after a failure waits for its delay, and
        :class:`TrainerUnavailable` when the host is shut down or once the restart policy was exceeded."""
        with self._lock:
            if self._closed:
                raise TrainerUnavailable("the trainer host is shut down")
            if self.gave_up is not None:
                raise TrainerUnavailable(self.gave_up)
            ex = self._executor
            if ex is not None and ex.failure is None:
                return False
            if ex is not None:
                self._failed = str(ex.failure)
                self._retire(ex, self._failed)
            if self._failed is not None and self._policy is not None:
                self._wait_for_policy(self._policy, self._failed)
            try:
                self._executor = self._factory()
            except Exception as exc:
                # A replacement that cannot start is a failure too: the next ask is the policy's again.
                self._failed, self._due = f"{type(exc).__name__}: {exc}"[:300], None
                raise
            self._failed, self._due = None, None
            self.generation += 1
            log.info("trainer executor started (generation %d, backend %s)", self.generation,
                     self._executor.backend)
            return True

    def _wait_for_policy(self, policy: RestartPolicy, failed: str) -> None:
        """Return when the policy lets the trainer start again after ``failed``; else raise saying why."""
        now = self._clock.monotonic()
        if self._due is None:
            delay = policy.allow(now)
            if delay is None:
                self.gave_up = (f"the trainer failed ({failed}) and {policy.refusal()}: it is not started "
                                f"again; fix the cause, then restart the orchestrator")[:500]
                log.error("%s", self.gave_up)
                raise TrainerUnavailable(self.gave_up)
            self._due = now + delay
        if now < self._due:
            raise TrainerRestartPending(
                f"the trainer failed ({failed}); restart {len(policy.history)} of at most {policy.max_restarts} "
                f"within {policy.window_s:g} s in {self._due - now:.1f} s"[:500], self._due - now)

    def unready(self) -> str | None:
        """Why the deployment cannot train now (``None``: it can, or no trainer was needed yet): the
        trainer failed and is not started again yet, or the host gave up (``/readyz`` says it)."""
        with self._lock:
            if self._closed:
                return None
            if self.gave_up is not None:
                return self.gave_up
            ex = self._executor
            failed = self._failed if ex is None else None if ex.failure is None else str(ex.failure)
        return None if failed is None else f"the trainer failed ({failed}) and is being started again"[:500]

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


__all__ = ["TrainerHost", "TrainerRestartPending", "TrainerUnavailable"]
