"""``ExecutorFuture`` and ``resolve``: waiting on worker calls.

A future settles once, with a value or an exception; the first settlement wins
(a backend reply racing a terminal failure cannot overwrite it). Waiting has no
side effects: a wait that times out raises ``TimeoutError`` saying the worker's
work may still be running, and nothing is cancelled or retried. A worker's own
exception is raised as the same object the worker raised (or, across a process
boundary, an equal copy of it).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["ExecutorFuture", "GroupFuture", "resolve", "wait_timeout_error"]

T = TypeVar("T")


def wait_timeout_error(what: str, timeout: float | None) -> TimeoutError:
    """The error a timed-out wait raises; it never implies the work stopped."""
    return TimeoutError(f"{what}: no result within {timeout}s; the worker work may still be running")


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise TypeError(f"timeout={timeout!r}: must be a number of seconds or None")


class ExecutorFuture(Generic[T]):
    """The pending result of one call (``description`` names it in errors).

    ``result(timeout)`` returns the value or raises the settled exception; a
    timeout raises ``TimeoutError`` and leaves the future pending. Subclasses that
    must poll their transport override :meth:`_poll` (called while waiting, in
    short slices, with the remaining time) instead of relying on a push.
    """

    def __init__(self, description: str) -> None:
        self.description = description
        self._inner: concurrent.futures.Future[T] = concurrent.futures.Future()

    def done(self) -> bool:
        """True once a value or exception is settled (polling the transport once)."""
        if not self._inner.done():
            self._poll(0.0)
        return self._inner.done()

    def result(self, timeout: float | None = None) -> T:
        """The value; raises the settled exception, or ``TimeoutError`` when ``timeout`` passes."""
        _check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        return self._result_by(deadline, timeout)

    def _result_by(self, deadline: float | None, shown_timeout: float | None) -> T:
        while not self._inner.done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._poll(0.0)
                if self._inner.done():
                    break
                raise wait_timeout_error(self.description, shown_timeout)
            self._poll(remaining)
        return self._inner.result(timeout=0)

    def _poll(self, remaining: float | None) -> None:
        """Wait up to ``remaining`` seconds (None: forever) for this future to settle."""
        try:
            self._inner.exception(timeout=remaining)
        except concurrent.futures.TimeoutError:
            pass

    def set_result(self, value: T) -> bool:
        """Settle with ``value``; False when it was already settled."""
        try:
            self._inner.set_result(value)
        except concurrent.futures.InvalidStateError:
            return False
        return True

    def set_exception(self, exc: BaseException) -> bool:
        """Settle with ``exc``; False when it was already settled."""
        try:
            self._inner.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            return False
        return True

    def add_done_callback(self, fn: Callable[[ExecutorFuture[T]], None]) -> None:
        """Call ``fn(self)`` once settled (at once if it already is)."""
        self._inner.add_done_callback(lambda _inner: fn(self))

    def __repr__(self) -> str:
        state = "done" if self._inner.done() else "pending"
        return f"<{type(self).__name__} {self.description} {state}>"


class GroupFuture(ExecutorFuture[list[Any]]):
    """One future over several (a non-blocking ``collective_rpc``): a list in rank order.

    Its result waits on every member under one deadline; the first member, in
    rank order, that raised decides the exception.
    """

    def __init__(self, description: str, members: Sequence[ExecutorFuture[Any]]) -> None:
        super().__init__(description)
        self.members: tuple[ExecutorFuture[Any], ...] = tuple(members)
        for member in self.members:
            member.add_done_callback(self._member_done)
        if not self.members:
            self.set_result([])

    def _member_done(self, _member: ExecutorFuture[Any]) -> None:
        # Settles the group (for callbacks) once every member has; rank order decides the error.
        if not all(member._inner.done() for member in self.members):
            return
        for member in self.members:
            exc = member._inner.exception(timeout=0)
            if exc is not None:
                self.set_exception(exc)
                return
        self.set_result([member._inner.result(timeout=0) for member in self.members])

    def done(self) -> bool:
        return all(member.done() for member in self.members)

    def result(self, timeout: float | None = None) -> list[Any]:
        _check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        return self._result_by(deadline, timeout)

    def _result_by(self, deadline: float | None, shown_timeout: float | None) -> list[Any]:
        return [member._result_by(deadline, shown_timeout) for member in self.members]


def resolve(value: Any, timeout: float | None = None) -> Any:
    """Wait on every future inside ``value`` under one shared deadline.

    ``value`` may be a future, a list or tuple nesting futures (resolved
    recursively, keeping the container types), or a plain value, returned
    unchanged. ``timeout`` bounds the whole walk, not each future: a
    ``TimeoutError`` means some future was still pending at the deadline.
    """
    _check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    return _resolve(value, deadline, timeout)


def _resolve(value: Any, deadline: float | None, shown_timeout: float | None) -> Any:
    if isinstance(value, ExecutorFuture):
        return value._result_by(deadline, shown_timeout)
    if isinstance(value, list):
        return [_resolve(item, deadline, shown_timeout) for item in value]
    if isinstance(value, tuple):
        items = [_resolve(item, deadline, shown_timeout) for item in value]
        # Named tuples rebuild from positional fields; plain tuples from an iterable.
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
