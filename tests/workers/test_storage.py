"""Participant checkpoint storage on a real filesystem: exact round trips and typed refusals."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import gc
import hashlib
import itertools
import json
import math
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import orjson

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.checkpoints import CORRUPT_MANIFESTS, corrupt_manifest
from workers.participant import _storage_paths, storage
from workers.participant.storage import (
    MANIFEST,
    WriteStop,
    WriteStopped,
    check_payload,
    encode_record,
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


@pytest.mark.parametrize("how", CORRUPT_MANIFESTS)
def test_every_corrupt_manifest_is_a_typed_422(tmp_path: Path, how: str) -> None:
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    (directory / MANIFEST).unlink()
    corrupt_manifest(directory, manifest, how)
    with pytest.raises(ProtocolError) as info:
        read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert info.value.status == 422 and info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE


def test_a_tampered_records_file_is_refused(tmp_path: Path) -> None:
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    path = participant_dir(tmp_path, KIND, INSTANCE) / manifest["records_file"]
    tampered = re.sub(rb'"state": ?2', b'"state":3', path.read_bytes())
    assert tampered != path.read_bytes()
    path.write_bytes(tampered)
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
class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


foreign = st.sampled_from([Colour.RED, Name("n"), uuid.UUID(int=7), orjson.Fragment(b"[1]"),
                           collections.OrderedDict(a=1), datetime.time(1, 2)])
anything = json_values | st.dictionaries(st.integers(), st.none(), min_size=1, max_size=2) \
    | st.builds(datetime.date, st.integers(2000, 2030), st.integers(1, 12), st.integers(1, 28)) \
    | st.lists(json_values | foreign, min_size=1, max_size=3) \
    | st.dictionaries(st.text(max_size=3), json_values | foreign, min_size=1, max_size=3)


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


# -- exactness of the fast encoder -----------------------------------------------------------------

class Plain(enum.Enum):
    A = "a"


class Count(int):
    pass


class Ratio(float):
    pass


@dataclasses.dataclass
class Point:
    x: int = 1


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize("value", [
    Colour.RED, Plain.A, Name("n"), Count(3), Ratio(0.5), uuid.UUID(int=1), orjson.Fragment(b'{"a":1}'),
    collections.OrderedDict(a=1), collections.defaultdict(list), Pair(1, 2), Point(), datetime.time(1),
    datetime.datetime(2026, 1, 1), {Name("k"): 1}, {True: 1}, {None: 1}, {1.5: 1},
], ids=lambda v: type(v).__name__)
def test_a_value_json_cannot_restore_as_itself_fails_the_commit(tmp_path: Path, value: Any) -> None:
    """orjson writes enums, UUIDs and fragments natively, json writes subclasses as their base: refused."""
    for payload in (value, [1, value], {"deep": [{"x": value}]}):
        with pytest.raises(ProtocolError) as info:
            write_records(tmp_path, KIND, INSTANCE, "ck-1", [("r-7", {"state": payload})])
        assert info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE and "'r-7'" in info.value.detail
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    assert list(directory.iterdir()) == []  # no manifest, no records file, no temporary file


def test_plain_records_take_the_orjson_path_and_non_finite_floats_the_stdlib(tmp_path: Path) -> None:
    nulls = {"a": None, "b": {"c": [None, 1.5, "null", {"d": None}]}, "e": list(range(10))}
    assert encode_record(nulls, "r") == orjson.dumps(nulls) + b"\n"  # None alone keeps the fast path
    for odd in (float("nan"), float("inf"), float("-inf")):
        record = {"a": None, "b": [{"c": [None, odd]}]}
        line = encode_record(record, "r")
        assert b"NaN" in line or b"Infinity" in line
    many = {"a": [None] * 5000 + [float("nan")]}  # past the walk's limit: stdlib, still exact
    assert encode_record(many, "r").endswith(b"NaN]}\n")
    payloads = [nulls, {"a": None, "b": [{"c": [None, float("nan"), float("-inf")]}]}, many,
                {"big": [2**64, -(2**63) - 1, 2**64 - 1, -(2**63)], "none": None}]
    write_records(tmp_path, KIND, INSTANCE, "ck-1", records(payloads))
    _, kept = read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert all(same(p, r["state"]) for p, r in zip(payloads, kept))


def _hand_written(tmp_path: Path, lines: list[bytes]) -> None:
    """A records file and manifest written by hand, as an older writer or another tool would."""
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    directory.mkdir(parents=True)
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    (directory / f"records-{digest}.jsonl").write_bytes(data)
    (directory / MANIFEST).write_text(json.dumps({
        "schema_version": 1, "kind": KIND, "instance": INSTANCE, "checkpoint_id": "ck-1",
        "records_file": f"records-{digest}.jsonl", "records_sha256": digest, "record_count": len(lines)}))


def test_lines_of_any_writer_are_read_exactly(tmp_path: Path) -> None:
    values = [{"x": 2**70, "y": 1.5}, {"x": 18446744073709551616}, {"x": -9223372036854775809, "z": [1e16]},
              {"x": 1234567890123456789, "n": float("nan")}, {"x": [9007199254740993, -0.0, "1e19"]}]
    lines = [(json.dumps(v) + "\n").encode() for v in values]  # stdlib separators
    lines += [(json.dumps(v, separators=(",", ":")) + "\n").encode() for v in values]  # compact, like orjson
    lines.append(b'{"last":12345678901234567890123}')  # no final newline
    _hand_written(tmp_path, lines)
    _, kept = read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert all(same(v, k) for v, k in zip(values + values + [{"last": 12345678901234567890123}], kept))
    assert len(kept) == len(lines)


def test_a_line_nested_too_deeply_for_the_parsers_is_a_typed_422(tmp_path: Path) -> None:
    _hand_written(tmp_path, [b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"])
    with pytest.raises(ProtocolError) as info:
        read_records(tmp_path, KIND, INSTANCE, keep_all)
    assert info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE


@pytest.mark.parametrize("enabled", [True, False])
def test_storage_leaves_the_garbage_collector_as_it_found_it(tmp_path: Path, enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
        assert gc.isenabled() is enabled
        read_records(tmp_path, KIND, INSTANCE, keep_all)
        assert gc.isenabled() is enabled
        with pytest.raises(ProtocolError):
            write_records(tmp_path / "x", KIND, INSTANCE, "ck-1", [("r", {"state": uuid.UUID(int=1)})])
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


# -- stopping a write ----------------------------------------------------------------------------

def test_a_writer_stopped_mid_stream_leaves_no_file_and_no_manifest(tmp_path: Path) -> None:
    stop = WriteStop()

    def stream() -> Any:
        for i in range(10):
            if i == 4:
                stop.stop()
            yield f"r{i}", {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "state": list(range(1000))}

    with pytest.raises(WriteStopped):
        write_records(tmp_path, KIND, INSTANCE, "ck-1", stream(), stop=stop)
    assert stop.stopped
    assert list(participant_dir(tmp_path, KIND, INSTANCE).iterdir()) == []


def test_a_writer_stopped_after_its_last_record_publishes_nothing(tmp_path: Path) -> None:
    stop = WriteStop()

    def stream() -> Any:
        yield from records([1, 2])
        stop.stop()  # the loop has ended; the last check, under the lock, still sees it

    with pytest.raises(WriteStopped):
        write_records(tmp_path, KIND, INSTANCE, "ck-1", stream(), stop=stop)
    assert list(participant_dir(tmp_path, KIND, INSTANCE).iterdir()) == []
    with pytest.raises(WriteStopped):  # a stop is for good
        write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1]), stop=stop)
    assert list(participant_dir(tmp_path, KIND, INSTANCE).iterdir()) == []


def test_stop_waits_for_a_manifest_being_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once stop() returns, either the write returned its manifest or no manifest ever appears."""
    stop = WriteStop()
    publishing, release = threading.Event(), threading.Event()
    real_publish = storage._publish

    def slow_publish(chain: Any, manifest: dict[str, Any]) -> dict[str, Any]:
        publishing.set()
        assert release.wait(10)
        return real_publish(chain, manifest)

    monkeypatch.setattr(storage, "_publish", slow_publish)
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            outcome["manifest"] = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]), stop=stop)
        except BaseException as exc:  # pragma: no cover - reported below
            outcome["error"] = exc

    writer = threading.Thread(target=write)
    writer.start()
    assert publishing.wait(10)
    stopper = threading.Thread(target=stop.stop)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive(), "stop() returned while a manifest was being published"
    release.set()
    stopper.join(10)
    writer.join(10)
    assert not stopper.is_alive() and not writer.is_alive()
    assert "error" not in outcome and stop.stopped
    assert json.loads((participant_dir(tmp_path, KIND, INSTANCE) / MANIFEST).read_text()) == outcome["manifest"]


