"""Helpers of the training-workflow tests: jobs of the reference task, and reading their rows."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa

from engine.workflows.training import submit_job
from journal import Journal, models
from tests.workers.trainer.jobs import make_job


def payload(salt: int = 0) -> dict[str, Any]:
    """A batch of the reference task (``salt`` varies it), without a job id: the orchestrator
    names a job by its identity."""
    job = make_job("unused", salt)
    del job["job_id"]
    job["scenario_step"] = salt
    return job


async def submit(journal: Journal, job: dict[str, Any], deployment: str = "dep") -> str:
    async with journal.write() as tx:
        return (await submit_job(tx, deployment, job, trainer_step=0)).job_id


async def job_row(journal: Journal, job_id: str) -> dict[str, Any]:
    t = models.training_jobs
    async with journal.read() as conn:
        return dict((await conn.execute(sa.select(t).where(t.c.id == job_id))).one()._mapping)


async def until_state(journal: Journal, job_id: str, *states: str, timeout: float = 120) -> dict[str, Any]:
    """Poll the job until it is in one of ``states`` (``timeout`` is a safety net, not a measure)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        row = await job_row(journal, job_id)
        if row["state"] in states:
            return row
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"job {job_id[:12]} is {row['state']} ({row['detail'] or row['ambiguity']}), "
                                 f"not {states}")
        await asyncio.sleep(0.05)


async def edges(journal: Journal, job_id: str) -> list[tuple[str | None, str]]:
    """The job's transitions, in order."""
    e = models.events
    async with journal.read() as conn:
        return [(r.from_state, r.to_state) for r in (await conn.execute(
            sa.select(e.c.from_state, e.c.to_state).where(e.c.entity_kind == "training_jobs", e.c.entity_id == job_id)
            .order_by(e.c.seq))).all()]


async def versions(journal: Journal) -> dict[str, tuple[str, str | None]]:
    """Every weight version: id -> (state, job id)."""
    t = models.weight_versions
    async with journal.read() as conn:
        return {r.id: (r.state, r.job_id) for r in (await conn.execute(sa.select(t))).all()}
