"""The training rows (issue 6): at most one job in flight per deployment, enforced by the
database itself, and refused with a typed error on both backends."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from journal import ConstraintViolation, Create, IllegalTransition, Journal, Transition, audit, models

JOBS = "training_jobs"


def job(job_id: str, deployment: str = "dep-a", **values: object) -> Create:
    return Create(JOBS, job_id, "job submitted", {"deployment": deployment, "payload": {"batch": job_id},
                                                  "scenario_step": 1, **values})


def moves(job_id: str, *states: str) -> list[Transition]:
    """The transitions taking a new job through ``states`` in order (its version counted)."""
    out, state = [], "RUNNING"
    for version, to in enumerate(states, start=1):
        out.append(Transition(JOBS, job_id, state, version, to, f"to {to}"))
        state = to
    return out


async def count(journal: Journal, table: sa.Table) -> int:
    async with journal.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar() or 0)


async def test_a_second_job_in_flight_for_a_deployment_is_refused_by_the_database(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create(JOBS, "job-1", reason="submitted", values=job("job-1").values)
    events_before = await count(journal, models.events)
    for if_absent in (False, True):  # "create if absent" must not swallow it either
        with pytest.raises(ConstraintViolation) as info:
            async with journal.write() as tx:
                await tx.create(JOBS, "job-2", reason="submitted", values=job("job-2").values, if_absent=if_absent)
        assert info.value.entity_id == "job-2" and "ux_training_jobs_in_flight" in str(info.value)
    assert await count(journal, models.training_jobs) == 1 and await count(journal, models.events) == events_before
    # Another deployment is independent.
    async with journal.write() as tx:
        await tx.create(JOBS, "job-b", reason="submitted", values=job("job-b", "dep-b").values)
    # Once the first job is settled (terminal), the deployment takes a new one.
    await journal.apply([[op] for op in moves("job-1", "CHECKPOINT", "REJECTING", "REJECTED")])
    async with journal.write() as tx:
        await tx.create(JOBS, "job-2", reason="submitted", values=job("job-2").values)
    assert await audit.verify(journal) == []


async def test_a_refused_job_in_a_batch_fails_alone(journal: Journal) -> None:
    await journal.apply([[job("job-1")]])
    out = await journal.apply([[job("job-2")], [job("job-c", "dep-c")], [job("job-3")]])
    assert isinstance(out[0], ConstraintViolation) and isinstance(out[2], ConstraintViolation)
    assert isinstance(out[1], list) and out[1][0] is not None and out[1][0].entity_id == "job-c"
    # In a run of creates (one statement / executemany) the refused one is found and named too;
    # the transaction then rolls back whole.
    with pytest.raises(ConstraintViolation) as info:
        async with journal.write() as tx:
            await tx.apply([job(f"job-d{i}", f"dep-d{i}") for i in range(4)] + [job("job-4")])
    assert info.value.entity_id == "job-4"
    assert await count(journal, models.training_jobs) == 2
    assert await audit.verify(journal) == []


async def test_the_job_machine_follows_the_publication_order(journal: Journal) -> None:
    await journal.apply([[job("job-1")]])
    with pytest.raises(IllegalTransition):  # weights are never sent before the checkpoint is recorded
        async with journal.write() as tx:
            await tx.transition(JOBS, "job-1", from_state="RUNNING", version=1, to_state="UPDATING_WEIGHTS",
                                reason="too early")
    out = await journal.apply([[op] for op in moves("job-1", "CHECKPOINT", "UPDATING_WEIGHTS", "UPDATING_WEIGHTS",
                                                    "READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE")])
    assert all(isinstance(o, list) for o in out), out
    async with journal.read() as conn:
        t = models.training_jobs
        assert (await conn.execute(sa.select(t.c.state, t.c.version))).one() == ("COMPLETE", 7)
    assert await audit.verify(journal) == []
