"""``auto`` and explicit backend selection: the rules, the log line, and never importing Ray to decide."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.workers.executor.sample_worker import SampleWorker
from tests.workers.executor.support import REPO_ROOT
from workers.executor import (
    Executor,
    ExecutorConfig,
    ExecutorConfigError,
    MpExecutor,
    RayExecutor,
    UniExecutor,
    WorkerSpec,
    select_backend,
)


def specs(n: int, **options: Any) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(SampleWorker, args=(rank,), options=options) for rank in range(n))


@pytest.mark.parametrize(
    ("config", "expected", "reason"),
    [
        (ExecutorConfig(workers=specs(1)), UniExecutor, "exactly one local worker"),
        (ExecutorConfig(workers=specs(3)), MpExecutor, "3 local workers"),
        (ExecutorConfig(workers=specs(1), options={"num_cpus": 1}), RayExecutor, "Ray actor options"),
        (ExecutorConfig(workers=specs(2), node_id="n1"), RayExecutor, "cluster placement"),
        (ExecutorConfig(workers=specs(1, resources={"trainer": 1})), RayExecutor, "Ray actor options"),
        (ExecutorConfig(workers=specs(1, cuda_visible_devices="0")), MpExecutor, "separate processes"),
        (ExecutorConfig(backend="uni", workers=specs(1)), UniExecutor, "explicit"),
        (ExecutorConfig(backend="workers.executor._ray:RayExecutor", workers=specs(1)), RayExecutor, "import path"),
        (ExecutorConfig(backend="workers.executor.MpExecutor", workers=specs(1)), MpExecutor, "import path"),
        (ExecutorConfig(backend=MpExecutor, workers=specs(1)), MpExecutor, "explicit class"),
    ],
)
def test_selection_rules(config: ExecutorConfig, expected: type, reason: str) -> None:
    cls, why = select_backend(config)
    assert cls is expected
    assert reason in why


def test_ray_address_alone_does_not_select_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert select_backend(ExecutorConfig(workers=specs(2)))[0] is MpExecutor


@pytest.mark.parametrize(
    ("config", "field", "rule"),
    [
        (ExecutorConfig(workers=()), "ExecutorConfig.workers", "at least one"),
        (ExecutorConfig(workers=specs(2), gpus_per_worker=0.5), "ExecutorConfig.gpus_per_worker", "whole GPUs"),
        (ExecutorConfig(workers=specs(2), gpus_per_worker=10_000), "ExecutorConfig.gpus_per_worker", "are visible"),
        (ExecutorConfig(backend="local", workers=specs(1)), "ExecutorConfig.backend", "removed"),
        (ExecutorConfig(backend="threads", workers=specs(1)), "ExecutorConfig.backend", "must be"),
        (ExecutorConfig(backend="workers.executor:nothing", workers=specs(1)), "ExecutorConfig.backend", "no attribute"),
        (ExecutorConfig(backend="tests.workers.executor.sample_worker:SampleWorker", workers=specs(1)),
         "ExecutorConfig.backend", "Executor subclass"),
        (ExecutorConfig(backend=SampleWorker, workers=specs(1)), "ExecutorConfig.backend", "Executor subclass"),
    ],
)
def test_selection_errors_name_the_field(config: ExecutorConfig, field: str, rule: str) -> None:
    with pytest.raises(ExecutorConfigError, match=rule) as caught:
        select_backend(config)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"launch_timeout_s": 0}, "ExecutorConfig.launch_timeout_s"),
        ({"launch_timeout_s": True}, "ExecutorConfig.launch_timeout_s"),
        ({"shutdown_grace_s": -1}, "ExecutorConfig.shutdown_grace_s"),
        ({"kill_grace_s": float("inf")}, "ExecutorConfig.kill_grace_s"),
        ({"workers": [object()]}, "ExecutorConfig.workers[0]"),
        ({"options": {1: 2}}, "ExecutorConfig.options"),
        ({"node_id": ""}, "ExecutorConfig.node_id"),
        ({"gpus_per_worker": -1}, "ExecutorConfig.gpus_per_worker"),
    ],
)
def test_bad_config_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ExecutorConfigError) as caught:
        ExecutorConfig(**kwargs)
    assert caught.value.field == field


def test_bad_worker_spec_values_name_the_field() -> None:
    with pytest.raises(ExecutorConfigError, match="WorkerSpec.worker_cls"):
        WorkerSpec(42)  # type: ignore[arg-type]
    with pytest.raises(ExecutorConfigError, match="WorkerSpec.args"):
        WorkerSpec(SampleWorker, args="0")  # type: ignore[arg-type]
    spec = WorkerSpec("tests.workers.executor.sample_worker:SampleWorker", args=[3])  # type: ignore[arg-type]
    assert spec.args == (3,) and spec.resolve_class() is SampleWorker


def test_the_choice_and_its_reason_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tidelog.executor"):
        executor = Executor.create(ExecutorConfig(workers=specs(1)))
    executor.shutdown()
    assert isinstance(executor, UniExecutor)
    [record] = [r for r in caplog.records if "selected" in r.getMessage()]
    assert record.name == "tidelog.executor"
    assert "uni" in record.getMessage() and "exactly one local worker" in record.getMessage()


def test_auto_never_imports_ray_to_decide() -> None:
    script = """
import sys
from workers.executor import Executor, ExecutorConfig, WorkerSpec, select_backend
from tests.workers.executor.sample_worker import SampleWorker
if __name__ == "__main__":
    for n in (1, 2, 5):
        select_backend(ExecutorConfig(workers=tuple(WorkerSpec(SampleWorker, args=(r,)) for r in range(n))))
    Executor.create(ExecutorConfig(workers=(WorkerSpec(SampleWorker, args=(0,)),))).shutdown()
    assert "ray" not in sys.modules, "auto imported ray"
    print("ok")
"""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _select_from_inside(config: ExecutorConfig) -> str:
    return select_backend(config)[0].__name__


def test_several_workers_inside_a_ray_placement_group_select_ray(ray_cluster: Any) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}])
    ray_cluster.get(group.ready(), timeout=60)
    try:
        probe = ray_cluster.remote(_select_from_inside).options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True),
        )
        assert ray_cluster.get(probe.remote(ExecutorConfig(workers=specs(2))), timeout=60) == "RayExecutor"
        # One worker stays local even there; outside the group, two workers are mp.
        assert ray_cluster.get(probe.remote(ExecutorConfig(workers=specs(1))), timeout=60) == "UniExecutor"
        assert select_backend(ExecutorConfig(workers=specs(2)))[0] is MpExecutor
    finally:
        remove_placement_group(group)
