"""The training job the trainer takes one optimizer step on.

A job is a plain mapping (or a :class:`TrainingJob`) with a non-empty ``job_id`` and a
non-empty batch ``rollouts`` of scored rollouts. Each rollout of the reference task is a
``prompt`` and the ``completion`` the policy produced for it — token ids, or text that
:func:`workers.policy.encode` turns into ids — and a finite ``reward`` (and, from a batch of the
journal's rollouts, its ``rollout_id`` and ``weight_version``, which the step does not use). Other keys of the
mapping (``scenario_step``, ``batch_id``, …) are accepted and ignored, so the orchestrator
can pass its payload as it stored it.

:func:`parse_job` validates and raises :class:`~workers.trainer.errors.JobError` naming the
first bad field (as a path such as ``rollouts[2].completion[1]``), its value and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, ValidationError, field_validator

from workers.policy import encode
from workers.trainer.errors import JobError

#: Most rollouts a job may carry; a guard against a mis-packed batch exhausting memory.
MAX_ROLLOUTS = 4096
#: Most tokens in one prompt or completion.
MAX_TOKENS = 4096


def _tokens(value: Any) -> Any:
    # Text is the reference task's natural form; token ids are what a real pipeline sends.
    return encode(value) if isinstance(value, str) else value


class ScoredRollout(BaseModel):
    """One rollout: the prompt, the completion generated for it, and its reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)
    completion: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)
    reward: float = Field(strict=True, allow_inf_nan=False)
    #: Where a batch of journal rollouts came from (``workers.reference.samples``): carried, not used.
    rollout_id: str | None = None
    weight_version: str | None = None

    _to_ids = field_validator("prompt", "completion", mode="before")(_tokens)


class TrainingJob(BaseModel):
    """A batch of scored rollouts under one job id (see the module docs)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    job_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    rollouts: list[ScoredRollout] = Field(min_length=1, max_length=MAX_ROLLOUTS)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "job"


def parse_job(job: TrainingJob | Mapping[str, Any], vocab: int) -> TrainingJob:
    """``job`` validated, with every token id in ``[0, vocab)``; raises :class:`JobError`."""
    if isinstance(job, TrainingJob):
        parsed = job
    else:
        if not isinstance(job, Mapping):
            raise JobError("job", job, "must be a mapping or a TrainingJob")
        try:
            parsed = TrainingJob.model_validate(dict(job))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise JobError(_field_path(tuple(first["loc"])), first.get("input"), first["msg"]) from None
    for index, rollout in enumerate(parsed.rollouts):
        for name in ("prompt", "completion"):
            for position, token in enumerate(getattr(rollout, name)):
                if not 0 <= token < vocab:
                    raise JobError(f"rollouts[{index}].{name}[{position}]", token,
                                   f"token ids must lie in [0, {vocab})")
        if not math.isfinite(rollout.reward):  # pydantic refuses it already; kept for model_construct
            raise JobError(f"rollouts[{index}].reward", rollout.reward, "must be finite")
    return parsed


__all__ = ["MAX_ROLLOUTS", "MAX_TOKENS", "ScoredRollout", "TrainingJob", "parse_job"]
