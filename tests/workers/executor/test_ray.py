"""ray-only behaviour on a real local cluster: options, node pinning, borrowed actors, pickling, the lease."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.workers.executor.sample_worker import SampleWorker
from tests.workers.executor.support import RecordingListener, pid_alive, wait_until
from workers.executor import (
    Executor,
    ExecutorConfig,
    ExecutorConfigError,
    ExecutorFailedError,
    RayExecutor,
    RayRuntimeLease,
    WorkerSpec,
)

SAFETY = 30.0


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"options": {"max_task_retries": 1}}, "ExecutorConfig.workers[0] option max_task_retries"),
        ({"options": {"max_restarts": 2}}, "ExecutorConfig.workers[0] option max_restarts"),
        ({"node_id": "abc", "workers": (WorkerSpec(SampleWorker, args=(0,), options={"scheduling_strategy": "SPREAD"}),)},
         "ExecutorConfig.node_id"),
        ({"workers": (WorkerSpec(SampleWorker, args=(0,), options={"cuda_visible_devices": "0"}),)},
         "ExecutorConfig.workers[0] option cuda_visible_devices"),
    ],
)
def test_ray_refuses_retries_and_conflicting_placement_before_starting_ray(config: dict[str, Any], field: str) -> None:
    config.setdefault("workers", (WorkerSpec(SampleWorker, args=(0,)),))
    with pytest.raises(ExecutorConfigError) as caught:
        Executor.create(ExecutorConfig(backend="ray", **config))
    assert caught.value.field == field


def test_node_id_pins_every_actor_to_that_node(ray_cluster: Any) -> None:
    node = ray_cluster.get_runtime_context().get_node_id()
    executor = Executor.create(
        ExecutorConfig(backend="ray", workers=(WorkerSpec(SampleWorker, args=(0,)),), node_id=node, launch_timeout_s=SAFETY)
    )
    try:
        assert executor.rpc(0, "ray_node_id", timeout=SAFETY) == node
    finally:
        executor.shutdown()
    assert ray_cluster.is_initialized()  # the session's runtime was borrowed, not shut down


def test_borrowed_actors_survive_shutdown_and_a_listener_starts_monitoring(ray_cluster: Any, marker_dir: Path) -> None:
    actor_cls = ray_cluster.remote(SampleWorker).options(max_restarts=0)
    kept, doomed = (actor_cls.remote(rank, marker_dir=str(marker_dir)) for rank in range(2))
    borrowed = RayExecutor.from_workers([kept])
    assert borrowed.rpc(0, "add", args=(4,), timeout=SAFETY) == (0, 4)
    borrowed.shutdown()
    assert ray_cluster.get(kept.count.remote(), timeout=SAFETY) == 4  # alive and unchanged
    assert not (marker_dir / "shutdown-0").exists()

    watched = RayExecutor.from_workers([doomed])
    try:
        listener = RecordingListener()
        watched.register_failure_listener(listener)  # a borrowed group monitors once someone listens
        ray_cluster.kill(doomed)
        wait_until(lambda: len(listener.calls) == 1, what="the listener hearing of the killed actor")
        assert listener.calls[0].rank == 0
        with pytest.raises(ExecutorFailedError):
            watched.rpc(0, "whoami")
    finally:
        watched.shutdown()
        ray_cluster.kill(kept)


def test_a_pickled_executor_borrows_the_same_actors(ray_cluster: Any) -> None:
    executor = Executor.create(
        ExecutorConfig(backend="ray", workers=(WorkerSpec(SampleWorker, args=(0,)),), launch_timeout_s=SAFETY)
    )
    try:
        copy = pickle.loads(pickle.dumps(executor))
        assert copy.rpc(0, "add", args=(1,), timeout=SAFETY) == (0, 1)
        copy.shutdown()  # a copy never owns the actors
        assert executor.rpc(0, "count", timeout=SAFETY) == 1
    finally:
        executor.shutdown()


def test_a_failure_retires_owned_actors_but_the_lease_waits_for_the_owners_shutdown(ray_cluster: Any) -> None:
    # The lease count is the only trace of who may shut Ray down; a retirement thread that
    # released it would stop a runtime the lease started under the owner's other threads.
    users = RayRuntimeLease._users
    executor = Executor.create(
        ExecutorConfig(
            backend="ray",
            workers=tuple(WorkerSpec(SampleWorker, args=(rank,)) for rank in range(2)),
            launch_timeout_s=SAFETY,
        )
    )
    try:
        pids = executor.collective_rpc("pid", timeout=SAFETY)
        assert RayRuntimeLease._users == users + 1
        assert isinstance(executor, RayExecutor)
        ray_cluster.kill(executor.actors[0])
        wait_until(lambda: executor.failure is not None, what="the failure being detected")
        wait_until(lambda: not pid_alive(pids[1]), what="the owned peer being retired")
        assert RayRuntimeLease._users == users + 1  # retired, but the runtime is still held
        with pytest.raises(ExecutorFailedError):
            executor.rpc(1, "whoami")
    finally:
        executor.shutdown()
    assert RayRuntimeLease._users == users
    executor.shutdown()  # idempotent: the lease is released once
    assert RayRuntimeLease._users == users
