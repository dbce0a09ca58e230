"""A trainer that writes no checkpoint per step (its health says ``writes_checkpoint`` false), through
``tidelog serve`` on ``mp`` with a real reference engine, both journal backends.

``tests.support.own_trainer.NoCheckpointSgdTrainer`` (plain SGD: no optimizer state, so a trainer put
back on published weights steps exactly as the one that published them) under ``commit: acknowledge``:

1. job A trains to ``CHECKPOINT`` with a null checkpoint path and its metrics; its live weights are
   published; acknowledged, it is ``COMPLETE``;
2. job B is rejected at ``READY_TO_COMMIT``: the engine serves A again and the trainer is put back on
   A's published weights (``load_weights``), not left holding B's step;
3. the trainer process is SIGKILLed; job C's sync point starts a fresh one and puts it on A's weights;
   C is acknowledged.

C's published weights must equal, tensor for tensor, the weights of one trainer that took A's step
and then C's, computed here without any orchestrator: B's rejected step and the lost process changed
nothing. The step records say ``loaded`` for A before C's step.

A step lost with the trainer's process (killed after ``CHECKPOINT``, before the publication could
start) is found before any engine is paused, and the job is rejected at once (nothing could publish
it); the head is still served.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from engine.config import load
from engine.demos.ports import free_port
from engine.demos.training import trainer_pids
from engine.runtime.service import Orchestrator
from engine.workflows.training import acknowledge_job, reject_job
from tests.engine.workflows.training.test_crash_points import tensors_digest
from tests.engine.workflows.training.test_own_trainer import write_config
from tests.engine.workflows.training.test_serve_training import (  # noqa: F401 - orchestrators is a fixture
    orchestrators, serving, until_engines)
from tests.support.own_trainer import SgdTrainer
from tests.support.training import edges, payload, submit, until_state
from tests.workers.inference.engines import EngineProc
from workers.policy import load_weights, save_weights
from workers.trainer.steps import read_step_record

pytestmark = pytest.mark.slow
OWN = "tests.support.own_trainer:NoCheckpointSgdTrainer"


async def operate(orch: Orchestrator, fn: Any, job_id: str, reason: str) -> None:
    async def write(tx: Any) -> None:
        await fn(tx, job_id, reason=reason)
    await orch.committer.run(write)


async def test_a_trainer_without_checkpoints_publishes_its_live_weights_and_is_put_back_on_the_head(
        journal_url: str, tmp_path: Path, engine_procs: list[EngineProc], initial_dir: Path,
        orchestrators: list[Orchestrator]) -> None:
    path = write_config(tmp_path, journal_url, engine_procs[:1], initial_dir, "backend: mp\nlaunch_timeout_s: 120")
    path.write_text(path.read_text().replace("tests.support.own_trainer:SgdTrainer", OWN)
                    .replace("  enabled: true\n", "  enabled: true\n  commit: acknowledge\n"))
    settings = load(path)
    assert settings.training.trainer.class_ == OWN and settings.training.commit == "acknowledge"
    orch = await serving(settings, orchestrators)
    journal = orch.journal

    # A: trained without a checkpoint, its live weights published, acknowledged.
    a = await submit(journal, payload(1))
    row = await until_state(journal, a, "READY_TO_COMMIT", "FAILED", "AMBIGUOUS")
    assert row["state"] == "READY_TO_COMMIT" and row["checkpoint_path"] is None, row
    assert row["metrics"]["optimizer"] == "sgd" and row["metrics"]["step"] == 1, row["metrics"]
    await operate(orch, acknowledge_job, a, "A looks right")
    a_row = await until_state(journal, a, "COMPLETE")
    await until_engines(journal, "serving", a_row["runtime_load_id"])

    # B: rejected; the engine serves A again, and the trainer is put back on A's published weights.
    b = await submit(journal, payload(2))
    await until_state(journal, b, "READY_TO_COMMIT")
    await operate(orch, reject_job, b, "B regressed")
    await until_state(journal, b, "REJECTED")
    await until_engines(journal, "serving", a_row["runtime_load_id"])
    record = read_step_record(tmp_path / "trainer")
    assert record is not None and (record.job_id, record.phase, record.step) == (a, "loaded", 1), record

    # The trainer process dies; C's sync point starts a fresh one on A's weights.
    pids = trainer_pids(os.getpid())
    assert pids, "no trainer process to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    c = await submit(journal, payload(3))
    await until_state(journal, c, "READY_TO_COMMIT")
    await operate(orch, acknowledge_job, c, "C looks right")
    c_row = await until_state(journal, c, "COMPLETE")
    assert c_row["checkpoint_path"] is None and c_row["metrics"]["step"] == 2, c_row
    # (Its first look found the trainer's process gone: a RUNNING self-edge said so, then a fresh one.)
    trail = await edges(journal, c)
    assert ("RUNNING", "CHECKPOINT") in trail and all(to != "AMBIGUOUS" for _, to in trail), trail
    await until_engines(journal, "serving", c_row["runtime_load_id"])
    record = read_step_record(tmp_path / "trainer")
    assert record is not None and (record.job_id, record.phase, record.step) == (c, "applied", 2), record

    # The same bytes as one trainer that took A's step, then C's: B and the lost process changed nothing.
    direct = SgdTrainer(lr=0.2, seed=0)
    for salt, job_id in ((1, a), (3, c)):
        await asyncio.to_thread(direct.train, {**payload(salt), "job_id": job_id})
    save_weights(direct.model, tmp_path / "direct", "direct")
    published, _ = load_weights(tmp_path / "weights" / c_row["runtime_load_id"].replace(":", "-"))
    expected, _ = load_weights(tmp_path / "direct")
    assert tensors_digest(published) == tensors_digest(expected)


async def test_a_lost_live_step_is_found_before_any_engine_pauses_and_the_job_is_rejected(
        journal_url: str, tmp_path: Path, initial_dir: Path, orchestrators: list[Orchestrator]) -> None:
    # The engine is down when the job reaches CHECKPOINT (its pause fails, so the job waits there with
    # the trainer alive); the trainer process is then killed and the engine brought back on its port.
    port = free_port()
    engine = EngineProc(["--port", str(port), "--model-dir", str(initial_dir)], tmp_path / "engine.log").start()
    try:
        path = write_config(tmp_path, journal_url, [engine], initial_dir, "backend: mp\nlaunch_timeout_s: 120")
        path.write_text(path.read_text().replace("tests.support.own_trainer:SgdTrainer", OWN))
        orch = await serving(load(path), orchestrators)
        journal = orch.journal
        a = await submit(journal, payload(1))
        a_row = await until_state(journal, a, "COMPLETE")
        engine.kill()
        b = await submit(journal, payload(2))
        row = await until_state(journal, b, "CHECKPOINT")
        deadline = asyncio.get_running_loop().time() + 120  # a safety net, not a measure
        while "pausing the engines failed" not in (row["detail"] or ""):
            assert asyncio.get_running_loop().time() < deadline, f"the pause never failed: {row['detail']}"
            await asyncio.sleep(0.05)
            row = await until_state(journal, b, "CHECKPOINT")
        for pid in trainer_pids(os.getpid()):
            os.kill(pid, signal.SIGKILL)
        engine = EngineProc(["--port", str(port), "--model-dir", str(initial_dir)], tmp_path / "engine-2.log").start()
        # Found lost before any engine was paused for it, and rejected: nothing is published from it.
        row = await until_state(journal, b, "REJECTED", "UPDATING_WEIGHTS", "READY_TO_COMMIT")
        assert row["state"] == "REJECTED", row
        assert row["verdict"]["by"] == "orchestrator" and "no longer holds" in row["verdict"]["reason"], row
        assert ("CHECKPOINT", "REJECTING") in await edges(journal, b)
        # The restarted engine is put on the head (A) by the gate; B's candidate never reached it.
        await until_engines(journal, "serving", a_row["runtime_load_id"])
    finally:
        engine.kill()
