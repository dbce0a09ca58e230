"""``mp``: one spawned process per rank, with ordered RPC over a pipe.

- Every ``WorkerSpec`` is pickled up front; one that does not pickle raises
  ``SpawnPickleError`` (a ``TypeError``: "must be spawn-pickleable") naming it.
- The only option is the per-worker ``cuda_visible_devices`` (or masks derived
  from ``gpus_per_worker``); executor ``options`` and ``node_id`` are refused.
- Each rank has a single-thread pool that sends a request and waits for its
  reply, so a rank runs calls in submission order, one at a time.
- Startup: every constructor must reply before one deadline shared by all
  ranks (``launch_timeout_s``); on failure every started process is stopped.
- A spawned child does not re-import the parent's ``__main__`` (what
  ``multiprocessing`` does by default, so that objects defined there unpickle)
  unless a spec refers to it: the child needs only the worker's own modules, and
  the orchestrator's entry point imports the whole engine, about 1.4 s of CPU
  per rank start.
- A monitor thread waits on all process sentinels (waking every 0.1 s), so a
  rank that dies while idle is detected too: the executor fails with
  "worker exited unexpectedly" and the peers are stopped without grace.
- Shutdown queues a stop request behind the calls already submitted, waits
  ``shutdown_grace_s``, sends SIGTERM, waits ``kill_grace_s``, then SIGKILLs.
  A ``shutdown()`` that finds another one under way (the retirement after a
  failure) returns only once that one has stopped every rank.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from workers.executor._base import SubmittingExecutor
from workers.executor._failure import SHUT_DOWN_MESSAGE
from workers.executor._future import ExecutorFuture
from workers.executor._mp_child import RemoteWorkerError, child_main
from workers.executor._devices import local_cuda_masks
from workers.executor._spec import (
    ExecutorConfig,
    ExecutorConfigError,
    ExecutorLaunchError,
    SpawnPickleError,
    WorkerSpec,
)

__all__ = ["MpExecutor"]

logger = logging.getLogger("tidelog.executor")

MONITOR_INTERVAL_S = 0.1
WORKER_OPTIONS = frozenset({"cuda_visible_devices"})


def _mask(value: object, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(type(v) is int and v >= 0 for v in value):
        return ",".join(str(v) for v in value)
    raise ExecutorConfigError(field, value, "must be a device string like '0,1' or a list of device indexes")


def validate_mp_config(config: ExecutorConfig) -> list[str | None]:
    """Check ``config`` for the mp backend; return each rank's CUDA mask (None: inherit)."""
    if config.options:
        raise ExecutorConfigError(
            "ExecutorConfig.options",
            dict(config.options),
            "the mp backend takes only the per-worker option cuda_visible_devices",
        )
    if config.node_id is not None:
        raise ExecutorConfigError("ExecutorConfig.node_id", config.node_id, "the mp backend cannot place workers")
    masks: list[str | None] = []
    for rank, spec in enumerate(config.workers):
        extra = sorted(set(spec.options) - WORKER_OPTIONS)
        if extra:
            raise ExecutorConfigError(
                f"ExecutorConfig.workers[{rank}].options", dict(spec.options), f"the mp backend does not know {extra}"
            )
        value = spec.options.get("cuda_visible_devices")
        field = f"ExecutorConfig.workers[{rank}].options.cuda_visible_devices"
        masks.append(None if value is None else _mask(value, field))
    if config.gpus_per_worker:
        if any(mask is not None for mask in masks):
            raise ExecutorConfigError(
                "ExecutorConfig.gpus_per_worker",
                config.gpus_per_worker,
                "cannot be combined with a worker's cuda_visible_devices option",
            )
        masks = list(local_cuda_masks(len(config.workers), config.gpus_per_worker))
    return masks


def pickle_specs(specs: Sequence[WorkerSpec]) -> list[bytes]:
    """Pickle every spec now, so a closure or a lock fails here with its rank named, not in a child."""
    payloads = []
    for rank, spec in enumerate(specs):
        try:
            payloads.append(pickle.dumps(spec))
        except Exception as exc:
            raise SpawnPickleError(f"ExecutorConfig.workers[{rank}]", f"WorkerSpec({spec.name})", repr(exc)) from exc
    return payloads


