"""Training jobs and commit-gated publication (issue 6, in progress): see docs/training.md."""

from .identity import IDENTITY_EXCLUDED, LoadId, LoadIdError, TrainingPayloadError, canonical, job_identity
from .jobs import JobClosed, JobConflict, Submission, in_flight, submit_job

__all__ = ["IDENTITY_EXCLUDED", "JobClosed", "JobConflict", "LoadId", "LoadIdError", "Submission",
           "TrainingPayloadError", "canonical", "in_flight", "job_identity", "submit_job"]
