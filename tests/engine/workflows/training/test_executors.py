"""The training and publication workflow through a real out-of-process executor: ``mp`` (spawned
processes) and ``ray`` (actors on a real local Ray cluster).

Each case builds an executor with one ``workers.trainer.worker.Trainer`` rank, a whole
orchestrator whose ``TrainingController`` reaches the trainer only through that executor, and the
two reference inference engines of ``engine_procs``. Two jobs submitted in turn must each reach
``COMPLETE``; the trainer (asked through the executor) must have taken exactly two steps, its
persisted step record naming the second job; both engines must serve the second job's runtime
load id; the same payloads submitted again must be replays that train nothing.

The ``mp`` case runs on both journal backends (``journal_url``). The ``ray`` case runs on SQLite
only, to keep the suite fast: the journal is not what differs between the executors. It is
skipped only when Ray cannot be imported (the reason says so); any other Ray problem fails it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.config import Settings
from engine.workflows.training.publication import PublicationSettings
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.runtime.service import Orchestrator
from engine.workflows.training import submit_job
from journal import Journal, audit
from tests.support.ray_runtime import local_ray
from tests.support.backends import only_sqlite
from tests.support.training import edges, job_row, payload, submit, until_state, versions
from tests.workers.inference.engines import EngineProc
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from workers.inference import SGLangConfig, SGLangEngine
from workers.trainer.steps import read_step_record
from workers.trainer.worker import Trainer

pytestmark = pytest.mark.slow

#: A safety net for starting a rank (a spawned interpreter or an actor importing torch), not a measure.
LAUNCH_TIMEOUT_S = 120.0
#: Every state a job passes through on its way to COMPLETE, in order.
TRAIL = [(None, "RUNNING"), ("RUNNING", "CHECKPOINT"), ("CHECKPOINT", "CHECKPOINT"), ("CHECKPOINT", "UPDATING_WEIGHTS"),
         ("UPDATING_WEIGHTS", "READY_TO_COMMIT"), ("READY_TO_COMMIT", "HEAD_COMMITTED"),
         ("HEAD_COMMITTED", "COMPLETE")]


#: A real local Ray cluster for this module (tests/support/ray_runtime.py).
ray_runtime = pytest.fixture(scope="module")(local_ray)


@pytest.fixture
def trainer_state(tmp_path: Path) -> Path:
    """Where the trainer rank keeps its step record."""
    return tmp_path / "trainer"


def trainer_executor(backend: str, state_dir: Path) -> Executor:
    """One ``Trainer`` rank (seed 0, step record in ``state_dir``) on ``backend``."""
    spec = WorkerSpec(Trainer, kwargs={"seed": 0, "state_dir": str(state_dir)})
    return Executor.create(ExecutorConfig(backend=backend, workers=(spec,), launch_timeout_s=LAUNCH_TIMEOUT_S,
                                          shutdown_grace_s=3.0, kill_grace_s=2.0))


@pytest.fixture
def mp_executor(trainer_state: Path) -> Iterator[Executor]:
    ex = trainer_executor("mp", trainer_state)
    try:
        yield ex
    finally:
        ex.shutdown()


@pytest.fixture
def ray_executor(ray_runtime: Any, trainer_state: Path) -> Iterator[Executor]:
    ex = trainer_executor("ray", trainer_state)
    try:
        yield ex
    finally:
        ex.shutdown()


@asynccontextmanager
async def orchestrator(journal_url: str, executor: Executor, procs: list[EngineProc],
                       tmp_path: Path) -> AsyncIterator[Orchestrator]:
    """A leading orchestrator whose training controller publishes to ``procs``' engines."""
    engines = [SGLangEngine(SGLangConfig(p.url, timeout=10, weight_update_timeout=30)) for p in procs]
    controller = TrainingController(
        executor, TrainingSettings(str(tmp_path / "checkpoints"), retry_after_s=0.2, call_timeout_s=60),
        publication=(engines, PublicationSettings("dep", str(tmp_path / "weights"), retry_after_s=0.3)))
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 1}, "logging": {"level": "WARNING"}})
    orch = Orchestrator(settings, controllers=[controller], unbuilt=["discovery"])
    await orch.start()
    try:
        for _ in range(200):
            if orch.is_leader and orch.working():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the orchestrator did not lead")
        yield orch
    finally:
        await orch.stop()
        for engine in engines:
            await engine.close()


