"""Settling an AMBIGUOUS job (engine/workflows/training/controller.py): regression tests from the review of
issue 6, through a whole orchestrator with a real torch trainer (uni executor), both backends.

- A trainer that keeps no step record (no ``state_dir``) but has taken steps proves nothing by
  the record's absence: the job used to be trained again (its step applied twice).
- What stops a job from settling (a trainer whose health cannot be read) is written to the
  job's ``ambiguity`` in the journal, not only to a log.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from journal import Journal
from tests.engine.workflows.training.test_controller import Harness
from tests.support.training import edges, job_row, payload, submit, until_state
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from workers.trainer.steps import STEP_FILE
from workers.trainer.worker import Trainer


@pytest.fixture
def bare_executor() -> Iterator[Executor]:
    """A trainer without a state_dir: it keeps no step record."""
    ex = Executor.create(ExecutorConfig(backend="uni", workers=(WorkerSpec(Trainer, kwargs={"seed": 0}),)))
    try:
        yield ex
    finally:
        ex.shutdown()


@pytest.fixture
async def bare(journal_url: str, bare_executor: Executor, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(journal_url, bare_executor, tmp_path / "checkpoints")
    try:
        yield h
    finally:
        await h.stop()


@pytest.fixture
async def recording(journal_url: str, executor: Executor, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(journal_url, executor, tmp_path / "checkpoints")
    try:
        yield h
    finally:
        await h.stop()


async def submitted_elsewhere(journal_url: str, salt: int = 0) -> str:
    """Recorded RUNNING by an orchestrator that then died (this one never saw the commit)."""
    other = Journal.open(journal_url)
    try:
        return await submit(other, payload(salt))
    finally:
        await other.dispose()


async def until_ambiguity(journal: Journal, job_id: str, text: str) -> dict[str, object]:
    for _ in range(400):
        row = await job_row(journal, job_id)
        if row["ambiguity"] and text in row["ambiguity"]:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id[:12]} is {row['state']}: {row['ambiguity']}")


async def test_no_step_record_from_a_trainer_that_stepped_without_one_is_not_evidence(bare: Harness,
                                                                                       journal_url: str) -> None:
    job_id = await submitted_elsewhere(journal_url)
    # The dead orchestrator had trained it; then another job moved the trainer on. No record, no checkpoint.
    bare.trainer("train", {**payload(), "job_id": job_id})
    bare.trainer("train", {**payload(7), "job_id": "a-later-job"})
    assert bare.trainer("health")["step_record"] is None
    orch = await bare.start()
    row = await until_ambiguity(orch.journal, job_id, "keeps no step record")
    assert row["state"] == "AMBIGUOUS" and "an operator must decide" in str(row["ambiguity"])
    await asyncio.sleep(0.5)  # several more looks (retry_after_s=0.2): still nothing trains
    assert (await job_row(orch.journal, job_id))["state"] == "AMBIGUOUS"
    assert bare.trainer("health")["step"] == 2  # its step is not applied a second time


async def test_a_trainer_without_a_record_that_never_stepped_settles_the_job(bare: Harness, journal_url: str) -> None:
    job_id = await submitted_elsewhere(journal_url)
    orch = await bare.start()
    await until_state(orch.journal, job_id, "CHECKPOINT")
    assert bare.trainer("health")["step"] == 1
    assert await edges(orch.journal, job_id) == [(None, "RUNNING"), ("RUNNING", "AMBIGUOUS"), ("AMBIGUOUS", "RUNNING"),
                                                 ("RUNNING", "CHECKPOINT")]


async def test_a_trainer_whose_health_fails_is_said_in_the_journal(recording: Harness, journal_url: str,
                                                                   tmp_path: Path) -> None:
    job_id = await submitted_elsewhere(journal_url)
    # A damaged step record on disk: the trainer's health raises (a real fault, not a fake).
    (tmp_path / "trainer").mkdir(parents=True, exist_ok=True)
    (tmp_path / "trainer" / STEP_FILE).write_text("{not json")
    orch = await recording.start()
    row = await until_ambiguity(orch.journal, job_id, "health did not answer")
    assert "StepRecordError" in str(row["ambiguity"]) and row["state"] == "AMBIGUOUS"
    # Said once: looking again with the same outcome writes no new event.
    await asyncio.sleep(0.5)
    assert (await edges(orch.journal, job_id)).count(("AMBIGUOUS", "AMBIGUOUS")) == 1
    # Once the record is readable again (here: gone, on a trainer that never stepped), it settles.
    (tmp_path / "trainer" / STEP_FILE).unlink()
    await until_state(orch.journal, job_id, "CHECKPOINT")
    assert recording.trainer("health")["step"] == 1
