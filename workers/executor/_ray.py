"""``ray``: one Ray actor per rank, ordered calls, no restarts and no retries.

Ray is imported lazily, only when this backend is used.

- Actor options: ``{"max_restarts": 0, "max_task_retries": 0, **config.options,
  **spec.options}``; a non-zero ``max_restarts`` or ``max_task_retries`` is
  refused (a restarted actor has lost its state, and a retried call could apply
  a mutation twice). ``node_id`` becomes a hard node-affinity strategy and
  conflicts with a user ``scheduling_strategy``; ``gpus_per_worker`` becomes
  ``num_gpus`` unless the options set it.
- Launch: a process-wide Ray runtime lease, one actor per spec, then a
  readiness probe of every actor under ``launch_timeout_s``; on failure every
  actor created so far is killed and the lease released.
- A monitor (owned groups, or once a failure listener registers) keeps one
  readiness probe outstanding per actor; only a probe that completes with an
  error counts, so a probe queued behind a busy actor is not a failure.
- Waits wake every 0.1 s; a ``RayActorError`` fails the executor (and an owned
  group's peers are killed at once; the runtime lease is kept until the owner's
  ``shutdown()``, which waits for that retirement). A worker's own exception is
  raised unwrapped.
- ``from_workers(handles, owned=False)`` borrows existing actors: shutdown then
  only closes the executor. Owned shutdown calls each actor's ``shutdown()``
  hook (queued behind submitted calls, bounded by ``shutdown_grace_s``), then
  ``ray.kill``.
- Pickling keeps the actors and the failure state; the copy borrows (no
  threads, no lease, never kills the actors).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from workers.executor._base import SubmittingExecutor
from workers.executor._failure import SHUT_DOWN_MESSAGE, FailureListener
from workers.executor._future import ExecutorFuture
from workers.executor._spec import ExecutorConfig, ExecutorConfigError, ExecutorLaunchError

__all__ = ["RayExecutor", "RayRuntimeLease", "ray_actor_options"]

logger = logging.getLogger("tidelog.executor")

WAIT_SLICE_S = 0.1
MONITOR_INTERVAL_S = 0.2
READY_METHOD = "__ray_ready__"


def _ray() -> Any:
    return importlib.import_module("ray")


def _ray_exceptions() -> Any:
    return importlib.import_module("ray.exceptions")


class RayRuntimeLease:
    """A reference-counted, process-wide claim on the Ray runtime.

    The first lease initializes Ray (``RAY_ADDRESS`` or a local cluster; a
    connection error is raised, never replaced by a local cluster) unless Ray is
    already initialized, in which case the runtime is borrowed. The last release
    shuts Ray down only if a lease initialized it.
    """

    _lock = threading.Lock()
    _users = 0
    _did_init = False

    def __init__(self) -> None:
        ray = _ray()
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                if ray.is_initialized():
                    cls._did_init = False
                else:
                    ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
                    cls._did_init = True
            cls._users += 1
        self._held = True

    def release(self) -> None:
        """Give the claim back (idempotent); the last one out shuts down what a lease started."""
        if not self._held:
            return
        self._held = False
        cls = type(self)
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._did_init:
                cls._did_init = False
                _ray().shutdown()


def ray_actor_options(config: ExecutorConfig) -> list[dict[str, Any]]:
    """Each rank's actor options, checked (no Ray import: scheduling objects are added at launch)."""
    merged = []
    for rank, spec in enumerate(config.workers):
        options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0, **config.options, **spec.options}
        for key in ("max_restarts", "max_task_retries"):
            if options[key] != 0:
                raise ExecutorConfigError(
                    f"ExecutorConfig.workers[{rank}] option {key}",
                    options[key],
                    "must be 0: the executor never restarts a worker or retries a call",
                )
        if "cuda_visible_devices" in options:
            raise ExecutorConfigError(
                f"ExecutorConfig.workers[{rank}] option cuda_visible_devices",
                options["cuda_visible_devices"],
                "Ray owns CUDA visibility; request num_gpus instead",
            )
        if config.node_id is not None and "scheduling_strategy" in options:
            raise ExecutorConfigError(
                "ExecutorConfig.node_id", config.node_id, f"conflicts with worker {rank}'s scheduling_strategy option"
            )
        if config.gpus_per_worker and "num_gpus" not in options:
            options["num_gpus"] = config.gpus_per_worker
        merged.append(options)
    return merged


