"""Checkpoint storage of one participant: a streamed records file, then a manifest, once.

Layout: ``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and
``manifest.json`` beside it.

Writing (:func:`write_records`): records are encoded one at a time
(:func:`encode_record`: orjson where that is provably exact, else the stdlib
``json.dumps`` without sorting, so dict key order, NaN, infinities and
integers of any size survive) into a temporary file while its SHA-256 is
computed (hashing and writing overlap the encoding in a second thread); the
file is fsynced. Then, under the :class:`WriteStop` lock when one is given
(a last stop check first), the file is renamed to ``records-<sha256>.jsonl``;
the directory and every parent up to the checkpoint directory are fsynced;
then ``manifest.json`` is created by a hard link from a fsynced temporary
file — a link never replaces, so one commit wins — and the directory is
fsynced. A retry that finds the identical manifest fsyncs the directory and
returns it; a different one is refused.

Reading (:func:`read_records`): the manifest is validated field by field; the
records file is streamed, every line hashed and counted, and parsed (orjson where
that is provably exact, else ``json.loads``) unless its prefix names an episode
the restore does not keep; only the records ``select`` keeps are held in memory; the digest and count must match the manifest for the
whole file. Every problem — storage, manifest or record — is
:class:`ProtocolError` ``invalid_checkpoint_state`` (HTTP 422), never an
unexpected exception.

Both hold the cyclic garbage collector off while they run (:data:`_gc_paused`,
process-wide, so other threads' cyclic garbage waits too): parsed records are
trees, and a restore that keeps millions of new objects would otherwise pay
for the collector rescanning them again and again (most of the 16 s restore
before). The collector's first pass over what a restore keeps then runs once,
when it is turned back on.

These functions block; participants run them in a worker thread.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any


from ..protocol import ID_PATTERN
from .codec import check_payload, decode_line, encode_record, invalid, line_key

__all__ = ["MANIFEST", "SCHEMA_VERSION", "WriteStop", "WriteStopped", "check_payload", "encode_record", "invalid",
           "participant_dir", "read_records", "validate_manifest", "write_records"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
RECORDS_FILE = re.compile(r"^records(-[0-9a-f]{64})?\.jsonl$")
_NAME = re.compile(ID_PATTERN)


# -- stopping a write ----------------------------------------------------------------------------

class WriteStopped(Exception):
    """A records write ended by :meth:`WriteStop.stop`: no manifest was published, no file left."""


class WriteStop:
    """Lets a resume stop a records writer running in a thread.

    The writer checks before each record, and its last check, the rename of its
    records file and the manifest's creation run under one lock that
    :meth:`stop` takes, so no manifest appears once :meth:`stop` has returned.
    :meth:`stop` blocks while a manifest is being published; callers on an event
    loop run it in a thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def check(self) -> None:
        """Raise :class:`WriteStopped` once :meth:`stop` has been called."""
        if self._stopped:
            raise WriteStopped("the checkpoint write was stopped")

    def stop(self) -> None:
        """Stop the write; waits for a manifest publication under way to finish."""
        with self._lock:
            self._stopped = True


# -- the cyclic garbage collector ----------------------------------------------------------------

