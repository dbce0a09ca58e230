"""The job model: what a batch of scored rollouts must look like, and how bad input is named."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from tests.workers.trainer.jobs import make_job
from workers.policy import VOCAB, encode
from workers.trainer import JobError, TrainingJob, parse_job


def test_text_and_token_ids_both_parse_and_extra_keys_are_ignored() -> None:
    job = parse_job({"job_id": "j", "batch_id": 4, "rollouts": [
        {"prompt": "ab", "completion": [0, 1], "reward": 1},
        {"prompt": [3], "completion": "c d", "reward": -0.5}]}, VOCAB)
    assert job.rollouts[0].prompt == encode("ab") and job.rollouts[1].completion == [2, 26, 3]
    assert job.rollouts[0].reward == 1.0
    assert parse_job(job, VOCAB) is job


@pytest.mark.parametrize(("edit", "field"), [
    (lambda j: j.update(job_id=""), "job_id"),
    (lambda j: j.pop("job_id"), "job_id"),
    (lambda j: j.update(rollouts=[]), "rollouts"),
    (lambda j: j["rollouts"][1].update(reward=float("inf")), "rollouts[1].reward"),
    (lambda j: j["rollouts"][1].update(reward="1.0"), "rollouts[1].reward"),
    (lambda j: j["rollouts"][0].update(prompt=""), "rollouts[0].prompt"),
    (lambda j: j["rollouts"][3].update(completion=[1, True]), "rollouts[3].completion[1]"),
    (lambda j: j["rollouts"][2].update(completion=[-1]), "rollouts[2].completion[0]"),
    (lambda j: j["rollouts"][0].update(score=1.0), "rollouts[0].score"),
])
def test_a_bad_job_names_the_field(edit: Any, field: str) -> None:
    job = make_job("j")
    edit(job)
    with pytest.raises(JobError) as caught:
        parse_job(job, VOCAB)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"job field {field}: ")


def test_a_job_must_be_a_mapping() -> None:
    with pytest.raises(JobError, match="must be a mapping"):
        parse_job(["j"], VOCAB)  # type: ignore[arg-type]


def test_job_errors_pickle_with_their_fields() -> None:
    error = pickle.loads(pickle.dumps(JobError("rollouts[0].reward", "x", "must be a number")))
    assert (error.field, error.value, error.rule) == ("rollouts[0].reward", "x", "must be a number")


def test_the_model_is_frozen() -> None:
    job = TrainingJob.model_validate(make_job("j"))
    with pytest.raises(ValueError):
        job.job_id = "k"  # type: ignore[misc]
