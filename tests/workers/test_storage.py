"""Participant checkpoint storage on a real filesystem: exact round trips and typed refusals."""

from __future__ import annotations

import datetime
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.participant.storage import (
    MANIFEST,
    check_payload,
    participant_dir,
    read_records,
    write_records,
)
from workers.protocol import ErrorCode, ProtocolError

KIND, INSTANCE = "environment", "env-0"
EXAMPLES = itertools.count()


def same(a: Any, b: Any) -> bool:
    """Equal in type and value, dict key order included, NaN equal to NaN."""
    if type(a) is not type(b):
        # JSON has no tuples: a tuple comes back as a list.
        return isinstance(a, tuple) and isinstance(b, list) and same(list(a), b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def records(payloads: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"r{i}", {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "state": p})
            for i, p in enumerate(payloads)]


def keep_all(record: dict[str, Any]) -> dict[str, Any]:
    return record


def test_round_trip_keeps_order_nan_and_big_ints(tmp_path: Path) -> None:
    payloads = [{"z": 1, "a": [2**70, -(2**70)], "m": {"y": float("nan"), "b": float("inf")}},
                ["é", None, True, -0.0, 1e-310, float("-inf")], "plain"]
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records(payloads))
    assert manifest["record_count"] == 3 and manifest["records_file"] == f"records-{manifest['records_sha256']}.jsonl"
    back, kept = read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert back == manifest
    assert all(same(p, r["state"]) for p, r in zip(payloads, kept))


def test_a_retried_commit_returns_the_same_manifest_and_another_is_refused(tmp_path: Path) -> None:
    first = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    assert write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2])) == first
    with pytest.raises(ProtocolError) as info:
        write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 3]))
    assert info.value.status == 422 and "already holds a different commit" in info.value.detail
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    assert sorted(p.name for p in directory.iterdir()) == [MANIFEST, first["records_file"]]


def test_restore_keeps_only_what_select_keeps_but_verifies_everything(tmp_path: Path) -> None:
    write_records(tmp_path, KIND, INSTANCE, "ck-1", records(list(range(10))))
    _, kept = read_records(tmp_path, KIND, INSTANCE,
                           lambda r: r["state"] if r["state"] % 3 == 0 else None)
    assert kept == [0, 3, 6, 9]


def test_a_record_that_cannot_be_written_fails_the_commit_naming_the_episode(tmp_path: Path) -> None:
    check_payload({"when": datetime.datetime(2026, 1, 1)})  # orjson accepts it ...
    with pytest.raises(ProtocolError) as info:  # ... the commit does not
        write_records(tmp_path, KIND, INSTANCE, "ck-1",
                      [("r-a2", {"state": {"when": datetime.datetime(2026, 1, 1)}})])
    assert info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE and "'r-a2'" in info.value.detail
    assert not (participant_dir(tmp_path, KIND, INSTANCE) / MANIFEST).exists()


@pytest.mark.parametrize("value", [{1: "a"}, {(1, 2): "a"}, {1, 2}, b"bytes", object()])
def test_payloads_that_are_not_json_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="not JSON"):
        check_payload(value)


def _corrupt(directory: Path, manifest: dict[str, Any], how: str) -> None:
    path = directory / MANIFEST
    if how == "not json":
        path.write_text("{not json")
        return
    if how == "not an object":
        path.write_text("[]")
        return
    m = dict(manifest)
    if how == "missing file":
        m["records_file"] = "records-" + "0" * 64 + ".jsonl"
    elif how.startswith("missing "):
        del m[how.removeprefix("missing ")]
    elif how == "outside":
        m["records_file"] = "../../../outside.jsonl"
    elif how == "count is a string":
        m["record_count"] = "2"
    path.write_text(json.dumps(m))


@pytest.mark.parametrize("how", ["not json", "not an object", "missing records_file", "missing records_sha256",
                                 "outside", "missing file", "count is a string", "missing checkpoint_id"])
def test_every_corrupt_manifest_is_a_typed_422(tmp_path: Path, how: str) -> None:
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    (directory / MANIFEST).unlink()
    _corrupt(directory, manifest, how)
    with pytest.raises(ProtocolError) as info:
        read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert info.value.status == 422 and info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE


def test_a_tampered_records_file_is_refused(tmp_path: Path) -> None:
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    path = participant_dir(tmp_path, KIND, INSTANCE) / manifest["records_file"]
    path.write_bytes(path.read_bytes().replace(b'"state": 2', b'"state": 3'))
    with pytest.raises(ProtocolError, match="does not match its manifest digest"):
        read_records(tmp_path, KIND, INSTANCE, keep_all)


def test_a_directory_that_cannot_hold_state_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ProtocolError) as info:
        write_records(blocker, KIND, INSTANCE, "ck-1", records([1]))
    assert info.value.status == 422 and "cannot hold state" in info.value.detail


@pytest.mark.parametrize(("kind", "instance"), [("../x", "i"), ("environment", "a/b"), ("", "i")])
def test_names_that_would_escape_are_refused(tmp_path: Path, kind: str, instance: str) -> None:
    with pytest.raises(ProtocolError):
        participant_dir(tmp_path, kind, instance)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20)
anything = json_values | st.dictionaries(st.integers(), st.none(), min_size=1, max_size=2) \
    | st.builds(datetime.date, st.integers(2000, 2030), st.integers(1, 12), st.integers(1, 28))


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=anything)
def test_every_accepted_payload_round_trips_or_fails_by_name(tmp_path: Path, payload: Any) -> None:
    try:
        check_payload(payload)
    except ValueError:
        return  # refused up front
    target = tmp_path / f"ck-{next(EXAMPLES)}"
    try:
        write_records(target, KIND, INSTANCE, "ck-1", [("r", {"state": payload})])
    except ProtocolError as exc:
        assert "'r'" in exc.detail and exc.status == 422
        return
    _, (record,) = read_records(target, KIND, INSTANCE, keep_all)
    assert same(payload, record["state"])
