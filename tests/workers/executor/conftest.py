"""Fixtures of the executor tests: one real local Ray cluster per session, executors torn down.

``executor_backend`` parametrizes the contract tests over ``uni``, ``mp`` and
``ray``; ``make_executor(**kw)`` builds an executor of that backend with
``ranks(backend)`` SampleWorker ranks and shuts it down after the test. Ray
cases are skipped, with the reason, when Ray is not installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.executor.sample_worker import SampleWorker
from tests.workers.executor.support import BACKENDS, REPO_ROOT, ranks
from workers.executor import Executor, ExecutorConfig, WorkerSpec


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A real local Ray cluster on the CPU for the whole session (borrowed by every executor)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[default]>=2.9,<3')")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Actors import tests.* too, and Ray workers inherit the driver's environment.
    paths = [REPO_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Ray's socket paths live under the temp dir and must stay short (AF_UNIX limit).
    temp_dir = tempfile.mkdtemp(prefix="tlray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def executor_backend(request: pytest.FixtureRequest) -> str:
    backend = str(request.param)
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    return backend


@pytest.fixture
def marker_dir(tmp_path: Path) -> Path:
    path = tmp_path / "markers"
    path.mkdir()
    return path


@pytest.fixture
def make_executor(executor_backend: str, marker_dir: Path) -> Iterator[Callable[..., Executor]]:
    """``make_executor(n=None, specs=None, **config)``: SampleWorker ranks, shut down after the test."""
    made: list[Executor] = []

    def make(n: int | None = None, specs: tuple[WorkerSpec, ...] | None = None, **config: Any) -> Executor:
        count = ranks(executor_backend) if n is None else n
        if specs is None:
            specs = tuple(
                WorkerSpec(SampleWorker, args=(rank,), kwargs={"marker_dir": str(marker_dir)}) for rank in range(count)
            )
        config.setdefault("shutdown_grace_s", 3.0)
        config.setdefault("kill_grace_s", 2.0)
        config.setdefault("launch_timeout_s", 60.0)
        executor = Executor.create(ExecutorConfig(backend=executor_backend, workers=specs, **config))
        made.append(executor)
        return executor

    try:
        yield make
    finally:
        for executor in made:
            executor.shutdown()
