"""An operator's rejection and resolution of training jobs (engine/workflows/training/operator.py), on both backends."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.training import (InvalidDecision, JobNotFound, JobStateRefused, reject_job, resolve_job, submit_job)
from journal import Journal, Transition, audit, models

PAYLOAD: dict[str, Any] = {"rollouts": [{"prompt": "ab", "completion": "cd", "reward": 1.0}], "scenario_step": 1}


async def new_job(journal: Journal, *states: str) -> str:
    async with journal.write() as tx:
        job_id = (await submit_job(tx, "dep", PAYLOAD)).job_id
        state, version = "RUNNING", 1
        for to in states:
            await tx.apply([Transition("training_jobs", job_id, state, version, to, f"to {to}")])
            state, version = to, version + 1
    return job_id


async def state_of(journal: Journal, job_id: str) -> dict[str, Any]:
    t = models.training_jobs
    async with journal.read() as conn:
        return dict((await conn.execute(sa.select(t).where(t.c.id == job_id))).one()._mapping)


@pytest.mark.parametrize("states", [("CHECKPOINT",), ("CHECKPOINT", "UPDATING_WEIGHTS"),
                                    ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT")])
async def test_a_candidate_not_yet_committed_can_be_rejected(journal: Journal, states: tuple[str, ...]) -> None:
    job_id = await new_job(journal, *states)
    async with journal.write() as tx:
        was = await reject_job(tx, job_id, reason="evaluation regressed")
    assert was.state == states[-1]
    row = await state_of(journal, job_id)
    assert (row["state"], row["detail"]) == ("REJECTING", "evaluation regressed")
    assert await audit.verify(journal) == []


@pytest.mark.parametrize("states", [(), ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED")])
async def test_a_job_that_is_not_a_pending_candidate_cannot_be_rejected(journal: Journal,
                                                                        states: tuple[str, ...]) -> None:
    job_id = await new_job(journal, *states)
    with pytest.raises(JobStateRefused) as info:
        async with journal.write() as tx:
            await reject_job(tx, job_id, reason="too late")
    assert info.value.state == (states[-1] if states else "RUNNING")
    assert (await state_of(journal, job_id))["state"] == info.value.state  # nothing written
    with pytest.raises(JobNotFound):
        async with journal.write() as tx:
            await reject_job(tx, "no-such-job", reason="x")


@pytest.mark.parametrize(("decision", "path", "to"), [("ran", "/ckpt/job.ckpt", "CHECKPOINT"),
                                                       ("not_run", None, "RUNNING"), ("abandon", None, "FAILED")])
async def test_an_ambiguous_job_is_settled_as_the_operator_decides(journal: Journal, decision: str, path: str | None,
                                                                   to: str) -> None:
    job_id = await new_job(journal, "AMBIGUOUS")
    async with journal.write() as tx:
        await resolve_job(tx, job_id, decision, reason="checked the trainer's logs", checkpoint_path=path)
    row = await state_of(journal, job_id)
    assert row["state"] == to and row["ambiguity"] is None
    if decision == "ran":
        assert row["checkpoint_path"] == path and row["metrics"]["settled_from"] == "operator"
    e = models.events
    async with journal.read() as conn:
        reason = (await conn.execute(sa.select(e.c.reason).where(e.c.entity_id == job_id)
                                     .order_by(e.c.seq.desc()).limit(1))).scalar()
    assert reason == f"resolved by an operator ({decision}): checked the trainer's logs"
    assert await audit.verify(journal) == []


@pytest.mark.parametrize(("decision", "path", "field"), [("maybe", None, "decision"), ("ran", None, "checkpoint_path"),
                                                          ("not_run", "/x", "checkpoint_path")])
async def test_a_bad_resolution_is_refused_by_field_and_writes_nothing(journal: Journal, decision: str,
                                                                       path: str | None, field: str) -> None:
    job_id = await new_job(journal, "AMBIGUOUS")
    with pytest.raises(InvalidDecision) as info:
        async with journal.write() as tx:
            await resolve_job(tx, job_id, decision, reason="because", checkpoint_path=path)
    assert info.value.field == field
    with pytest.raises(InvalidDecision):
        async with journal.write() as tx:
            await resolve_job(tx, job_id, "abandon", reason="  ")
    assert (await state_of(journal, job_id))["state"] == "AMBIGUOUS"


async def test_only_an_ambiguous_job_is_resolved(journal: Journal) -> None:
    job_id = await new_job(journal)  # RUNNING: its trainer call may be under way
    with pytest.raises(JobStateRefused) as info:
        async with journal.write() as tx:
            await resolve_job(tx, job_id, "abandon", reason="impatient")
    assert (info.value.state, info.value.allowed) == ("RUNNING", ("AMBIGUOUS",))
    assert (await state_of(journal, job_id))["state"] == "RUNNING"
