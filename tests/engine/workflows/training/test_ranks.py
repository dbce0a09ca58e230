"""A trainer of several ranks as the training controller drives it (engine/workflows/training/controller.py):
the calls that change what a rank holds go to every rank; a refusal counts only when every rank
refused (a rank that stepped while another refused is the group's failure, never a FAILED job);
ranks that disagree on their step make the trainer's health ``in_doubt``. Real trainer objects in
ranks of the custom executor defined in the tests (tests/support/own_executor.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.workflows.training.controller import TrainingController, TrainingSettings
from tests.support.own_trainer import RefusingTrainer, SgdTrainer
from tests.support.own_executor import ThreadRanksExecutor
from tests.support.training import payload
from workers.executor import ExecutorConfig, WorkerSpec
from workers.trainer.errors import JobError


def ranks(tmp_path: Path, *classes: type) -> ThreadRanksExecutor:
    specs = tuple(WorkerSpec(c, kwargs={"state_dir": str(tmp_path / f"rank-{i}")}) for i, c in enumerate(classes))
    return ThreadRanksExecutor(ExecutorConfig(backend=ThreadRanksExecutor, workers=specs))


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[TrainingController, ThreadRanksExecutor]]:
    ex = ranks(tmp_path, SgdTrainer, RefusingTrainer)
    try:
        yield TrainingController(ex, TrainingSettings(str(tmp_path / "ckpt"), ranks=2)), ex
    finally:
        ex.shutdown()


async def test_a_refusal_by_some_ranks_is_the_groups_failure_and_leaves_the_ranks_in_doubt(
        controller: tuple[TrainingController, ThreadRanksExecutor]) -> None:
    ctl, ex = controller
    job = {**payload(1), "job_id": "a" * 64}
    with pytest.raises(RuntimeError, match="train failed on 1 of 2 ranks") as failed:
        await ctl._call("train", job)
    assert not isinstance(failed.value, JobError)  # rank 0 stepped: the job must not be FAILED
    assert ex.rpc(0, "health")["step"] == 1 and ex.rpc(1, "health")["step"] == 0
    health = await ctl._health()
    assert health["step"] == 1 and str(health["in_doubt"]).startswith("ranks disagree")


async def test_a_refusal_by_every_rank_is_a_refusal(tmp_path: Path) -> None:
    ex = ranks(tmp_path, RefusingTrainer, RefusingTrainer)
    try:
        ctl = TrainingController(ex, TrainingSettings(str(tmp_path / "ckpt"), ranks=2))
        with pytest.raises(JobError):
            await ctl._call("train", {**payload(1), "job_id": "b" * 64})
        health = await ctl._health()
        assert health["step"] == 0 and health["in_doubt"] is None  # the ranks agree: nothing stepped
    finally:
        ex.shutdown()