class _RayFuture(ExecutorFuture[Any]):
    """A future over one Ray object reference, polled in short slices."""

    def __init__(self, description: str, ref: Any, rank: int, owner: RayExecutor) -> None:
        super().__init__(description)
        self._ref = ref
        self._rank = rank
        self._owner = owner

    def _poll(self, remaining: float | None) -> None:
        if self._inner.done():
            return
        slice_s = WAIT_SLICE_S if remaining is None else max(0.0, min(WAIT_SLICE_S, remaining))
        ready, _ = _ray().wait([self._ref], timeout=slice_s)
        if ready:
            self._settle()

    def _settle(self) -> None:
        errors = _ray_exceptions()
        try:
            value = _ray().get(self._ref)
        except errors.RayActorError as exc:
            self._owner._actor_lost(self._rank, exc)
            self.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))  # only if the failure did not settle it
        except errors.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            self.set_exception(cause if isinstance(cause, BaseException) else exc)
        except Exception as exc:
            self.set_exception(exc)
        else:
            self.set_result(value)


class RayExecutor(SubmittingExecutor):
    """Worker ranks as Ray actors (see the module docstring)."""

    backend = "ray"

    def _init_executor(self) -> None:
        options = ray_actor_options(self.config)  # bad options fail before Ray starts
        self._prepare(actors=[], owned=True)
        lease = self._lease = RayRuntimeLease()
        try:
            ray = _ray()
            for spec, actor_options in zip(self.config.workers, options):
                if self.config.node_id is not None:
                    strategies = importlib.import_module("ray.util.scheduling_strategies")
                    actor_options["scheduling_strategy"] = strategies.NodeAffinitySchedulingStrategy(
                        node_id=self.config.node_id, soft=False
                    )
                remote_cls = ray.remote(spec.resolve_class()).options(**actor_options)
                self._actors.append(remote_cls.remote(*spec.args, **spec.kwargs))
            self._await_ready()
        except BaseException:
            self._kill_actors()
            lease.release()
            self._lease = None
            raise
        self._ensure_monitor()

    @classmethod
    def from_workers(cls, handles: Sequence[Any], *, owned: bool = False) -> RayExecutor:
        """An executor over existing actor handles, in rank order; borrowed unless ``owned``."""
        self = cls.__new__(cls)
        self._setup(ExecutorConfig(backend="ray"))
        self._prepare(actors=list(handles), owned=owned)
        self._lease = RayRuntimeLease()  # borrows the runtime those handles live in
        if owned:
            self._ensure_monitor()
        return self

    _lease: RayRuntimeLease | None

    def _prepare(self, *, actors: list[Any], owned: bool) -> None:
        self._actors: list[Any] = actors
        self._owned = owned
        self._lease = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._shut = False
        self._stopped = threading.Event()  # set once the shutdown that went first has finished

    def _await_ready(self) -> None:
        ray, errors = _ray(), _ray_exceptions()
        deadline = time.monotonic() + self.config.launch_timeout_s  # one deadline for every rank
        probes = [getattr(actor, READY_METHOD).remote() for actor in self._actors]
        for rank, probe in enumerate(probes):
            ready, _ = ray.wait([probe], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(
                    f"ray executor rank {rank}: actor not ready within "
                    f"launch_timeout_s={self.config.launch_timeout_s} (shared by all ranks)"
                )
            try:
                ray.get(probe)
            except errors.RayActorError as exc:
                raise ExecutorLaunchError(
                    self.backend, rank, f"actor of {self.config.workers[rank].name} died during construction: {exc}"
                ) from exc

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> tuple[Any, ...]:
        """The actor handles, in rank order."""
        return tuple(self._actors)

    def _submit(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> ExecutorFuture[Any]:
        future = _RayFuture(f"ray rank {rank} {method!r}", None, rank, self)
        self._track(future)
        try:
            future._ref = getattr(self._actors[rank], method).remote(*args, **kwargs)
        except Exception as exc:
            future.set_exception(exc)  # an unknown method or arguments Ray cannot serialize
        return future

    def _actor_lost(self, rank: int, exc: BaseException) -> None:
        if self._stop.is_set():
            return  # our own shutdown killed it
        if self._fail(f"actor died: {exc}", rank) and self._owned:
            # Terminal: the owned peers are retired at once. The runtime lease stays with the
            # owner's shutdown(): releasing it here could shut Ray down under the owner's threads.
            threading.Thread(
                target=self._shutdown, args=(0.0,), kwargs={"release_lease": False}, name="tidelog-ray-retire", daemon=True
            ).start()

    def register_failure_listener(self, listener: FailureListener) -> None:
        """As for every executor; on a borrowed group this also starts process-local monitoring."""
        super().register_failure_listener(listener)
        self._ensure_monitor()

    def _ensure_monitor(self) -> None:
        with self._lock:
            if self._monitor is not None or self._shut or self.failure is not None:
                return
            self._monitor = threading.Thread(target=self._watch, name="tidelog-ray-monitor", daemon=True)
            self._monitor.start()

    def _watch(self) -> None:
        ray, errors = _ray(), _ray_exceptions()
        probes: dict[int, Any] = {}
        while not self._stop.is_set():
            for rank, actor in enumerate(self._actors):
                if rank not in probes:
                    probes[rank] = getattr(actor, READY_METHOD).remote()
            if self._stop.wait(MONITOR_INTERVAL_S):
                return
            refs = list(probes.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(ready)
            for rank, probe in list(probes.items()):
                if probe not in done:
                    continue  # queued behind a busy actor: not a failure
                del probes[rank]
                try:
                    ray.get(probe)
                except (errors.RayActorError, errors.RayTaskError) as exc:
                    self._actor_lost(rank, exc)
                    return

    def check_health(self, timeout: float | None = None) -> None:
        """Probe every actor; raise ``ExecutorFailedError`` if one is dead, ``TimeoutError`` if a probe is late."""
        self._failure_state.check()
        probes = [
            _RayFuture(f"ray rank {rank} health", getattr(actor, READY_METHOD).remote(), rank, self)
            for rank, actor in enumerate(self._actors)
        ]
        deadline = None if timeout is None else time.monotonic() + timeout
        for probe in probes:
            self._track(probe)
        for probe in probes:  # one deadline for all probes; a late probe is a TimeoutError, not a failure
            probe._result_by(deadline, timeout)

    def shutdown(self) -> None:
        """Owned: run ``shutdown()`` hooks (bounded), then kill the actors. Borrowed: only close."""
        self._shutdown(self.config.shutdown_grace_s)

    def _shutdown(self, grace_s: float, *, release_lease: bool = True) -> None:
        with self._lock:
            first = not self._shut
            self._shut = True
        if first:
            try:
                self._stop.set()
                self._failure_state.close()
                if self._monitor is not None and self._monitor is not threading.current_thread():
                    self._monitor.join(timeout=2.0)
                if self._owned:
                    if grace_s > 0:
                        self._run_hooks(grace_s)
                    self._kill_actors()
            finally:
                self._stopped.set()
        else:
            # Another shutdown (the retirement after a failure) is under way: return once it is done.
            bound = self.config.shutdown_grace_s + 10.0
            if not self._stopped.wait(bound):
                logger.warning("ray shutdown: actors still being retired after %ss", bound)
        if release_lease:
            with self._lock:
                lease, self._lease = self._lease, None
            if lease is not None:
                lease.release()

    def _run_hooks(self, grace_s: float) -> None:
        ray = _ray()
        refs = []
        for actor in self._actors:
            try:
                refs.append(actor.shutdown.remote())  # queued behind the calls already submitted
            except AttributeError:
                continue  # this worker has no shutdown() hook
            except Exception:
                logger.exception("ray: could not call a shutdown() hook")
        if refs:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
            if pending:
                logger.warning("ray: %d shutdown() hook(s) still running after %ss; killing", len(pending), grace_s)

    def _kill_actors(self) -> None:
        ray = _ray()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.exception("ray: could not kill actor %r", actor)

    def __getstate__(self) -> dict[str, Any]:
        # Threads and the runtime lease stay with this process; a copy borrows.
        return {"config": self.config, "failure_state": self._failure_state, "actors": self._actors}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self._failure_state = state["failure_state"]
        self._prepare(actors=list(state["actors"]), owned=False)
