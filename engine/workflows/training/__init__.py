"""The training family: jobs run exactly once on a trainer and their weights published to the
inference engines behind a commit gate (docs/training.md).

Its modules: ``identity`` (job ids, runtime load ids), ``jobs`` (submission), ``operator`` (the
operator's acknowledge, reject and resolve), ``controller`` (training), ``publication``,
``commit_gate`` (who decides a candidate's head commit: auto, acknowledge, evaluate), ``engine_gate``,
``trainer_host``, ``wiring`` (building it all from the settings), ``api`` and ``cli``. The names
below are the family's public API.
"""

from engine.workflows.training.identity import (IDENTITY_EXCLUDED, LoadId, LoadIdError, TrainingPayloadError, canonical,
                                               job_identity)
from engine.workflows.training.jobs import JobClosed, JobConflict, Submission, in_flight, submit_job
from engine.workflows.training.operator import (InvalidDecision, JobNotFound, JobStateRefused, VerdictRecorded,
                                               acknowledge_job, reject_job, resolve_job)

__all__ = ["IDENTITY_EXCLUDED", "InvalidDecision", "JobClosed", "JobConflict", "JobNotFound", "JobStateRefused",
           "LoadId", "LoadIdError", "Submission", "TrainingPayloadError", "canonical", "in_flight", "job_identity",
           "VerdictRecorded", "acknowledge_job", "reject_job", "resolve_job", "submit_job"]
