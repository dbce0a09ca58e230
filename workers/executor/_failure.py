"""Terminal executor failure: ``ExecutorFailure``, ``ExecutorFailedError`` and ``FailureState``.

An executor fails terminally when its infrastructure breaks (a worker process
or actor died). The first ``fail()`` wins; later ones, and any after
``close()``, are ignored. On failure every pending tracked future fails with
``ExecutorFailedError``, new submissions raise it, and each registered listener's
``on_executor_failure(failure)`` runs exactly once, including listeners
registered after the failure. Listener exceptions are logged, never raised.

Not terminal: a normal shutdown (``close()`` fails pending futures with
``RuntimeError("executor is shut down")``), a worker method raising, or a wait
timing out.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from workers.executor._future import ExecutorFuture

__all__ = ["ExecutorFailedError", "ExecutorFailure", "FailureListener", "FailureState", "SHUT_DOWN_MESSAGE"]

logger = logging.getLogger("tidelog.executor")

SHUT_DOWN_MESSAGE = "executor is shut down"


@dataclass(frozen=True)
class ExecutorFailure:
    """Why an executor failed: the backend, a reason, and the rank to blame (None: no one rank)."""

    backend: str
    reason: str
    rank: int | None = None

    def __str__(self) -> str:
        where = "" if self.rank is None else f" (rank {self.rank})"
        return f"{self.backend} executor failed{where}: {self.reason}"


class ExecutorFailedError(RuntimeError):
    """Raised by waits and submissions on a failed executor; ``failure`` says why."""

    def __init__(self, failure: ExecutorFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failure,))


@runtime_checkable
class FailureListener(Protocol):
    """Observes terminal failure. Must not block and must not call ``shutdown``."""

    def on_executor_failure(self, failure: ExecutorFailure) -> None: ...


class FailureState:
    """The failure and shutdown state one executor shares with its futures and monitors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: ExecutorFailure | None = None
        self._closed = False
        self._pending: set[ExecutorFuture[Any]] = set()
        self._listeners: list[FailureListener] = []

    @property
    def failure(self) -> ExecutorFailure | None:
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """Raise what a new submission must raise: ``ExecutorFailedError`` or the shut-down error."""
        failure, closed = self._failure, self._closed
        if failure is not None:
            raise ExecutorFailedError(failure)
        if closed:
            raise RuntimeError(SHUT_DOWN_MESSAGE)

    def track(self, future: ExecutorFuture[Any]) -> None:
        """Fail ``future`` with the executor if it is still pending then; raise if it already failed or closed."""
        with self._lock:
            self.check()
            self._pending.add(future)
        future.add_done_callback(self._settled)

    def _settled(self, future: ExecutorFuture[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def fail(self, failure: ExecutorFailure) -> bool:
        """Record ``failure`` if it is the first and the executor is open; True when it was recorded."""
        with self._lock:
            if self._failure is not None or self._closed:
                return False
            self._failure = failure
            pending, self._pending = self._pending, set()
            listeners, self._listeners = self._listeners, []
        for future in pending:
            future.set_exception(ExecutorFailedError(failure))
        for listener in listeners:
            self._notify(listener, failure)
        return True

    def close(self) -> None:
        """Mark shut down: pending futures fail with ``RuntimeError("executor is shut down")``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, set()
            self._listeners = []
        for future in pending:
            future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))

    def add_listener(self, listener: FailureListener) -> None:
        """Register ``listener``; called at once (here) when the executor already failed."""
        if not callable(getattr(listener, "on_executor_failure", None)):
            raise TypeError(f"listener={listener!r}: must have an on_executor_failure(failure) method")
        with self._lock:
            failure = self._failure
            if failure is None:
                if self._closed:
                    return  # a shut-down executor can no longer fail
                if not any(existing is listener for existing in self._listeners):
                    self._listeners.append(listener)
                return
        self._notify(listener, failure)

    @staticmethod
    def _notify(listener: FailureListener, failure: ExecutorFailure) -> None:
        try:
            listener.on_executor_failure(failure)
        except Exception:
            # An observer's bug must not hide the worker failure it was told about.
            logger.exception("executor failure listener %r raised", listener)

    def __getstate__(self) -> dict[str, Any]:
        # Listeners and pending futures belong to the observing process only.
        return {"failure": self._failure, "closed": self._closed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._failure = state["failure"]
        self._closed = state["closed"]