class _GcPause:
    """Process-wide: the collector is off while any storage call runs, and restored after the last.

    A counter (not a saved flag per call) so that two overlapping calls in two
    threads do not turn the collector back on under each other, and a collector
    someone else disabled stays disabled.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


_gc_paused = _GcPause()


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

#: Lines go to the writing thread joined in batches of about this many bytes, at most
#: :data:`_WRITE_AHEAD` batches ahead: a commit holds a few MB, never the file.
_WRITE_BATCH = 4 << 20
_WRITE_AHEAD = 2


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Sink:
    """Joins lines into batches that a second thread hashes and writes, in order.

    ``hashlib`` and file writes release the GIL, so hashing and writing (which
    on these VMs is mostly the kernel finding page-cache pages) overlap the
    encoding in the caller's thread; the join is one memcpy, cheap next to
    them. The batches are large because the second thread needs the GIL back
    a few times a batch, and while the caller runs long C calls (pickle,
    orjson) each time can take up to the switch interval (5 ms).
    :meth:`close` waits for every batch and re-raises the first error.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.digest = hashlib.sha256()
        self.count = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="records-writer")
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._batch: list[bytes] = []
        self._size = 0

    def add(self, line: bytes) -> None:
        self._batch.append(line)
        self._size += len(line)
        self.count += 1
        if self._size >= _WRITE_BATCH:
            self._submit()

    def _hash_write(self, data: bytes) -> None:
        self.digest.update(data)
        _write_all(self.fd, data)

    def _submit(self) -> None:
        if self._batch:
            while len(self._pending) >= _WRITE_AHEAD:
                self._pending.popleft().result()
            self._pending.append(self._pool.submit(self._hash_write, b"".join(self._batch)))
            self._batch, self._size = [], 0

    def close(self) -> None:
        """Write what is left and wait; raise the first error of the thread."""
        try:
            self._submit()
            while self._pending:
                self._pending.popleft().result()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Wait for the thread without raising (the caller is failing already)."""
        for future in self._pending:
            future.exception()
        self._pending.clear()
        self._pool.shutdown(wait=True)


def write_records(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str, checkpoint_id: str,
                  records: Iterable[tuple[str, dict[str, Any]]], *,
                  stop: WriteStop | None = None) -> dict[str, Any]:
    """Write ``(episode key, record)`` pairs and publish the manifest; return the manifest.

    Idempotent for the same records; ``invalid_checkpoint_state`` for a
    different commit into the same directory, an unwritable directory, or a
    record that cannot be written. With ``stop``, :class:`WriteStopped` once it
    is stopped: before each record, and a last time under its lock, which also
    covers the rename of the records file and the manifest's creation.
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
        try:
            with _gc_paused():
                sink = _Sink(fd)
                try:
                    for episode, record in records:
                        if stop is not None:
                            stop.check()
                        sink.add(encode_record(record, episode))
                except BaseException:
                    sink.abandon()
                    raise
                sink.close()
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = sink.digest.hexdigest()
        records_file = f"records-{digest}.jsonl"
        manifest = {"schema_version": SCHEMA_VERSION, "kind": kind, "instance": instance,
                    "checkpoint_id": checkpoint_id, "records_file": records_file,
                    "records_sha256": digest, "record_count": sink.count}
        guard: AbstractContextManager[Any] = nullcontext() if stop is None else stop._lock
        with guard:
            if stop is not None:
                stop.check()
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
        # Also on a retry that found its manifest: the write that linked it may have failed here.
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


#: Read buffer of the records file: big enough that a long line takes few reads, small next to a record.
_READ_BUFFER = 256 * 1024


def read_records(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str,
                 select: Callable[[dict[str, Any]], Any | None], *,
                 keys: frozenset[str] | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Stream and verify the whole records file; keep what ``select`` returns (not ``None``).

    With ``keys`` (the capture keys a restore keeps), a line whose prefix names an episode outside
    them (:func:`~.codec.line_key`) is hashed and counted but not parsed, since ``select`` would
    drop it; lines of any other form are parsed and given to ``select``. The digest and count
    always cover the whole file. Holds one line, its parsed record and the records kept, never the
    file.
    """
    directory = participant_dir(checkpoint_dir, kind, instance)
    manifest = _load_manifest(directory)
    validate_manifest(manifest, kind, instance)
    path = directory / manifest["records_file"]
    digest = hashlib.sha256()
    count = 0
    kept: list[Any] = []
    try:
        with open(path, "rb", buffering=_READ_BUFFER) as src, _gc_paused():
            for line in src:
                digest.update(line)
                count += 1
                if keys is not None:
                    key = line_key(line)
                    if key is not None and key not in keys:
                        continue
                record = decode_line(line, count, path.name)
                del line  # before select: what it keeps may be all the memory there is
                if not isinstance(record, dict):
                    raise invalid(f"line {count} of {path.name} is not a JSON object")
                chosen = select(record)
                del record
                if chosen is not None:
                    kept.append(chosen)
                del chosen
    except OSError as exc:
        raise invalid(f"cannot read {path}: {exc.strerror or exc}") from None
    if digest.hexdigest() != manifest["records_sha256"]:
        raise invalid(f"{path.name} does not match its manifest digest")
    if count != manifest["record_count"]:
        raise invalid(f"{path.name} holds {count} records, its manifest says {manifest['record_count']}")
    return manifest, kept
