"""uni-only behaviour: at most one worker, in the caller's process, owned or borrowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.workers.executor.sample_worker import SampleWorker
from workers.executor import Executor, ExecutorConfig, ExecutorConfigError, UniExecutor, WorkerSpec


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"workers": (WorkerSpec(SampleWorker, args=(0,)), WorkerSpec(SampleWorker, args=(1,)))}, "ExecutorConfig.workers"),
        ({"options": {"num_cpus": 1}}, "ExecutorConfig.options"),
        ({"node_id": "abc"}, "ExecutorConfig.node_id"),
        ({"workers": (WorkerSpec(SampleWorker, args=(0,), options={"num_cpus": 1}),)}, "ExecutorConfig.workers[0].options"),
    ],
)
def test_uni_refuses_what_it_cannot_do(config: dict[str, object], field: str) -> None:
    config.setdefault("workers", (WorkerSpec(SampleWorker, args=(0,)),))
    with pytest.raises(ExecutorConfigError) as caught:
        Executor.create(ExecutorConfig(backend="uni", **config))  # type: ignore[arg-type]
    assert caught.value.field == field


def test_the_worker_lives_in_the_callers_process() -> None:
    executor = Executor.create(ExecutorConfig(backend="uni", workers=(WorkerSpec(SampleWorker, args=(0,)),)))
    try:
        assert isinstance(executor, UniExecutor)
        assert executor.rpc(0, "pid", timeout=10) == os.getpid()
        assert executor.workers[0].rank == 0
    finally:
        executor.shutdown()


@pytest.mark.parametrize("owned", [False, True])
def test_from_workers_runs_the_hook_only_when_owned(marker_dir: Path, owned: bool) -> None:
    worker = SampleWorker(0, marker_dir=str(marker_dir))
    executor = UniExecutor.from_workers([worker], owned=owned)
    assert executor.rpc(0, "add", args=(2,), timeout=10) == (0, 2)
    executor.shutdown()
    assert (marker_dir / "shutdown-0").exists() is owned
    assert worker.count() == 2  # the object itself is untouched and still usable
    with pytest.raises(RuntimeError, match="executor is shut down"):
        executor.rpc(0, "count")
