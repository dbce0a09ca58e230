"""Checkpoint storage of one participant: a streamed records file, then a manifest, once.

Layout: ``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and
``manifest.json`` beside it.

Writing (:func:`write_records`): records are encoded one at a time
(``json.dumps`` without sorting, so dict key order, NaN, infinities and
integers of any size survive) into a temporary file while its SHA-256 is
computed; the file is fsynced and renamed to ``records-<sha256>.jsonl``; the
directory and every parent up to the checkpoint directory are fsynced; then
``manifest.json`` is created by a hard link from a fsynced temporary file —
a link never replaces, so one commit wins. A retry that finds the identical
manifest returns it; a different one is refused.

Reading (:func:`read_records`): the manifest is validated field by field; the
records file is streamed, every line hashed and counted, and only the records
``select`` keeps are held in memory; the digest and count must match the
manifest for the whole file. Every problem — storage, manifest or record —
is :class:`ProtocolError` ``invalid_checkpoint_state`` (HTTP 422), never an
unexpected exception.

These functions block; participants run them in a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from ..protocol import ID_PATTERN, ErrorCode, ProtocolError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
RECORDS_FILE = re.compile(r"^records(-[0-9a-f]{64})?\.jsonl$")
_NAME = re.compile(ID_PATTERN)


def invalid(detail: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, detail)


# -- payloads ------------------------------------------------------------------------------------

def _plain(value: Any) -> bool:
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def check_payload(value: Any) -> None:
    """Refuse a value that is not JSON: orjson first, then a plain-JSON walk (str keys only).

    Some values orjson accepts (a datetime, a UUID) pass here and then fail the
    commit that tries to write them, naming the episode (:func:`encode_record`).
    """
    try:
        orjson.dumps(value)
        return
    except TypeError:
        pass
    try:
        if _plain(value):
            return
    except RecursionError:
        pass
    raise ValueError("checkpoint payload is not JSON")


def encode_record(record: dict[str, Any], episode: str) -> bytes:
    """One line of the records file, or ``invalid_checkpoint_state`` naming the episode."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise invalid(f"checkpoint record of episode {episode!r} is not JSON: {exc}") from None


# -- paths and durability ------------------------------------------------------------------------

def participant_dir(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str) -> Path:
    for label, value in (("kind", kind), ("instance", instance)):
        if not _NAME.match(value):
            raise invalid(f"participant {label} {value!r} cannot name a checkpoint directory")
    return Path(checkpoint_dir) / "gym" / kind / instance


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_up_to(directory: Path, top: Path) -> None:
    """fsync ``directory`` and every parent up to and including ``top``."""
    current = directory
    while True:
        _fsync_dir(current)
        if current == top or current.parent == current:
            return
        current = current.parent


# -- writing -------------------------------------------------------------------------------------

