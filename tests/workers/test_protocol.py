"""Wire contracts of the checkpoint protocol (workers/protocol.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from workers.protocol import (
    ERROR_STATUS,
    REQUEST_MODELS,
    CommitRequest,
    EpisodeId,
    ErrorBody,
    ErrorCode,
    ProtocolError,
    RestoreRequest,
    ResumeRequest,
    RetireRequest,
    StatusReply,
    scope_keys,
)

ID_CHARS = st.sampled_from("abcXYZ019._-")
ids = st.builds(lambda head, tail: head + tail, st.sampled_from("aZ7"), st.text(ID_CHARS, max_size=20))
BASE = {"checkpoint_id": "ck-1", "deadline_ts": 1_900_000_000.5}


@settings(max_examples=300, derandomize=True, database=None)
@given(rollout=ids, attempt=st.integers(0, 10**6))
def test_every_capture_key_round_trips(rollout: str, attempt: int) -> None:
    try:
        episode = EpisodeId(rollout_id=rollout, attempt=attempt)
    except ValidationError:
        # Only the reserved suffix may refuse a well-formed id.
        assert EpisodeId.from_capture_key(rollout).attempt > 0
        return
    assert EpisodeId.from_capture_key(episode.capture_key) == episode
    assert EpisodeId.model_validate_json(episode.model_dump_json()) == episode


@pytest.mark.parametrize(("key", "rollout", "attempt"), [
    ("r", "r", 0), ("r-a1", "r", 1), ("r-a10", "r", 10), ("r-a0", "r-a0", 0), ("r-a01", "r-a01", 0),
    ("a-a1-b", "a-a1-b", 0), ("job-a", "job-a", 0), ("job-2", "job-2", 0), ("x.y_z-1", "x.y_z-1", 0),
    ("restored-a1", "restored", 1),
])
def test_capture_keys_from_the_contract_list(key: str, rollout: str, attempt: int) -> None:
    episode = EpisodeId.from_capture_key(key)
    assert (episode.rollout_id, episode.attempt) == (rollout, attempt)
    assert episode.capture_key == key


@pytest.mark.parametrize("rollout", ["r-a1", "job-a12", "", "-lead", "has space", "a/b", "é"])
def test_bad_rollout_ids_are_refused_with_the_reason(rollout: str) -> None:
    with pytest.raises(ValidationError) as info:
        EpisodeId(rollout_id=rollout)
    if rollout.startswith("r-a") or rollout.startswith("job-a"):
        assert "reserved attempt suffix" in str(info.value)


def test_a_restore_continues_attempt_n_as_n_plus_one() -> None:
    assert EpisodeId(rollout_id="r", attempt=2).next_attempt().capture_key == "r-a3"


@pytest.mark.parametrize(("route", "body"), [
    ("retire", {**BASE, "episode_ids": []}),
    ("retire", {**BASE, "episode_ids": "r"}),
    ("retire", {**BASE, "episode_ids": [{"rollout_id": "r-a1"}]}),
    ("forget", {**BASE, "rollout_ids": []}),
    ("forget", {**BASE, "rollout_ids": ["r-a2"]}),
    ("commit", {**BASE, "checkpoint_dir": ""}),
    ("commit", {**BASE, "checkpoint_dir": "/ck", "extra": 1}),
    ("restore", {**BASE, "checkpoint_dir": "/ck"}),
    ("restore", {**BASE, "checkpoint_dir": "/ck", "episode_ids": [{"attempt": 1}]}),
    ("resume", {"deadline_ts": 1.0}),
    ("resume", {"checkpoint_id": 7, "deadline_ts": 1.0}),
    ("renew", {"checkpoint_id": "ck"}),
    ("renew", {"checkpoint_id": "ck", "deadline_ts": "soon"}),
    ("renew", {"checkpoint_id": "ck", "deadline_ts": "12"}),
    ("prepare", {"checkpoint_id": "../x", "deadline_ts": 1.0}),
    ("prepare", {"checkpoint_id": "", "deadline_ts": 1.0}),
    ("prepare", {"checkpoint_id": "x" * 129, "deadline_ts": 1.0}),
    ("prepare", {**BASE, "unknown": True}),
])
def test_malformed_bodies_are_refused(route: str, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        REQUEST_MODELS[route].model_validate_json(json.dumps(body))


def test_non_finite_deadlines_are_refused() -> None:
    for raw in ('{"checkpoint_id": "ck", "deadline_ts": NaN}', '{"checkpoint_id": "ck", "deadline_ts": Infinity}'):
        with pytest.raises(ValidationError):
            ResumeRequest.model_validate_json(raw)


def test_valid_bodies_parse() -> None:
    commit = CommitRequest.model_validate_json(json.dumps(
        {**BASE, "checkpoint_dir": "/ck", "episode_ids": [{"rollout_id": "r", "attempt": 1}, {"rollout_id": "q"}]}))
    assert scope_keys(commit.episode_ids) == ("q", "r-a1")
    assert commit.stop is False
    assert scope_keys(CommitRequest.model_validate({**BASE, "checkpoint_dir": "/ck"}).episode_ids) is None
    assert RestoreRequest.model_validate({**BASE, "checkpoint_dir": "/ck", "episode_ids": []}).episode_ids == []
    retire = RetireRequest.model_validate({**BASE, "episode_ids": [{"rollout_id": "r"}]})
    assert retire.episode_ids[0].attempt == 0


def test_every_code_has_its_status_and_a_valid_body() -> None:
    assert set(ERROR_STATUS) == set(ErrorCode)
    assert ERROR_STATUS[ErrorCode.UNAUTHORIZED] == 401
    assert ERROR_STATUS[ErrorCode.INVALID_CHECKPOINT_STATE] == 422
    assert {c for c, s in ERROR_STATUS.items() if s == 409} >= {
        ErrorCode.STALE_CHECKPOINT, ErrorCode.CHECKPOINT_CONFLICT, ErrorCode.INVALID_PHASE,
        ErrorCode.DEADLINE_EXCEEDED, ErrorCode.RESTART_IN_SCOPE, ErrorCode.STALE_ATTEMPT, ErrorCode.EXPORT_FAILED}
    err = ProtocolError(ErrorCode.STALE_ATTEMPT, "r-a1 is retired")
    assert err.status == 409
    assert ErrorBody.model_validate(err.body()).error.code == "stale_attempt"


def test_status_replies_keep_participant_extras() -> None:
    reply = StatusReply.model_validate({"kind": "model", "instance": "m-0", "phase": "idle", "held": 3})
    assert reply.model_dump()["held"] == 3
    with pytest.raises(ValidationError):
        StatusReply.model_validate({"kind": "model", "instance": "m" * 256, "phase": "idle"})
