"""Submitting a training job: the same batch is trained once, and one job at a time per deployment.

:func:`submit_job` runs inside a write transaction. It validates the payload, computes the
job's identity (:func:`~engine.workflows.training.identity.job_identity`) and decides against what the
journal holds:

======================================  =========================================================
the journal holds                       outcome
======================================  =========================================================
nothing for this identity               a new ``RUNNING`` row (``new``), unless another job of the
                                        deployment is in flight: :class:`JobConflict`
the same job, ``READY_TO_COMMIT``,      ``replay``: its recorded result, nothing trains again
``HEAD_COMMITTED`` or ``COMPLETE``
the same job, ``CHECKPOINT``            ``resume``: only its publication remains
the same job, ``RUNNING``,              ``in_progress``: it is already out; nothing new starts
``AMBIGUOUS``, ``UPDATING_WEIGHTS``
or ``REJECTING``
the same job, ``REJECTED`` or           :class:`JobClosed`: a settled job is not trained again
``FAILED``                              under the same identity
======================================  =========================================================

A new row is ``RUNNING`` as soon as it commits: the trainer is only ever called for a job whose
``RUNNING`` row is durable. The database's partial unique index is the backstop for the
one-in-flight rule; a race that reaches it is reported as the same :class:`JobConflict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from journal import ConstraintViolation, WriteTx, models
from journal.writes import Row, to_row

from engine.workflows.training.identity import LoadId, LoadIdError, TrainingPayloadError, canonical, job_identity

KIND = "training_jobs"
Disposition = Literal["new", "replay", "resume", "in_progress"]

_REPLAY = ("READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE")
_IN_PROGRESS = ("RUNNING", "AMBIGUOUS", "UPDATING_WEIGHTS", "REJECTING")


class JobConflict(Exception):
    """Another job of the deployment is in flight; both ids are named."""

    def __init__(self, deployment: str, in_flight: str, state: str, submitted: str) -> None:
        super().__init__(f"deployment {deployment!r} already has job {in_flight} in flight ({state}); "
                         f"job {submitted} is refused until it is settled")
        self.deployment, self.in_flight, self.state, self.submitted = deployment, in_flight, state, submitted


class JobClosed(Exception):
    """The job was settled without being published (``REJECTED`` or ``FAILED``)."""

    def __init__(self, job_id: str, state: str, detail: str | None) -> None:
        super().__init__(f"job {job_id} is {state}" + (f" ({detail})" if detail else "")
                         + "; a settled job is not trained again under the same identity (to train the "
                         "batch again, submit it with another payload field, such as \"retry\": 2: a new job)")
        self.job_id, self.state, self.detail = job_id, state, detail


@dataclass(frozen=True)
class Submission:
    job_id: str
    disposition: Disposition
    row: Row


def _check_payload(deployment: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns from a valid submission; raises :class:`TrainingPayloadError` by field."""
    if not isinstance(deployment, str) or not deployment or len(deployment) > 255:
        raise TrainingPayloadError("deployment", deployment, "must be a non-empty string of at most 255 characters")
    canonical(payload)  # refuses what JSON cannot hold, by field
    step = payload.get("scenario_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TrainingPayloadError("payload.scenario_step", step, "must be an integer >= 0")
    batch = payload.get("batch_number")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 0):
        raise TrainingPayloadError("payload.batch_number", batch, "must be an integer >= 0 when given")
    base = payload.get("base_version")
    if base is not None:
        try:
            LoadId.parse(base)
        except LoadIdError as exc:
            raise TrainingPayloadError("payload.base_version", base, f"must be a runtime load id ({exc.rule})") from None
    return {"deployment": deployment, "payload": dict(payload), "scenario_step": step, "batch_number": batch,
            "base_version": base}


async def in_flight(tx: WriteTx, deployment: str) -> Row | None:
    """The deployment's job in flight, if any (there is at most one)."""
    t = models.training_jobs
    found = (await tx.execute(sa.select(t).where(t.c.deployment == deployment,
                                                 t.c.state.in_(models.TRAINING_IN_FLIGHT)))).first()
    return None if found is None else to_row(KIND, found._mapping)


async def submit_job(tx: WriteTx, deployment: str, payload: Mapping[str, Any], *,
                     trainer_step: int | None = None) -> Submission:
    """Record a job for ``deployment`` or find it recorded (see the module docs).

    ``trainer_step`` is the trainer's persisted step counter as last seen, kept as evidence.
    Raises :class:`TrainingPayloadError` (bad input, nothing written), :class:`JobConflict`,
    :class:`JobClosed`.
    """
    values = _check_payload(deployment, payload)
    job_id = job_identity(payload)
    existing = await tx.get(KIND, job_id)
    if existing is not None:
        if existing["deployment"] != deployment:
            raise TrainingPayloadError("deployment", deployment,
                                       f"does not match job {job_id}'s deployment {existing['deployment']!r}")
        if existing.state in _REPLAY:
            return Submission(job_id, "replay", existing)
        if existing.state == "CHECKPOINT":
            return Submission(job_id, "resume", existing)
        if existing.state in _IN_PROGRESS:
            return Submission(job_id, "in_progress", existing)
        raise JobClosed(job_id, existing.state, existing["detail"])
    other = await in_flight(tx, deployment)
    if other is not None:
        raise JobConflict(deployment, other.id, other.state, job_id)
    try:
        await tx.create(KIND, job_id, reason=f"job submitted (scenario step {values['scenario_step']})",
                        values={**values, "trainer_step": trainer_step})
    except ConstraintViolation:  # the journal leaves the transaction usable
        # Only a writer racing this one gets here: report the job that won.
        other = await in_flight(tx, deployment)
        raise JobConflict(deployment, other.id if other else "(unknown)", other.state if other else "?",
                          job_id) from None
    row = await tx.get(KIND, job_id)
    assert row is not None
    return Submission(job_id, "new", row)


__all__ = ["JobClosed", "JobConflict", "Submission", "in_flight", "submit_job"]
