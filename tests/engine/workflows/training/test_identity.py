"""Job identity and runtime load ids (engine/workflows/training/identity.py)."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.workflows.training import LoadId, LoadIdError, TrainingPayloadError, job_identity

PAYLOAD = {"rollouts": [{"prompt": "ab", "completion": "cd", "reward": 1.5}], "lr": 0.05,
           "scenario_step": 7, "batch_number": 3, "base_version": "abc:4"}


def test_the_identity_ignores_step_batch_number_and_base_version_only() -> None:
    same = {**PAYLOAD, "scenario_step": 8, "batch_number": 0, "base_version": "abc:5"}
    assert job_identity(same) == job_identity(PAYLOAD)
    assert job_identity({**PAYLOAD, "lr": 0.06}) != job_identity(PAYLOAD)
    # Key order does not matter; the digest is of the canonical JSON.
    reordered = dict(reversed(list(PAYLOAD.items())))
    assert job_identity(reordered) == job_identity(PAYLOAD)
    expected = hashlib.sha256(b'{"lr":0.05,"rollouts":[{"completion":"cd","prompt":"ab","reward":1.5}]}').hexdigest()
    assert job_identity(PAYLOAD) == expected


@pytest.mark.parametrize(("payload", "field"), [
    ({"rollouts": [{"reward": math.nan}]}, "payload.rollouts[0].reward"),
    ({"rollouts": [{"reward": math.inf}]}, "payload.rollouts[0].reward"),
    ({"when": object()}, "payload.when"),
    ({1: "x"}, "payload.1"),
])
def test_a_payload_json_cannot_hold_exactly_is_refused_by_field(payload: dict[object, object], field: str) -> None:
    with pytest.raises(TrainingPayloadError) as info:
        job_identity(payload)  # type: ignore[arg-type]
    assert info.value.field == field


def test_load_ids_parse_and_step() -> None:
    first = LoadId.first()
    assert first.sequence == 0 and len(first.incarnation) == 32
    assert LoadId.parse(str(first.next())) == LoadId(first.incarnation, 1)
    assert first.next() > first and str(LoadId("ab12", 3)) == "ab12:3"


@pytest.mark.parametrize("text", ["", "abc", "abc:", ":3", "abc:-1", "abc:1.5", "a:b:12", "abc:٣"])
def test_a_malformed_load_id_is_refused(text: str) -> None:
    with pytest.raises(LoadIdError):
        LoadId.parse(text)


@given(st.text(alphabet="0123456789abcdef", min_size=1, max_size=32), st.integers(min_value=0, max_value=2**40))
def test_a_load_id_round_trips(incarnation: str, sequence: int) -> None:
    load_id = LoadId(incarnation, sequence)
    assert LoadId.parse(str(load_id)) == load_id