def write_records(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str, checkpoint_id: str,
                  records: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Write ``(episode key, record)`` pairs and publish the manifest; return the manifest.

    Idempotent for the same records; ``invalid_checkpoint_state`` for a
    different commit into the same directory, an unwritable directory, or a
    record that cannot be written.
    """
    top = Path(checkpoint_dir)
    directory = participant_dir(top, kind, instance)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise invalid(f"directory {directory} cannot hold state: {exc.strerror or exc}") from None
    tmp_path: Path | None = None
    try:
        fd, raw_tmp = tempfile.mkstemp(dir=directory, prefix=".records.jsonl.")
        tmp_path = Path(raw_tmp)
        digest = hashlib.sha256()
        count = 0
        with os.fdopen(fd, "wb") as out:
            for episode, record in records:
                line = encode_record(record, episode)
                digest.update(line)
                out.write(line)
                count += 1
            out.flush()
            os.fsync(out.fileno())
        records_file = f"records-{digest.hexdigest()}.jsonl"
        manifest = {"schema_version": SCHEMA_VERSION, "kind": kind, "instance": instance,
                    "checkpoint_id": checkpoint_id, "records_file": records_file,
                    "records_sha256": digest.hexdigest(), "record_count": count}
        os.replace(tmp_path, directory / records_file)
        tmp_path = None
        # Every directory on the way down must be durable before the manifest says "done".
        _fsync_up_to(directory, top)
        return _publish(directory, manifest)
    except OSError as exc:
        raise invalid(f"cannot write checkpoint state under {directory}: {exc.strerror or exc}") from None
    finally:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


def _publish(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(manifest, sort_keys=True, indent=1).encode()
    fd, raw_tmp = tempfile.mkstemp(dir=directory, prefix=".manifest.json.")
    tmp = Path(raw_tmp)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, directory / MANIFEST)  # never replaces: one commit wins
        except FileExistsError:
            existing = _load_manifest(directory)
            if existing != manifest:
                if existing.get("records_file") != manifest["records_file"]:
                    (directory / manifest["records_file"]).unlink(missing_ok=True)
                raise invalid(f"{directory} already holds a different commit "
                              f"(checkpoint {existing.get('checkpoint_id')!r})") from None
        _fsync_dir(directory)
        return manifest
    finally:
        tmp.unlink(missing_ok=True)


# -- reading -------------------------------------------------------------------------------------

def _load_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise invalid(f"no manifest at {path}: {exc.strerror or exc}") from None
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise invalid(f"manifest {path} is not JSON") from None
    if not isinstance(manifest, dict):
        raise invalid(f"manifest {path} is not a JSON object")
    return manifest


#: A run of 19+ digits may be an integer beyond 64 bits, which orjson would read as a float.
_LONG_NUMBER = re.compile(rb"[0-9]{19}")


def _decode_line(line: bytes, number: int, name: str) -> Any:
    """Parse one records line exactly: orjson when that is provably exact, else the stdlib.

    orjson refuses NaN and Infinity tokens (so such lines fall back) and reads
    integers beyond 64 bits as floats, so it is used only on lines without a run
    of 19 or more digits; everything else goes through ``json.loads``.
    """
    if not _LONG_NUMBER.search(line):
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(line)
    except ValueError:
        raise invalid(f"line {number} of {name} is not JSON") from None


def validate_manifest(manifest: dict[str, Any], kind: str, instance: str) -> None:
    """Refuse a manifest that is not exactly what :func:`write_records` publishes."""
    fields: dict[str, type | tuple[type, ...]] = {
        "schema_version": int, "kind": str, "instance": str, "checkpoint_id": str, "records_file": str,
        "records_sha256": str, "record_count": int}
    for name, expected in fields.items():
        if name not in manifest:
            raise invalid(f"manifest has no {name}")
        value = manifest[name]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise invalid(f"manifest {name} has the wrong type ({type(value).__name__})")
    if manifest["schema_version"] != SCHEMA_VERSION:
        raise invalid(f"manifest schema_version {manifest['schema_version']} is not {SCHEMA_VERSION}")
    if (manifest["kind"], manifest["instance"]) != (kind, instance):
        raise invalid(f"manifest belongs to {manifest['kind']}/{manifest['instance']}, not {kind}/{instance}")
    if not RECORDS_FILE.match(manifest["records_file"]):
        raise invalid(f"manifest records_file {manifest['records_file']!r} is not a records file of this directory")
    if manifest["record_count"] < 0:
        raise invalid("manifest record_count is negative")


def read_records(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str,
                 select: Callable[[dict[str, Any]], Any | None]) -> tuple[dict[str, Any], list[Any]]:
    """Stream and verify the whole records file; keep what ``select`` returns (not ``None``)."""
    directory = participant_dir(checkpoint_dir, kind, instance)
    manifest = _load_manifest(directory)
    validate_manifest(manifest, kind, instance)
    path = directory / manifest["records_file"]
    digest = hashlib.sha256()
    count = 0
    kept: list[Any] = []
    try:
        with open(path, "rb") as src:
            for line in src:
                digest.update(line)
                count += 1
                record = _decode_line(line, count, path.name)
                if not isinstance(record, dict):
                    raise invalid(f"line {count} of {path.name} is not a JSON object")
                chosen = select(record)
                if chosen is not None:
                    kept.append(chosen)
    except OSError as exc:
        raise invalid(f"cannot read {path}: {exc.strerror or exc}") from None
    if digest.hexdigest() != manifest["records_sha256"]:
        raise invalid(f"{path.name} does not match its manifest digest")
    if count != manifest["record_count"]:
        raise invalid(f"{path.name} holds {count} records, its manifest says {manifest['record_count']}")
    return manifest, kept
