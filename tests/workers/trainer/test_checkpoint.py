"""Checkpoint files: verified end to end, and every kind of damage refused by name."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.workers.trainer.jobs import make_job
from workers.trainer import CheckpointError, Trainer, verify_checkpoint


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Trainer, Path]:
    trainer = Trainer()
    trainer.train(make_job("job-7"))
    path = tmp_path / "ckpt" / "model.ckpt"  # a missing parent is created
    trainer.save_checkpoint(str(path), "job-7")
    return trainer, path


def _split(path: Path) -> tuple[dict[str, object], bytes]:
    data = path.read_bytes()
    end = data.index(b"\n")
    return json.loads(data[:end]), data[end + 1:]


def test_a_saved_checkpoint_verifies_with_its_job_and_step(saved: tuple[Trainer, Path]) -> None:
    trainer, path = saved
    info = verify_checkpoint(path)
    header, payload = _split(path)
    assert (info.job_id, info.step, info.size) == ("job-7", 1, len(payload))
    assert info.sha256 == header["sha256"]
    assert trainer.verify_checkpoint(str(path)) == info.as_dict()
    # The write was atomic: only the checkpoint itself is left in the directory.
    assert [p.name for p in path.parent.iterdir()] == ["model.ckpt"]


def test_a_checkpoint_keeps_its_steps_metrics_and_an_edit_of_them_is_caught(saved: tuple[Trainer, Path],
                                                                              tmp_path: Path) -> None:
    trainer, path = saved
    info = verify_checkpoint(path)
    assert info.metrics == trainer.last_metrics and info.metrics["job_id"] == "job-7"
    assert set(info.metrics) >= {"loss", "grad_norm", "reward_mean", "step"}
    # A trainer that loads it has them again (and would keep them in its next checkpoint of that step).
    fresh = Trainer()
    fresh.load_checkpoint(str(path))
    assert fresh.last_metrics == info.metrics
    header, payload = _split(path)
    header["metrics"] = {**info.metrics, "loss": 0.0}
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    with pytest.raises(CheckpointError, match="the header's metrics are not the payload's"):
        verify_checkpoint(path)


def test_a_truncated_checkpoint_fails_verification(saved: tuple[Trainer, Path]) -> None:
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated: payload has") as caught:
        verify_checkpoint(path)
    assert caught.value.path == str(path)
    path.write_bytes(data[:20])  # cut inside the header line
    with pytest.raises(CheckpointError, match="no header line"):
        verify_checkpoint(path)


def test_a_truncated_checkpoint_is_not_loaded(saved: tuple[Trainer, Path]) -> None:
    _, path = saved
    path.write_bytes(path.read_bytes()[:-1])
    fresh = Trainer()
    before = fresh.weights_digest()
    with pytest.raises(CheckpointError, match="truncated"):
        fresh.load_checkpoint(str(path))
    assert fresh.weights_digest() == before and fresh.step == 0 and fresh.last_job_id is None


def test_an_altered_payload_fails_the_digest(saved: tuple[Trainer, Path]) -> None:
    _, path = saved
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 .* does not match"):
        verify_checkpoint(path)


def test_an_edited_header_disagrees_with_the_payload(saved: tuple[Trainer, Path]) -> None:
    _, path = saved
    header, payload = _split(path)
    header["job_id"] = "job-8"
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    with pytest.raises(CheckpointError, match="header names job 'job-8' step 1, payload job 'job-7'"):
        verify_checkpoint(path)


def test_trailing_bytes_are_refused(saved: tuple[Trainer, Path]) -> None:
    _, path = saved
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(CheckpointError, match="header says"):
        verify_checkpoint(path)


@pytest.mark.parametrize(("content", "rule"), [
    (None, "missing"),
    (b"", "no header line"),
    (b"{not json\n", "header is not JSON"),
    (b'{"magic": "other"}\n', "header magic"),
    (b'{"magic": "tidelog-trainer-checkpoint", "format": 2}\n', "format 2 is not supported"),
    (b'{"magic": "tidelog-trainer-checkpoint", "format": 1, "job_id": "j", "sha256": "x", '
     b'"size": true, "step": 1}\n', "'size' must be a int"),
])
def test_foreign_files_are_refused_by_rule(tmp_path: Path, content: bytes | None, rule: str) -> None:
    path = tmp_path / "c"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=rule):
        verify_checkpoint(path)


def test_an_overwrite_replaces_the_whole_file(saved: tuple[Trainer, Path]) -> None:
    trainer, path = saved
    trainer.train(make_job("job-8"))
    trainer.save_checkpoint(str(path), "job-8")
    assert verify_checkpoint(path).job_id == "job-8"
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.ckpt"]


def test_checkpoint_errors_cross_process_boundaries_intact() -> None:
    error = pickle.loads(pickle.dumps(CheckpointError("/x/c", "truncated: payload has 1 of 2 bytes")))
    assert isinstance(error, CheckpointError) and (error.path, error.rule) == ("/x/c", "truncated: payload has 1 of 2 bytes")
    assert str(error) == "checkpoint /x/c: truncated: payload has 1 of 2 bytes"
