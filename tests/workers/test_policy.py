"""The reference policy's weights directory (workers/policy.py): what loads and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.policy import META_FILE, MODEL_FILE, Policy, WeightsError, encode, load_weights, save_weights


def test_saved_weights_load_back_exactly_with_their_version(tmp_path: Path) -> None:
    model = Policy(seed=3)
    digest = save_weights(model, tmp_path, "abc:1")
    state, meta = load_weights(tmp_path)
    assert meta["version"] == "abc:1" and meta["sha256"] == digest
    loaded = Policy(seed=0)
    loaded.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded.generate(encode("hello"), 6) == model.generate(encode("hello"), 6)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "drop the model", "bad vocab", "no version"])
def test_a_damaged_weights_directory_is_refused_by_name(tmp_path: Path, damage: str) -> None:
    save_weights(Policy(seed=1), tmp_path, "abc:2")
    model, meta = tmp_path / MODEL_FILE, json.loads((tmp_path / META_FILE).read_text())
    if damage == "flip a byte":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model.write_bytes(bytes(data))
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:100])
    elif damage == "drop the model":
        model.unlink()
    elif damage == "bad vocab":
        (tmp_path / META_FILE).write_text(json.dumps({**meta, "vocab": "27"}))
    else:
        (tmp_path / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "version"}))
    with pytest.raises(WeightsError) as info:
        load_weights(tmp_path)
    assert str(tmp_path) in str(info.value)
