"""The abstract ``Executor`` and ``SubmittingExecutor``.

An executor owns a group of worker ranks: their launch, ordered control RPC,
health and shutdown. Callers use the same methods whatever the backend:

- ``collective_rpc(method, args, kwargs, timeout, non_block)`` dispatches to
  every rank before waiting on any and returns the results in rank order; with
  ``non_block=True`` it returns one future whose result is that list.
- ``rpc(rank, method, ...)`` addresses one rank; a rank outside the group raises
  ``IndexError``.
- A ``timeout`` bounds the wait only: it raises ``TimeoutError`` and the call
  keeps running on the worker. Nothing is cancelled and nothing is retried.
- Terminal failure (``ExecutorFailure``) fails every pending wait with
  ``ExecutorFailedError``, rejects new calls, and calls each listener once.
- ``shutdown()`` stops owned workers and only closes the executor over borrowed
  ones; afterwards calls raise ``RuntimeError("executor is shut down")``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from workers.executor._failure import ExecutorFailure, FailureListener, FailureState
from workers.executor._future import ExecutorFuture, GroupFuture
from workers.executor._spec import ExecutorConfig

__all__ = ["Executor", "SubmittingExecutor"]

logger = logging.getLogger("tidelog.executor")


def _check_method(method: object) -> str:
    if not isinstance(method, str) or not method:
        raise TypeError(f"method={method!r}: must be a non-empty method name")
    return method


def _check_args(args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(f"args={args!r}: must be a tuple of positional arguments")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError(f"kwargs={kwargs!r}: must be a dict with string keys or None")
    return args, kwargs


#: Builds the executor a config selects (``workers.executor._select.create_executor``, installed
#: when the package is imported, so that this module never imports the selection back).
_factory: Callable[[ExecutorConfig], Executor] | None = None


def install_factory(factory: Callable[[ExecutorConfig], Executor]) -> None:
    """Make ``factory`` what :meth:`Executor.create` builds with."""
    global _factory
    _factory = factory


class Executor(abc.ABC):
    """A group of worker ranks driven by ordered control RPC (see the module docstring).

    Subclasses implement ``_init_executor`` (launch; clean up whatever was
    acquired if it fails), ``collective_rpc``, ``rpc``, ``check_health`` and
    ``shutdown``, and report terminal failure through :meth:`_fail`.
    """

    #: The backend name used in failures and logs.
    backend: ClassVar[str] = "custom"

    def __init__(self, config: ExecutorConfig) -> None:
        self._setup(config)
        self._init_executor()

    def _setup(self, config: ExecutorConfig) -> None:
        """State every executor has, also for executors built without launching (``from_workers``)."""
        if not isinstance(config, ExecutorConfig):
            raise TypeError(f"config={config!r}: must be an ExecutorConfig")
        self.config = config
        self._failure_state = FailureState()

    @classmethod
    def create(cls, config: ExecutorConfig) -> Executor:
        """Build the executor ``config.backend`` selects (``auto`` decides and logs why)."""
        if _factory is None:  # pragma: no cover - the package's __init__ imports _select, which installs it
            raise RuntimeError("workers.executor._select was not imported: no executor factory installed")
        return _factory(config)

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Launch the workers of ``self.config``; on failure release everything acquired, then raise."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> Any:
        """Call ``method`` on every rank; a list in rank order (or one future of it)."""

    @abc.abstractmethod
    def rpc(
        self,
        rank: int,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> Any:
        """Call ``method`` on one rank; its value (or a future of it)."""

    @abc.abstractmethod
    def check_health(self, timeout: float | None = None) -> None:
        """Return if the workers are alive; raise ``ExecutorFailedError`` if the executor failed."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop owned workers (borrowed ones are left alone) and close; idempotent."""

    def reinitialize_distributed(self, *args: Any, **kwargs: Any) -> Any:
        """Optional capability: rebuild the workers' distributed group. Not supported by default."""
        raise NotImplementedError(f"{type(self).__name__} does not support reinitialize_distributed")

    @property
    def failure(self) -> ExecutorFailure | None:
        """The terminal failure, or None while the executor has not failed."""
        return self._failure_state.failure

    @property
    def closed(self) -> bool:
        """True after ``shutdown``."""
        return self._failure_state.closed

    def register_failure_listener(self, listener: FailureListener) -> None:
        """Call ``listener.on_executor_failure(failure)`` once on terminal failure (now if already failed)."""
        self._failure_state.add_listener(listener)

    def _fail(self, reason: str, rank: int | None = None) -> bool:
        """Report terminal failure; True if this call was the first. Does not stop workers itself."""
        failure = ExecutorFailure(self.backend, reason, rank)
        recorded = self._failure_state.fail(failure)
        if recorded:
            logger.error("%s", failure)
        return recorded

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class SubmittingExecutor(Executor):
    """An executor over a transport that submits one call and returns a future.

    Subclasses implement ``num_workers``, ``_submit`` and, when a group can be
    sent more efficiently than rank by rank, ``_submit_all``. Every future they
    return must be tracked (:meth:`_track`) so terminal failure and shutdown
    settle it.
    """

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """The number of ranks."""

    @abc.abstractmethod
    def _submit(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> ExecutorFuture[Any]:
        """Send one call to ``rank`` without waiting for it."""

    def _submit_all(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> list[ExecutorFuture[Any]]:
        """Send one call to every rank, in rank order, without waiting for any."""
        return [self._submit(rank, method, args, kwargs, timeout) for rank in range(self.num_workers)]

    def _track(self, future: ExecutorFuture[Any]) -> ExecutorFuture[Any]:
        self._failure_state.track(future)
        return future

    def _check_rank(self, rank: object) -> int:
        # bool is an int subclass, and rpc(True, ...) is a bug, not rank 1.
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank={rank!r}: must be an int")
        if not 0 <= rank < self.num_workers:
            raise IndexError(f"rank={rank}: out of range for {self.num_workers} worker(s)")
        return rank

    def rpc(
        self,
        rank: int,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> Any:
        rank = self._check_rank(rank)
        method = _check_method(method)
        call_args, call_kwargs = _check_args(args, kwargs)
        self._failure_state.check()
        future = self._submit(rank, method, call_args, call_kwargs, timeout)
        return future if non_block else future.result(timeout)

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> Any:
        method = _check_method(method)
        call_args, call_kwargs = _check_args(args, kwargs)
        self._failure_state.check()
        members = self._submit_all(method, call_args, call_kwargs, timeout)
        group = GroupFuture(f"{self.backend} collective_rpc {method!r}", members)
        return group if non_block else group.result(timeout)

    def check_health(self, timeout: float | None = None) -> None:
        self._failure_state.check()
