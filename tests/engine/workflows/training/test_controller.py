"""The training controller (engine/workflows/training/controller.py) on both journal backends, driving a
real torch trainer through the uni executor, through a whole orchestrator.

An orchestrator "crash" here is stopping it and starting a fresh one (with a fresh controller,
so nothing it remembered survives) while the trainer lives on, as when only the orchestrator's
process dies; the SIGKILL crash points of every commit are the subject of their own test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import Settings
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.runtime.service import Orchestrator
from engine.workflows.training import job_identity, resolve_job, submit_job
from journal import Journal, audit
from tests.support.training import edges, job_row, payload, submit, until_state
from workers.executor import Executor
from workers.trainer.checkpoint import verify_checkpoint
from workers.trainer.steps import write_step_record


class Harness:
    def __init__(self, url: str, executor: Executor, checkpoints: Path) -> None:
        self.url, self.executor, self.checkpoints = url, executor, checkpoints
        self.orch: Orchestrator | None = None

    async def start(self) -> Orchestrator:
        settings = Settings.model_validate({
            "journal": {"url": self.url},
            "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
            "reconciler": {"resync_interval_s": 1},
            "logging": {"level": "WARNING"}})
        controller = TrainingController(self.executor, TrainingSettings(str(self.checkpoints), retry_after_s=0.2))
        self.orch = Orchestrator(settings, controllers=[controller], unbuilt=["discovery"])
        await self.orch.start()
        for _ in range(200):
            if self.orch.is_leader and self.orch.working():
                return self.orch
            await asyncio.sleep(0.05)
        raise AssertionError("the orchestrator did not lead")

    async def stop(self) -> None:
        if self.orch is not None:
            await self.orch.stop()
            self.orch = None

    def trainer(self, method: str, *args: Any) -> Any:
        return self.executor.rpc(0, method, args)


@pytest.fixture
async def harness(journal_url: str, executor: Executor, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(journal_url, executor, tmp_path / "checkpoints")
    try:
        yield h
    finally:
        await h.stop()


async def test_a_job_is_trained_once_checkpointed_and_recorded(harness: Harness) -> None:
    orch = await harness.start()
    job_id = await submit(orch.journal, payload())
    row = await until_state(orch.journal, job_id, "CHECKPOINT")
    assert row["checkpoint_path"] == str(harness.checkpoints / f"{job_id}.ckpt")
    assert verify_checkpoint(row["checkpoint_path"]).job_id == job_id
    assert row["metrics"]["job_id"] == job_id and row["metrics"]["step"] == 1
    assert harness.trainer("health")["step"] == 1
    # Submitted again: the recorded result, no second step.
    async with orch.journal.write() as tx:
        again = await submit_job(tx, "dep", payload())
    assert again.disposition == "resume"
    await asyncio.sleep(0.3)
    assert harness.trainer("health")["step"] == 1
    assert await edges(orch.journal, job_id) == [(None, "RUNNING"), ("RUNNING", "CHECKPOINT")]
    assert await audit.verify(orch.journal) == []


async def test_a_running_job_found_after_a_restart_is_ambiguous_then_settled_by_the_step_record(
        harness: Harness, journal_url: str) -> None:
    # Recorded RUNNING by an orchestrator that died before calling train (another journal handle:
    # this orchestrator never saw the commit).
    other = Journal.open(journal_url)
    try:
        job_id = await submit(other, payload())
    finally:
        await other.dispose()
    orch = await harness.start()
    row = await until_state(orch.journal, job_id, "CHECKPOINT")
    assert harness.trainer("health")["step"] == 1  # trained once, after the evidence said it never ran
    assert await edges(orch.journal, job_id) == [(None, "RUNNING"), ("RUNNING", "AMBIGUOUS"), ("AMBIGUOUS", "RUNNING"),
                                                 ("RUNNING", "CHECKPOINT")]
    assert row["ambiguity"] is None


async def test_a_job_trained_before_the_crash_is_never_trained_again(harness: Harness, journal_url: str) -> None:
    orch = await harness.start()
    await harness.stop()  # the orchestrator is gone; the trainer lives on
    other = Journal.open(journal_url)
    try:
        job_id = await submit(other, payload())
    finally:
        await other.dispose()
    # The dead orchestrator had called train (the step ran), then died before the checkpoint.
    trained = harness.trainer("train", {**payload(), "job_id": job_id})
    orch = await harness.start()
    row = await until_state(orch.journal, job_id, "CHECKPOINT")
    assert harness.trainer("health")["step"] == 1
    # Settled with the step's own training metrics, not only where the evidence came from.
    assert row["metrics"] == {**trained, "settled_from": "live trainer", "step": 1}
    assert verify_checkpoint(row["checkpoint_path"]).job_id == job_id


async def test_a_verified_checkpoint_settles_an_ambiguous_job(harness: Harness, journal_url: str,
                                                               tmp_path: Path) -> None:
    other = Journal.open(journal_url)
    try:
        job_id = await submit(other, payload())
    finally:
        await other.dispose()
    # Trained and checkpointed by the dead orchestrator; then a later job moved the trainer on...
    trained = harness.trainer("train", {**payload(), "job_id": job_id})
    harness.trainer("save_checkpoint", str(harness.checkpoints / f"{job_id}.ckpt"), job_id)
    harness.trainer("train", {**payload(5), "job_id": "a-later-job"})
    orch = await harness.start()
    row = await until_state(orch.journal, job_id, "CHECKPOINT")
    # The checkpoint kept the step's training metrics: the settled job has them.
    assert row["metrics"] == {**trained, "settled_from": "verified checkpoint", "step": 1}
    assert harness.trainer("health")["step"] == 2  # nothing trained again


async def test_without_evidence_a_job_waits_for_an_operator_and_never_trains(harness: Harness, journal_url: str,
                                                                              tmp_path: Path) -> None:
    other = Journal.open(journal_url)
    try:
        job_id = await submit(other, payload())
    finally:
        await other.dispose()
    # The trainer ran the step (its record names the job), then another job moved it on, and no
    # checkpoint carries the job: nothing durable says whether the weights hold its step.
    harness.trainer("train", {**payload(), "job_id": job_id})
    harness.trainer("train", {**payload(7), "job_id": "a-later-job"})
    record = harness.trainer("health")["step_record"]
    assert record["job_id"] == "a-later-job"
    # ...and the record is put back to name the job, as a trainer that died mid-step leaves it.
    write_step_record(tmp_path / "trainer", 2, job_id, "started")
    orch = await harness.start()
    row = await until_state(orch.journal, job_id, "AMBIGUOUS")
    for _ in range(40):
        row = await job_row(orch.journal, job_id)
        if row["ambiguity"] and "operator" in row["ambiguity"]:
            break
        await asyncio.sleep(0.05)
    assert "an operator must decide" in row["ambiguity"] and row["state"] == "AMBIGUOUS"
    assert harness.trainer("health")["step"] == 2  # never trained without evidence
    # The operator looks and decides the step never ran on these weights: it is trained, once.
    await orch.committer.run_fresh(lambda tx: resolve_job(
        tx, job_id, "not_run", reason="the trainer's log shows the step never started"))
    row = await until_state(orch.journal, job_id, "CHECKPOINT")
    assert harness.trainer("health")["step"] == 3 and row["metrics"]["job_id"] == job_id


async def test_a_job_the_trainer_refuses_before_any_step_fails(harness: Harness) -> None:
    orch = await harness.start()
    bad = {**payload(), "rollouts": [{"prompt": "ab", "completion": [99], "reward": 1.0}]}
    job_id = await submit(orch.journal, bad)
    assert job_id == job_identity(bad)
    row = await until_state(orch.journal, job_id, "FAILED")
    assert await edges(orch.journal, job_id) == [(None, "RUNNING"), ("RUNNING", "FAILED")]
    assert "rollouts[0].completion[0]" in row["detail"]
    assert harness.trainer("health")["step"] == 0


def test_a_served_trainers_job_error_is_a_refusal_and_other_errors_are_not() -> None:
    """The http executor carries a served trainer's exception as ServedWorkerError with its remote
    classes: a JobError (or a subclass) there is the trainer's refusal, as it is from a local rank."""
    from engine.workflows.training.controller import _refused_before_any_step
    from workers.executor import ServedWorkerError

    refusal = ServedWorkerError("my.trainer.BadBatch", "job field rollouts: [] — empty", "tb",
                                ("my.trainer.BadBatch", "workers.trainer.errors.JobError", "builtins.ValueError"))
    failure = ServedWorkerError("builtins.RuntimeError", "CUDA out of memory", "tb", ("builtins.RuntimeError",))
    assert _refused_before_any_step(refusal) and not _refused_before_any_step(failure)
    assert not _refused_before_any_step(RuntimeError("job field x"))
