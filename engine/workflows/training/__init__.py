"""Training jobs and commit-gated publication (issue 6, in progress): see docs/training.md."""

from engine.workflows.training.identity import (IDENTITY_EXCLUDED, LoadId, LoadIdError, TrainingPayloadError, canonical, job_identity)
from engine.workflows.training.jobs import JobClosed, JobConflict, Submission, in_flight, submit_job
from engine.workflows.training.operator import InvalidDecision, JobNotFound, JobStateRefused, reject_job, resolve_job

__all__ = ["IDENTITY_EXCLUDED", "InvalidDecision", "JobClosed", "JobConflict", "JobNotFound", "JobStateRefused",
           "LoadId", "LoadIdError", "Submission", "TrainingPayloadError", "canonical", "in_flight", "job_identity",
           "reject_job", "resolve_job", "submit_job"]
