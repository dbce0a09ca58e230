"""Training jobs and commit-gated publication (issue 6, in progress): see docs/training.md."""

from .identity import IDENTITY_EXCLUDED, LoadId, LoadIdError, TrainingPayloadError, canonical, job_identity

__all__ = ["IDENTITY_EXCLUDED", "LoadId", "LoadIdError", "TrainingPayloadError", "canonical", "job_identity"]
