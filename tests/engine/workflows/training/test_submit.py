"""Submitting training jobs (engine/workflows/training/jobs.py), on both journal backends."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.training import JobClosed, JobConflict, TrainingPayloadError, job_identity, submit_job
from journal import Journal, Transition, audit, models

PAYLOAD: dict[str, Any] = {"rollouts": [{"prompt": "ab", "completion": "cd", "reward": 1.0}], "scenario_step": 4,
                           "batch_number": 2, "base_version": "abc:0"}


async def submit(journal: Journal, payload: dict[str, Any], deployment: str = "dep") -> Any:
    async with journal.write() as tx:
        return await submit_job(tx, deployment, payload, trainer_step=7)


async def move(journal: Journal, job_id: str, *states: str) -> None:
    async with journal.write() as tx:
        row = await tx.get("training_jobs", job_id)
        assert row is not None
        state, version = row.state, row.version
        for to in states:
            await tx.apply([Transition("training_jobs", job_id, state, version, to, f"to {to}")])
            state, version = to, version + 1


async def rows(journal: Journal) -> int:
    async with journal.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(models.training_jobs))).scalar() or 0)


async def test_a_new_job_is_recorded_running_with_its_identity(journal: Journal) -> None:
    got = await submit(journal, PAYLOAD)
    assert got.disposition == "new" and got.job_id == job_identity(PAYLOAD)
    assert (got.row.state, got.row["scenario_step"], got.row["batch_number"], got.row["trainer_step"]) == (
        "RUNNING", 4, 2, 7)
    # The same batch again, after the scenario advanced and the batches were renumbered: the same job.
    again = await submit(journal, {**PAYLOAD, "scenario_step": 9, "batch_number": 0, "base_version": "abc:1"})
    assert (again.disposition, again.job_id) == ("in_progress", got.job_id)
    assert await rows(journal) == 1
    assert await audit.verify(journal) == []


async def test_a_different_job_while_one_is_in_flight_is_refused_naming_both(journal: Journal) -> None:
    first = await submit(journal, PAYLOAD)
    other = {**PAYLOAD, "rollouts": [{"prompt": "x", "completion": "y", "reward": 0.0}]}
    with pytest.raises(JobConflict) as info:
        await submit(journal, other)
    assert first.job_id in str(info.value) and job_identity(other) in str(info.value)
    assert (info.value.in_flight, info.value.state) == (first.job_id, "RUNNING")
    assert await rows(journal) == 1
    assert (await submit(journal, other, deployment="elsewhere")).disposition == "new"  # deployments are apart


@pytest.mark.parametrize(("states", "disposition"), [
    (("CHECKPOINT",), "resume"),
    (("CHECKPOINT", "UPDATING_WEIGHTS"), "in_progress"),
    (("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT"), "replay"),
    (("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE"), "replay"),
    (("AMBIGUOUS",), "in_progress"),
])
async def test_the_same_job_again_never_trains_again(journal: Journal, states: tuple[str, ...],
                                                     disposition: str) -> None:
    job_id = (await submit(journal, PAYLOAD)).job_id
    await move(journal, job_id, *states)
    again = await submit(journal, PAYLOAD)
    assert (again.disposition, again.row.state) == (disposition, states[-1])
    assert await rows(journal) == 1


@pytest.mark.parametrize("states", [("CHECKPOINT", "REJECTING", "REJECTED"), ("FAILED",)])
async def test_a_settled_unpublished_job_is_refused_and_frees_the_deployment(journal: Journal,
                                                                             states: tuple[str, ...]) -> None:
    job_id = (await submit(journal, PAYLOAD)).job_id
    await move(journal, job_id, *states)
    with pytest.raises(JobClosed) as info:
        await submit(journal, PAYLOAD)
    assert info.value.state == states[-1]
    other = {**PAYLOAD, "rollouts": []}
    assert (await submit(journal, other)).disposition == "new"


@pytest.mark.parametrize(("payload", "field"), [
    ({**PAYLOAD, "scenario_step": -1}, "payload.scenario_step"),
    ({**PAYLOAD, "scenario_step": True}, "payload.scenario_step"),
    ({k: v for k, v in PAYLOAD.items() if k != "scenario_step"}, "payload.scenario_step"),
    ({**PAYLOAD, "batch_number": "2"}, "payload.batch_number"),
    ({**PAYLOAD, "base_version": "abc"}, "payload.base_version"),
    ({**PAYLOAD, "reward": float("nan")}, "payload.reward"),
])
async def test_a_bad_submission_is_refused_by_field_and_writes_nothing(journal: Journal, payload: dict[str, Any],
                                                                        field: str) -> None:
    with pytest.raises(TrainingPayloadError) as info:
        await submit(journal, payload)
    assert info.value.field == field
    with pytest.raises(TrainingPayloadError) as bad_deployment:
        await submit(journal, PAYLOAD, deployment="")
    assert bad_deployment.value.field == "deployment"
    assert await rows(journal) == 0
