"""The child side of the ``mp`` backend: one worker rank in a spawned process.

Protocol over the rank's pipe: after constructing the worker the child sends
``(True, None)`` (or ``(False, error)`` and exits); then it serves requests
``(method, args, kwargs)`` one at a time, replying ``(True, value)`` or
``(False, exception)``, until it receives ``None``. Exceptions that do not
pickle are replaced by :class:`RemoteWorkerError` carrying their text.

Before the worker spec is unpickled (so before the worker's modules import
torch) the child sets ``CUDA_VISIBLE_DEVICES`` when given a mask. SIGTERM
becomes ``SystemExit`` so ``finally`` blocks run, and a watchdog thread
SIGTERMs the child when its parent dies. The worker's optional ``shutdown()``
hook runs on every exit path after construction.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback
from types import FrameType
from typing import Any

__all__ = ["RemoteWorkerError", "child_main"]

logger = logging.getLogger("tidelog.executor")


class RemoteWorkerError(RuntimeError):
    """A worker exception that could not be pickled back: its type name and formatted traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.type_name, str(self).partition(": ")[2], self.remote_traceback))


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _watch_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    multiprocessing.connection.wait([parent.sentinel])
    # The parent is gone: nobody will ever send the stop request.
    os.kill(os.getpid(), signal.SIGTERM)


def _send(conn: multiprocessing.connection.Connection, ok: bool, value: Any) -> None:
    try:
        conn.send((ok, value))  # pickles fully before writing, so a failure leaves the pipe clean
    except Exception as exc:
        if ok:
            error: BaseException = TypeError(f"the worker's return value could not be pickled: {exc!r}")
        else:
            error = value
        text = "".join(traceback.format_exception(error))
        conn.send((False, RemoteWorkerError(type(error).__name__, str(error), text)))


def child_main(conn: multiprocessing.connection.Connection, payload: bytes, cuda_visible_devices: str | None) -> None:
    """Run one rank: construct the worker from ``payload`` (a pickled ``WorkerSpec``) and serve."""
    if cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    signal.signal(signal.SIGTERM, _sigterm)
    threading.Thread(target=_watch_parent, name="tidelog-parent-watchdog", daemon=True).start()
    try:
        spec = pickle.loads(payload)
        worker = spec.resolve_class()(*spec.args, **spec.kwargs)
    except Exception as exc:
        _send(conn, False, exc)
        return
    try:
        _send(conn, True, None)
        _serve(conn, worker)
    finally:
        hook = getattr(worker, "shutdown", None)
        if callable(hook):
            try:
                hook()
            except Exception:
                logger.exception("worker shutdown() hook raised")


def _serve(conn: multiprocessing.connection.Connection, worker: Any) -> None:
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed its end
        if request is None:
            return
        method, args, kwargs = request
        try:
            value = getattr(worker, method)(*args, **kwargs)
        except Exception as exc:
            _send(conn, False, exc)
        else:
            _send(conn, True, value)