async def served(procs: list[EngineProc]) -> list[str]:
    """The weight version each engine reports, asked over its own HTTP API."""
    out = []
    async with aiohttp.ClientSession() as http:
        for p in procs:
            async with http.get(f"{p.url}/get_weight_version") as resp:
                assert resp.status == 200, await resp.text()
                out.append((await resp.json())["weight_version"])
    return out


async def resubmit(journal: Journal, job: dict[str, Any]) -> tuple[str, str]:
    async with journal.write() as tx:
        again = await submit_job(tx, "dep", job, trainer_step=2)
    return again.job_id, again.disposition


async def two_jobs_through(backend: str, journal_url: str, executor: Executor, procs: list[EngineProc],
                           trainer_state: Path, tmp_path: Path) -> None:
    """The whole workflow twice, then a replay of both payloads (see the module docs)."""
    def trainer_health() -> dict[str, Any]:
        health: dict[str, Any] = executor.rpc(0, "health", timeout=30)
        return health

    assert executor.backend == backend
    start = trainer_health()
    # The rank really is another process: nothing below goes through the test's own interpreter.
    assert start["pid"] != os.getpid() and start["step"] == 0 and start["step_record"] is None
    async with orchestrator(journal_url, executor, procs, tmp_path) as orch:
        first = await submit(orch.journal, payload(1))
        row1 = await until_state(orch.journal, first, "COMPLETE")
        assert trainer_health()["step"] == 1
        second = await submit(orch.journal, payload(2))
        assert second != first
        row2 = await until_state(orch.journal, second, "COMPLETE")

        incarnation, _, sequence = row1["runtime_load_id"].rpartition(":")
        assert sequence == "1" and row1["commit_acknowledged"] is True
        target = row2["runtime_load_id"]
        assert target == f"{incarnation}:2" and row2["target_load_id"] == target
        assert row2["commit_acknowledged"] is True and row2["publish_attempts"] == 1 and row2["detail"] is None
        assert row1["metrics"]["job_id"] == first and row1["metrics"]["step"] == 1
        assert row2["metrics"]["job_id"] == second and row2["metrics"]["step"] == 2
        assert await edges(orch.journal, first) == TRAIL
        assert await edges(orch.journal, second) == TRAIL
        assert await versions(orch.journal) == {f"{incarnation}:0": ("committed", None),
                                                row1["runtime_load_id"]: ("committed", first),
                                                target: ("committed", second)}

        # The trainer, asked through the executor: two steps, the second job's the latest.
        health = trainer_health()
        assert health["step"] == 2 and health["last_job_id"] == second
        assert health["prepared_version"] == target
        assert health["step_record"] is not None and health["step_record"]["job_id"] == second
        assert health["step_record"]["step"] == 2
        # ...and the record is durable: the file on disk, read here, says the same.
        record = read_step_record(trainer_state)
        assert record is not None and record.job_id == second and record.step == 2 and record.phase == "applied"

        # Both engines serve the second job's weights.
        assert await served(procs) == [target, target]

        # The same payloads again: the recorded results, nothing trained.
        assert await resubmit(orch.journal, payload(2)) == (second, "replay")
        assert await resubmit(orch.journal, payload(1)) == (first, "replay")
        await asyncio.sleep(1.5)  # longer than a resync: the controller had every chance to act
        assert trainer_health()["step"] == 2
        assert (await job_row(orch.journal, second))["state"] == "COMPLETE"
        assert await edges(orch.journal, second) == TRAIL
        assert await edges(orch.journal, first) == TRAIL
        assert await served(procs) == [target, target]
        assert await audit.verify(orch.journal) == []


async def test_the_workflow_runs_with_the_mp_executor(journal_url: str, mp_executor: Executor,
                                                      engine_procs: list[EngineProc], trainer_state: Path,
                                                      tmp_path: Path) -> None:
    await two_jobs_through("mp", journal_url, mp_executor, engine_procs, trainer_state, tmp_path)


@only_sqlite
async def test_the_workflow_runs_with_the_ray_executor(journal_url: str, ray_executor: Executor,
                                                       engine_procs: list[EngineProc], trainer_state: Path,
                                                       tmp_path: Path) -> None:
    await two_jobs_through("ray", journal_url, ray_executor, engine_procs, trainer_state, tmp_path)
