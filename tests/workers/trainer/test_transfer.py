"""Weights out of the trainer: written in the shared format, loaded by receivers, guarded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.trainer.jobs import make_job
from workers.policy import MODEL_FILE, Policy, load_weights
from workers.trainer import TargetError, Trainer, TrainerStateError, WeightsTarget


class PolicyReceiver:
    """A real receiver: a policy that loads a weights directory, as an engine's reload does."""

    def __init__(self) -> None:
        self.policy = Policy(seed=5)
        self.version: str | None = None

    def load_weights(self, path: str) -> None:
        state, meta = load_weights(path)
        self.policy.load_state_dict(state)
        self.version = meta["version"]


def test_prepared_weights_load_into_a_receiver_bit_for_bit(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train(make_job("j1"))
    target = {"version": "run:1", "directory": str(tmp_path / "v1")}
    prepared = trainer.prepare_weights(target)
    assert (prepared["version"], prepared["step"]) == ("run:1", 1)
    assert load_weights(tmp_path / "v1")[1]["sha256"] == prepared["sha256"]

    receiver, paths = PolicyReceiver(), list[str]()
    sent = trainer.send_weights(target, [receiver, paths.append])
    assert sent == {"version": "run:1", "directory": str(tmp_path / "v1"), "receivers": 2}
    assert paths == [str(tmp_path / "v1")] and receiver.version == "run:1"
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, receiver.policy.state_dict()[name]), name
    prompt = [0, 1]
    assert receiver.policy.generate(prompt, 8) == trainer.model.generate(prompt, 8)
    assert trainer.health()["prepared_version"] == "run:1"


def test_weights_must_be_prepared_before_they_are_sent(tmp_path: Path) -> None:
    trainer = Trainer()
    receiver = PolicyReceiver()
    with pytest.raises(TrainerStateError, match="call prepare_weights first"):
        trainer.send_weights({"version": "v1", "directory": str(tmp_path)}, [receiver])
    trainer.prepare_weights(WeightsTarget("v1", str(tmp_path)))
    with pytest.raises(TrainerStateError, match="'v2'"):
        trainer.send_weights(WeightsTarget("v2", str(tmp_path)), [receiver])
    (tmp_path / MODEL_FILE).write_bytes(b"damaged")
    with pytest.raises(TrainerStateError, match="are not prepared"):
        trainer.send_weights(WeightsTarget("v1", str(tmp_path)), [receiver])
    assert receiver.version is None


def test_an_async_receiver_is_refused(tmp_path: Path) -> None:
    trainer = Trainer()
    target = WeightsTarget("v1", str(tmp_path))
    trainer.prepare_weights(target)

    async def receiver(path: str) -> None:
        return None

    with pytest.raises(TargetError, match=r"receivers\[0\].*returned an awaitable"):
        trainer.send_weights(target, [receiver])
    with pytest.raises(TargetError, match=r"receivers\[0\].*must have load_weights"):
        trainer.send_weights(target, [42])  # type: ignore[list-item]


@pytest.mark.parametrize(("target", "field"), [
    ({"version": "", "directory": "/tmp/x"}, "version"),
    ({"version": "v", "directory": None}, "directory"),
    ({"version": "v", "directory": "/tmp/x", "extra": 1}, "extra"),
    ("v1", "target"),
])
def test_a_bad_target_names_the_field(target: object, field: str) -> None:
    with pytest.raises(TargetError) as caught:
        Trainer().prepare_weights(target)  # type: ignore[arg-type]
    assert caught.value.field == field
