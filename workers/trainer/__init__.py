"""The trainer worker: the torch rank that executors run for training jobs.

See :mod:`workers.trainer.worker` for the :class:`Trainer` contract, and the sibling modules
for the job model, the loss, checkpoints, the step record and weight transfer.
"""

from workers.trainer.checkpoint import CheckpointInfo, read_checkpoint, verify_checkpoint, write_checkpoint
from workers.trainer.errors import (
    CheckpointError,
    JobError,
    StepRecordError,
    TargetError,
    TrainerError,
    TrainerStateError,
)
from workers.trainer.job import ScoredRollout, TrainingJob, parse_job
from workers.trainer.steps import StepRecord, read_step_record, write_step_record
from workers.trainer.transfer import WeightsReceiver, WeightsTarget
from workers.trainer.worker import Trainer

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "JobError",
    "ScoredRollout",
    "StepRecord",
    "StepRecordError",
    "TargetError",
    "Trainer",
    "TrainerError",
    "TrainerStateError",
    "TrainingJob",
    "WeightsReceiver",
    "WeightsTarget",
    "parse_job",
    "read_checkpoint",
    "read_step_record",
    "verify_checkpoint",
    "write_checkpoint",
    "write_step_record",
]