def test_a_retry_that_finds_its_manifest_syncs_the_directory_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write can link its manifest and then fail to sync the directory; its retry syncs it."""
    directory = participant_dir(tmp_path, KIND, INSTANCE)
    real_fsync_dir = _storage_paths._fsync_dir
    synced: list[tuple[Path, bool]] = []
    failed = []

    def flaky(fd: int, path: Path) -> None:
        published = (directory / MANIFEST).exists()
        if path == directory and published and not failed:
            failed.append(path)
            raise OSError(5, "Input/output error")
        real_fsync_dir(fd, path)
        synced.append((path, published))

    monkeypatch.setattr(_storage_paths, "_fsync_dir", flaky)
    with pytest.raises(ProtocolError) as info:
        write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    assert info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE and (directory / MANIFEST).exists()
    synced.clear()
    manifest = write_records(tmp_path, KIND, INSTANCE, "ck-1", records([1, 2]))
    assert synced[-1] == (directory, True)  # the directory, once the manifest is there, last
    assert json.loads((directory / MANIFEST).read_text()) == manifest


def test_a_cyclic_record_fails_the_commit_by_name(tmp_path: Path) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    for record in ({"state": loop, 1: "int key"}, {"state": loop}):
        with pytest.raises(ProtocolError) as info:
            write_records(tmp_path, KIND, INSTANCE, "ck-1", [("r-c", record)])
        assert "'r-c'" in info.value.detail


# -- skipping records a restore does not keep -----------------------------------------------------

def test_line_key_reads_the_episode_of_what_the_writer_writes() -> None:
    from workers.participant.codec import line_key
    for rollout, attempt in [("r", 0), ("r-a0", 0), ("job.x_1", 3), ("a", 12)]:
        record = {"episode_id": {"rollout_id": rollout, "attempt": attempt}, "state": [1, {"episode_id": "x"}]}
        key = line_key(encode_record(record, "e"))
        assert key == (rollout if attempt == 0 else f"{rollout}-a{attempt}")
    # Any other form is not guessed at: the reader parses it.
    assert line_key(b'{"state":1,"episode_id":{"rollout_id":"r","attempt":0}}\n') is None
    assert line_key(b'{"episode_id": {"rollout_id": "r", "attempt": 0}}\n') is None
    assert line_key(b'{"episode_id":{"attempt":0,"rollout_id":"r"}}\n') is None


def test_a_restore_by_keys_parses_only_the_lines_it_keeps_and_still_verifies_all(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    rows = [(f"r{i}", {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "state": i}) for i in range(50)]
    rows.append(("odd", {"state": "no episode first", "episode_id": {"rollout_id": "odd", "attempt": 0}}))
    write_records(tmp_path, KIND, INSTANCE, "ck-1", rows)
    parsed: list[bytes] = []
    real = storage.decode_line

    def counting(line: bytes, number: int, name: str) -> Any:  # counts parses; a probe, not a fault
        parsed.append(line)
        return real(line, number, name)
    monkeypatch.setattr(storage, "decode_line", counting)
    _, kept = read_records(tmp_path, KIND, INSTANCE, lambda r: r if r["episode_id"]["rollout_id"] in {"r7", "odd"}
                           else None, keys=frozenset({"r7", "odd"}))
    assert [r["state"] for r in kept] == [7, "no episode first"]
    assert len(parsed) == 2  # r7, and the line whose prefix names no episode
    # The skipped lines still count towards the digest: tampering with one is refused.
    path = next(participant_dir(tmp_path, KIND, INSTANCE).glob("records-*.jsonl"))
    path.write_bytes(path.read_bytes().replace(b'"state":3}', b'"state":4}'))
    with pytest.raises(ProtocolError, match="digest"):
        read_records(tmp_path, KIND, INSTANCE, lambda r: r, keys=frozenset({"r7"}))
