"""Fixtures of the training-workflow tests: a real torch trainer behind the uni executor, and two
real reference inference engines (processes on loopback) serving the initial weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.inference.engines import EngineProc
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from workers.policy import Policy, save_weights
from workers.trainer.worker import Trainer


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[Executor]:
    """One trainer rank (seed 0) keeping its step record in ``<tmp>/trainer``."""
    ex = Executor.create(ExecutorConfig(backend="uni", workers=(
        WorkerSpec(Trainer, kwargs={"seed": 0, "state_dir": str(tmp_path / "trainer")}),)))
    try:
        yield ex
    finally:
        ex.shutdown()


@pytest.fixture
def initial_dir(tmp_path: Path) -> Path:
    """The weights the engines start with: ``Policy(seed=0)`` as version ``initial``."""
    path = tmp_path / "initial"
    save_weights(Policy(seed=0), path, "initial")
    return path


@pytest.fixture
def engine_procs(tmp_path: Path, initial_dir: Path) -> Iterator[list[EngineProc]]:
    procs = [EngineProc(["--port", "0", "--model-dir", str(initial_dir), "--enable-test-faults"],
                        tmp_path / f"engine-{i}.log").start() for i in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
