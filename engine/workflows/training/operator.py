"""What an operator may do to a training job: acknowledge or reject a candidate, or settle an ambiguous job.

Both are one compare-and-set on the job's row with the operator's reason in its event; the
controllers do the rest (publication restores the committed head on rejection; the training
controller trains a job an operator says never ran). A refusal is typed and writes nothing.

- :func:`acknowledge_job`: a ``READY_TO_COMMIT`` candidate (engines verified, still paused) with no
  verdict yet → the operator's ``commit`` verdict recorded on it (a self-transition); the publisher's
  next look commits the head (engine/workflows/training/commit_gate.py). Acknowledging the same
  job again is refused (``verdict_recorded``), as is any job in another state.
- :func:`reject_job`: ``CHECKPOINT``, ``UPDATING_WEIGHTS`` or ``READY_TO_COMMIT`` →
  ``REJECTING``, with the operator's ``reject`` verdict. A job whose head is committed can no
  longer be rejected; an acknowledged one can, until its head commit.
- :func:`resolve_job`, for an ``AMBIGUOUS`` job only:

  - ``ran`` with ``checkpoint_path``: the step ran and that checkpoint holds it →
    ``CHECKPOINT`` (the checkpoint must be verified first: see the API);
  - ``not_run``: the step never ran on the weights the trainer holds → ``RUNNING``, and the
    training controller trains it once;
  - ``abandon``: neither can be shown and the batch is given up → ``FAILED``.
"""

from __future__ import annotations

from typing import Any, Literal

from journal import WriteTx
from journal.writes import Row

KIND = "training_jobs"
REJECTABLE = ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT")
Decision = Literal["ran", "not_run", "abandon"]
DECISIONS: tuple[str, ...] = ("ran", "not_run", "abandon")


class JobNotFound(LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no training job {job_id!r}")
        self.job_id = job_id


class JobStateRefused(Exception):
    """The job is not in a state the operation applies to."""

    def __init__(self, job_id: str, operation: str, state: str, allowed: tuple[str, ...]) -> None:
        super().__init__(f"job {job_id} is {state}; {operation} applies only to a job that is "
                         f"{' or '.join(allowed)}")
        self.job_id, self.operation, self.state, self.allowed = job_id, operation, state, allowed


class VerdictRecorded(Exception):
    """The candidate already has a verdict (an earlier acknowledgement): nothing is written again."""

    def __init__(self, job_id: str, verdict: dict[str, Any]) -> None:
        super().__init__(f"job {job_id} already has a verdict ({verdict.get('decision')} by {verdict.get('by')}: "
                         f"{verdict.get('reason')})")
        self.job_id, self.verdict = job_id, verdict


class InvalidDecision(ValueError):
    """A resolution that names an unknown decision or lacks what its decision needs."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field}: {value!r} {rule}")
        self.field, self.value, self.rule = field, value, rule


async def _job(tx: WriteTx, job_id: str) -> Row:
    row = await tx.get(KIND, job_id)
    if row is None:
        raise JobNotFound(job_id)
    return row


def _verdict(tx: WriteTx, decision: str, reason: str) -> dict[str, Any]:
    return {"decision": decision, "by": "operator", "reason": reason[:500], "metrics": {}, "at": tx.now.isoformat()}


async def acknowledge_job(tx: WriteTx, job_id: str, *, reason: str) -> Row:
    """Record the operator's ``commit`` verdict on a ``READY_TO_COMMIT`` job (see the module docs);
    returns the row as it was."""
    if not reason.strip():
        raise InvalidDecision("reason", reason, "must say why")
    row = await _job(tx, job_id)
    if row.state != "READY_TO_COMMIT":
        raise JobStateRefused(job_id, "acknowledge", row.state, ("READY_TO_COMMIT",))
    if row["verdict"] is not None:
        raise VerdictRecorded(job_id, row["verdict"])
    await tx.transition(KIND, job_id, from_state=row.state, version=row.version, to_state="READY_TO_COMMIT",
                        reason=f"acknowledged by an operator: {reason}"[:200],
                        changes={"verdict": _verdict(tx, "commit", reason), "detail": None})
    return row


async def reject_job(tx: WriteTx, job_id: str, *, reason: str) -> Row:
    """Move the job to ``REJECTING`` (see the module docs); returns the row as it was."""
    if not reason.strip():
        raise InvalidDecision("reason", reason, "must say why")
    row = await _job(tx, job_id)
    if row.state not in REJECTABLE:
        raise JobStateRefused(job_id, "reject", row.state, REJECTABLE)
    await tx.transition(KIND, job_id, from_state=row.state, version=row.version, to_state="REJECTING",
                        reason=f"rejected by an operator: {reason}"[:200],
                        changes={"detail": reason, "verdict": _verdict(tx, "reject", reason)})
    return row


async def resolve_job(tx: WriteTx, job_id: str, decision: str, *, reason: str,
                      checkpoint_path: str | None = None, verified_step: int | None = None) -> Row:
    """Settle an ``AMBIGUOUS`` job as the operator decided (see the module docs); returns the row as it was."""
    if decision not in DECISIONS:
        raise InvalidDecision("decision", decision, f"must be one of {', '.join(DECISIONS)}")
    if not reason.strip():
        raise InvalidDecision("reason", reason, "must say why")
    if decision == "ran" and not checkpoint_path:
        raise InvalidDecision("checkpoint_path", checkpoint_path, "is required when the step ran")
    if decision != "ran" and checkpoint_path is not None:
        raise InvalidDecision("checkpoint_path", checkpoint_path, f"applies only to 'ran', not {decision!r}")
    row = await _job(tx, job_id)
    if row.state != "AMBIGUOUS":
        raise JobStateRefused(job_id, "resolve", row.state, ("AMBIGUOUS",))
    said = f"resolved by an operator ({decision}): {reason}"[:200]
    if decision == "ran":
        await tx.transition(KIND, job_id, from_state="AMBIGUOUS", version=row.version, to_state="CHECKPOINT",
                            reason=said, changes={"checkpoint_path": checkpoint_path, "ambiguity": None, "detail": None,
                                                  "metrics": {"settled_from": "operator", "reason": reason,
                                                              "step": verified_step}})
    elif decision == "not_run":
        await tx.transition(KIND, job_id, from_state="AMBIGUOUS", version=row.version, to_state="RUNNING",
                            reason=said, changes={"ambiguity": None})
    else:
        await tx.transition(KIND, job_id, from_state="AMBIGUOUS", version=row.version, to_state="FAILED",
                            reason=said, changes={"detail": f"abandoned by an operator: {reason}"})
    return row


__all__ = ["DECISIONS", "REJECTABLE", "InvalidDecision", "JobNotFound", "JobStateRefused", "VerdictRecorded",
           "acknowledge_job", "reject_job", "resolve_job"]