#: Held while ``sys.modules["__main__"]`` is swapped, so two executors starting at once cannot
#: leave the stub in place.
_MAIN_SWAP = threading.Lock()


@contextmanager
def _main_hidden_unless_needed(payloads: Sequence[bytes]) -> Iterator[None]:
    """While a spawn child is launched, hide the parent's ``__main__`` unless a payload refers to it.

    ``multiprocessing`` sends the child the parent's main module (by name or path) and the child
    imports it before anything else. A bare stub with neither ``__spec__`` nor ``__file__`` makes
    it send neither. The swap lasts only for ``Process.start()`` (the preparation data is built
    and written there); a pickle of a ``__main__`` object in another thread at that moment would
    fail, which nothing in the orchestrator does. A payload naming ``__main__`` anywhere (a worker
    class defined in a script) keeps the default, so that class still unpickles.
    """
    if any(b"__main__" in payload for payload in payloads):
        yield
        return
    with _MAIN_SWAP:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


@dataclass
class _Rank:
    process: BaseProcess
    conn: multiprocessing.connection.Connection
    pool: concurrent.futures.ThreadPoolExecutor


class MpExecutor(SubmittingExecutor):
    """Worker ranks in spawned processes (see the module docstring)."""

    backend = "mp"

    def _init_executor(self) -> None:
        masks = validate_mp_config(self.config)
        payloads = pickle_specs(self.config.workers)
        self._ranks: list[_Rank] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._shut = False
        self._stopped = threading.Event()  # set once the shutdown that went first has finished
        self._monitor: threading.Thread | None = None
        context = multiprocessing.get_context("spawn")
        try:
            for rank, (payload, mask) in enumerate(zip(payloads, masks)):
                parent_conn, child_conn = context.Pipe()
                process = context.Process(
                    target=child_main,
                    args=(child_conn, payload, mask),
                    name=f"tidelog-mp-rank{rank}",
                    daemon=True,
                )
                with _main_hidden_unless_needed(payloads):
                    process.start()
                child_conn.close()  # so the parent's reads see EOF when the child dies
                pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidelog-mp-rank{rank}")
                self._ranks.append(_Rank(process, parent_conn, pool))
            self._await_constructors()
        except BaseException:
            self._stop_processes(grace_s=0.0)
            raise
        self._monitor = threading.Thread(target=self._watch, name="tidelog-mp-monitor", daemon=True)
        self._monitor.start()

    def _await_constructors(self) -> None:
        deadline = time.monotonic() + self.config.launch_timeout_s  # one deadline for every rank
        for rank, slot in enumerate(self._ranks):
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait([slot.conn, slot.process.sentinel], timeout=max(0.0, remaining))
            if slot.conn in ready or slot.conn.poll():
                try:
                    ok, value = slot.conn.recv()
                except (EOFError, OSError) as exc:
                    raise ExecutorLaunchError(self.backend, rank, f"exited during construction ({exc!r})") from exc
                if not ok:
                    raise ExecutorLaunchError(
                        self.backend, rank, f"constructor of {self.config.workers[rank].name} raised {value!r}"
                    ) from value
                continue
            if slot.process.sentinel in ready:
                slot.process.join(timeout=1.0)
                raise ExecutorLaunchError(
                    self.backend, rank, f"exited during construction (exitcode {slot.process.exitcode})"
                )
            raise TimeoutError(
                f"mp executor rank {rank}: constructor did not reply within "
                f"launch_timeout_s={self.config.launch_timeout_s} (shared by all ranks)"
            )

    @property
    def num_workers(self) -> int:
        return len(self._ranks)

    @property
    def exitcodes(self) -> tuple[int | None, ...]:
        """Each rank's exit code (None while running; negative: killed by that signal)."""
        return tuple(slot.process.exitcode for slot in self._ranks)

    @property
    def pids(self) -> tuple[int | None, ...]:
        """The process id of each rank, in rank order."""
        return tuple(slot.process.pid for slot in self._ranks)

    def _submit(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> ExecutorFuture[Any]:
        future: ExecutorFuture[Any] = ExecutorFuture(f"mp rank {rank} {method!r}")
        self._track(future)
        slot = self._ranks[rank]

        def call() -> None:
            if self._failure_state.failure is not None:
                return  # the executor failed while this was queued: never send it to a retired group
            try:
                slot.conn.send((method, args, kwargs))
            except (BrokenPipeError, EOFError, ConnectionError, OSError) as exc:
                self._lost(rank, future, exc)
                return
            except Exception as exc:
                future.set_exception(exc)  # the arguments do not pickle; nothing was sent
                return
            try:
                ok, value = slot.conn.recv()
            except (EOFError, OSError) as exc:
                self._lost(rank, future, exc)
                return
            except Exception as exc:
                future.set_exception(RemoteWorkerError(type(exc).__name__, f"reply could not be unpickled: {exc}", ""))
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        try:
            slot.pool.submit(call)
        except RuntimeError:
            future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))
        return future

    def _lost(self, rank: int, future: ExecutorFuture[Any], exc: BaseException) -> None:
        if self._stopping:
            future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))
            return
        self._on_death(rank, f"worker exited unexpectedly ({exc!r})")
        future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))  # only if _on_death did not settle it

    def _watch(self) -> None:
        while not self._stopping:
            sentinels = {slot.process.sentinel: rank for rank, slot in enumerate(self._ranks)}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=MONITOR_INTERVAL_S)
            if ready and not self._stopping:
                rank = sentinels[ready[0]]  # type: ignore[index]
                process = self._ranks[rank].process
                process.join(timeout=1.0)
                self._on_death(rank, f"worker exited unexpectedly (exitcode {process.exitcode})")
                return

    def _on_death(self, rank: int, reason: str) -> None:
        with self._lock:
            if self._stopping:
                return
        if self._fail(reason, rank):
            # Terminal: the peers are retired at once, without the shutdown grace.
            threading.Thread(target=self._shutdown, args=(0.0,), name="tidelog-mp-retire", daemon=True).start()

    def check_health(self, timeout: float | None = None) -> None:
        """Raise if failed or shut down; a dead process found now fails the executor first."""
        self._failure_state.check()
        for rank, slot in enumerate(self._ranks):
            if not slot.process.is_alive():
                self._on_death(rank, f"worker exited unexpectedly (exitcode {slot.process.exitcode})")
        self._failure_state.check()

    def shutdown(self) -> None:
        """Stop every rank after its queued calls: grace, then SIGTERM, then SIGKILL."""
        self._shutdown(self.config.shutdown_grace_s)

    def _shutdown(self, grace_s: float) -> None:
        with self._lock:
            first = not self._shut
            self._shut = True
            self._stopping = True
        if not first:
            # Another shutdown is stopping the ranks (usually the retirement that follows a
            # failure). The caller's shutdown() must not return while they still run, or the
            # owner could reuse their devices or ports; that shutdown is bounded, so wait for it.
            bound = self.config.shutdown_grace_s + 2 * self.config.kill_grace_s + 10.0
            if not self._stopped.wait(bound):
                logger.warning("mp shutdown: ranks still stopping after %ss", bound)
            return
        try:
            self._failure_state.close()
            if self._monitor is not None and self._monitor is not threading.current_thread():
                self._monitor.join(timeout=1.0)  # it wakes every 0.1 s and sees _stopping
            if grace_s > 0:
                for slot in self._ranks:
                    try:
                        slot.pool.submit(self._send_stop, slot)  # behind every call already submitted
                    except RuntimeError:
                        pass
            self._stop_processes(grace_s)
        finally:
            self._stopped.set()

    @staticmethod
    def _send_stop(slot: _Rank) -> None:
        try:
            slot.conn.send(None)
        except (OSError, EOFError):
            pass  # already gone

    def _stop_processes(self, grace_s: float) -> None:
        self._stopping = True
        deadline = time.monotonic() + grace_s
        for slot in self._ranks:
            slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [slot for slot in self._ranks if slot.process.is_alive()]
        for slot in alive:
            slot.process.terminate()
        deadline = time.monotonic() + self.config.kill_grace_s
        for slot in alive:
            slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for slot in alive:
            if slot.process.is_alive():
                logger.warning("mp %s did not stop after SIGTERM; sending SIGKILL", slot.process.name)
                slot.process.kill()
                slot.process.join(timeout=5.0)
        for slot in self._ranks:
            # The children are gone, so a call blocked on a pipe read now sees EOF and ends.
            slot.pool.shutdown(wait=True, cancel_futures=True)
            slot.conn.close()
