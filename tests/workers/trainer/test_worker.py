"""The trainer rank: bitwise-deterministic steps, checkpoints that resume exactly, the step record."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers.trainer.jobs import make_job
from workers.trainer import (
    JobError,
    Trainer,
    TrainerStateError,
    read_checkpoint,
    read_step_record,
)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_two_trainers_from_the_same_start_hold_bitwise_identical_weights() -> None:
    first, second = Trainer(seed=3), Trainer(seed=3)
    initial = first.weights_digest()
    assert initial == second.weights_digest()
    metrics = [(first.train(make_job(f"j{i}", i)), second.train(make_job(f"j{i}", i))) for i in range(3)]
    for a, b in metrics:
        assert a == b
    assert first.weights_digest() == second.weights_digest() != initial
    for name, tensor in _weights(first).items():
        assert torch.equal(tensor, second.model.state_dict()[name]), name
    assert first.step == 3 and first.last_job_id == "j2"


def test_a_different_batch_gives_different_weights() -> None:
    first, second = Trainer(), Trainer()
    first.train(make_job("j0", 0))
    second.train(make_job("j0", 1))
    assert first.weights_digest() != second.weights_digest()


def test_checkpoint_saved_and_loaded_gives_the_same_next_step(tmp_path: Path) -> None:
    original = Trainer(seed=0)
    original.train(make_job("j1", 1))
    info = original.save_checkpoint(str(tmp_path / "ckpt.bin"), "j1")
    assert (info["job_id"], info["step"]) == ("j1", 1)
    original.train(make_job("j2", 2))

    restored = Trainer(seed=9)  # a different start: everything must come from the checkpoint
    assert restored.load_checkpoint(str(tmp_path / "ckpt.bin"))["job_id"] == "j1"
    assert (restored.step, restored.last_job_id) == (1, "j1")
    restored.train(make_job("j2", 2))
    assert restored.weights_digest() == original.weights_digest()
    assert restored.step == original.step == 2

    # The optimizer state is part of it: the same model weights with a fresh Adam diverge.
    _, payload = read_checkpoint(tmp_path / "ckpt.bin")
    weights_only = Trainer(seed=0)
    weights_only.model.load_state_dict(payload["model"])
    weights_only.train(make_job("j2", 2))
    assert weights_only.weights_digest() != original.weights_digest()


def test_a_job_is_never_applied_twice(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train(make_job("j1"))
    trainer.save_checkpoint(str(tmp_path / "c"), "j1")
    before = trainer.weights_digest()
    with pytest.raises(TrainerStateError, match="'j1' was already applied at step 1"):
        trainer.train(make_job("j1"))
    assert trainer.weights_digest() == before and trainer.step == 1

    restored = Trainer()
    restored.load_checkpoint(str(tmp_path / "c"))
    with pytest.raises(TrainerStateError, match="already applied"):
        restored.train(make_job("j1"))


def test_a_checkpoint_names_only_the_job_of_the_latest_step(tmp_path: Path) -> None:
    trainer = Trainer()
    with pytest.raises(TrainerStateError, match="no optimizer step has been taken"):
        trainer.save_checkpoint(str(tmp_path / "c"), "j1")
    trainer.train(make_job("j1"))
    with pytest.raises(TrainerStateError, match="'j2' is not the job of step 1"):
        trainer.save_checkpoint(str(tmp_path / "c"), "j2")
    assert not (tmp_path / "c").exists()


def test_a_bad_job_names_its_field_and_changes_nothing(tmp_path: Path) -> None:
    trainer = Trainer(state_dir=str(tmp_path))
    before = trainer.weights_digest()
    job = make_job("j1")
    job["rollouts"][2]["completion"] = [1, 27]
    with pytest.raises(JobError) as caught:
        trainer.train(job)
    assert caught.value.field == "rollouts[2].completion[1]" and caught.value.value == 27
    assert trainer.weights_digest() == before and trainer.step == 0
    assert read_step_record(tmp_path) is None  # validation failed before any evidence was written


def test_the_step_record_brackets_every_step_and_load(tmp_path: Path) -> None:
    trainer = Trainer(state_dir=str(tmp_path / "state"))
    assert read_step_record(tmp_path / "state") is None
    trainer.train(make_job("j1"))
    record = read_step_record(tmp_path / "state")
    assert record is not None and (record.step, record.job_id, record.phase) == (1, "j1", "applied")
    assert record.names("j1") and not record.names("j2")
    trainer.save_checkpoint(str(tmp_path / "c"), "j1")

    other = Trainer(state_dir=str(tmp_path / "other"))
    other.load_checkpoint(str(tmp_path / "c"))
    loaded = read_step_record(tmp_path / "other")
    assert loaded is not None and (loaded.step, loaded.job_id, loaded.phase) == (1, "j1", "loaded")
    assert trainer.health()["step_record"]["phase"] == "applied"


def test_a_step_that_dies_midway_leaves_a_started_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(state_dir=str(tmp_path))

    # Fault injection: a real optimizer cannot be made to crash on demand, so its step raises here.
    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(trainer.optimizer, "step", crash)
    with pytest.raises(RuntimeError, match="device lost"):
        trainer.train(make_job("j1"))
    record = read_step_record(tmp_path)
    assert record is not None and (record.step, record.job_id, record.phase) == (1, "j1", "started")
    assert trainer.step == 0 and trainer.last_job_id is None
    # The weights may hold part of j1's step: the trainer says so, and will not call them initial.
    assert trainer.health()["in_doubt"] == "j1"
    with pytest.raises(TrainerStateError, match="'j1'.s step began and did not finish"):
        trainer.declare_initial()
    assert read_step_record(tmp_path) == record  # the evidence is left as it was


def test_declare_initial_names_no_job_and_only_on_initial_weights(tmp_path: Path) -> None:
    fresh = Trainer(state_dir=str(tmp_path / "a"))
    assert fresh.declare_initial()["step"] == 0
    record = read_step_record(tmp_path / "a")
    assert record is not None and (record.step, record.job_id, record.phase) == (0, "initial", "loaded")
    fresh.train(make_job("j1"))
    with pytest.raises(TrainerStateError, match="step 1"):
        fresh.declare_initial()
    # A loaded checkpoint replaces weights that were in doubt.
    path = str(tmp_path / "j1.ckpt")
    fresh.save_checkpoint(path, "j1")
    other = Trainer(state_dir=str(tmp_path / "b"))

    def crash(*args: Any, **kwargs: Any) -> None:  # fault injection, as above
        raise RuntimeError("device lost")

    real = other.optimizer.step
    other.optimizer.step = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        other.train(make_job("j2"))
    other.optimizer.step = real  # type: ignore[method-assign]
    other.load_checkpoint(path)
    assert other.health()["in_doubt"] is None and other.health()["last_job_id"] == "j1"


def test_health_reports_the_rank_state() -> None:
    trainer = Trainer(device="cpu")
    trainer.train(make_job("j1"))
    health = trainer.health()
    assert health["ok"] is True and health["device"] == "cpu"
    assert (health["step"], health["last_job_id"], health["prepared_version"]) == (1, "j1", None)
    assert health["step_record"] is None


def test_determinism_flag_is_restored_after_a_step() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    Trainer().train(make_job("j1"))
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"lr": 0}, "lr"), ({"lr": float("nan")}, "lr"), ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"seed": -1}, "seed"), ({"seed": True}, "seed"), ({"vocab": 0}, "vocab"), ({"device": "tpu9"}, "device"),
])
def test_bad_constructor_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        Trainer(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_is_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="device: 'cuda'"):
        Trainer(device="cuda")
    assert Trainer().device.type == "cpu"


def _train_in_child(kwargs: dict[str, Any], jobs: list[dict[str, Any]]) -> str:
    import importlib

    module, _, name = "workers.trainer.worker:Trainer".partition(":")
    trainer = getattr(importlib.import_module(module), name)(**kwargs)
    for job in jobs:
        trainer.train(job)
    digest: str = trainer.weights_digest()
    return digest


def test_a_spawned_rank_built_from_its_import_path_trains_to_the_same_weights(tmp_path: Path) -> None:
    # The executors construct ranks this way: spawn, import "module:Class", plain kwargs.
    kwargs: dict[str, Any] = {"seed": 2, "lr": 0.1, "device": "cpu", "state_dir": str(tmp_path)}
    jobs = [make_job("j1", 1), make_job("j2", 2)]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(_train_in_child, (kwargs, jobs))
    local = Trainer(**{**kwargs, "state_dir": str(tmp_path / "local")})
    for job in jobs:
        local.train(job)
    assert child == local.weights_digest()
    record = read_step_record(tmp_path)
    assert record is not None and (record.step, record.job_id) == (2, "j2")
