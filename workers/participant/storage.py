"""Checkpoint storage of one participant: a streamed records file, then a manifest, once.

Layout: ``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and
``manifest.json`` beside it.

Confinement (``root=``, which the control plane always passes): ``checkpoint_dir``
must be absolute, without ``..``, and under the root (:func:`confine`,
``checkpoint_dir_refused`` otherwise); below the root every directory is opened
(and created) relative to its parent with ``O_NOFOLLOW`` and every file relative
to its directory, so no symbolic link is followed out of — or within — the tree.
Files read are regular files opened without following links or blocking, read
with a bound (:data:`MANIFEST_MAX_BYTES`; the records file's declared
``records_bytes`` and ``record_count``) and a deadline.

Writing (:func:`write_records`): records are encoded one at a time
(:func:`encode_record`: orjson where that is provably exact, else the stdlib
``json.dumps`` without sorting, so dict key order, NaN, infinities and
integers of any size survive) into a temporary file while its SHA-256 is
computed (hashing and writing overlap the encoding in a second thread); the
file is fsynced. Then, under the :class:`WriteStop` lock when one is given
(a last stop check first), the file is renamed to ``records-<sha256>.jsonl``;
the directory and every parent up to the root (or checkpoint directory) are fsynced;
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

The paths, the confinement and the directory chain live in :mod:`._storage_paths`
(re-exported here). These functions block; the control plane runs them on its own
storage pool.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ..protocol import ErrorCode, ProtocolError
from ._storage_paths import (_Chain, _chain, _open_regular, check_dir, confine, participant_dir, refused,
                             resolve_root)
from .codec import check_payload, decode_line, encode_record, invalid, line_key

__all__ = ["MANIFEST", "MANIFEST_MAX_BYTES", "SCHEMA_VERSION", "WriteStop", "WriteStopped", "check_payload", "confine",
           "check_dir", "encode_record", "invalid", "participant_dir", "read_records", "refused", "resolve_root",
           "validate_manifest", "write_records"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
#: The largest manifest a restore reads (16 MiB; a real one is a few hundred bytes): the manifest is
#: read whole, so a planted huge file must not be.
MANIFEST_MAX_BYTES = 16 << 20
RECORDS_FILE = re.compile(r"^records(-[0-9a-f]{64})?\.jsonl$")


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
        self.size = 0  # bytes of every line added
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="records-writer")
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._batch: list[bytes] = []
        self._size = 0

    def add(self, line: bytes) -> None:
        self._batch.append(line)
        self._size += len(line)
        self.size += len(line)
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
                  stop: WriteStop | None = None, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Write ``(episode key, record)`` pairs and publish the manifest; return the manifest.

    Idempotent for the same records; ``invalid_checkpoint_state`` for a
    different commit into the same directory, an unwritable directory, or a
    record that cannot be written. With ``stop``, :class:`WriteStopped` once it
    is stopped: before each record, and a last time under its lock, which also
    covers the rename of the records file and the manifest's creation.

    With ``root``, ``checkpoint_dir`` must lie under it (:func:`confine`, ``checkpoint_dir_refused``
    otherwise, before anything is written); every directory below the root is created and opened
    without following a symbolic link, and every file is created relative to its open directory.
    Without ``root`` (a trusted caller) the same holds below ``checkpoint_dir``.
    """
    label = participant_dir(checkpoint_dir, kind, instance)
    try:
        chain = _chain(checkpoint_dir, kind, instance, root, create=True)
    except OSError as exc:
        raise invalid(f"directory {label} cannot hold state: {exc.strerror or exc}") from None
    directory, dfd = chain.path, chain.fd
    tmp_name: str | None = None
    try:
        tmp_name = f".records.jsonl.{secrets.token_hex(8)}"
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dfd)
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
                    "records_sha256": digest, "record_count": sink.count, "records_bytes": sink.size}
        guard: AbstractContextManager[Any] = nullcontext() if stop is None else stop._lock
        with guard:
            if stop is not None:
                stop.check()
            os.replace(tmp_name, records_file, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp_name = None
            # Every directory on the way down must be durable before the manifest says "done".
            chain.fsync_all()
            return _publish(chain, manifest)
    except OSError as exc:
        raise invalid(f"cannot write checkpoint state under {directory}: {exc.strerror or exc}") from None
    finally:
        try:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        finally:
            chain.close()


def _publish(chain: _Chain, manifest: dict[str, Any]) -> dict[str, Any]:
    directory, dfd = chain.path, chain.fd
    text = json.dumps(manifest, sort_keys=True, indent=1).encode()
    tmp = f".manifest.json.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        try:
            # Never replaces (one commit wins), and never follows a link at either name.
            os.link(tmp, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            existing = _load_manifest(dfd, directory)
            if existing != manifest:
                if existing.get("records_file") != manifest["records_file"]:
                    try:
                        os.unlink(manifest["records_file"], dir_fd=dfd)
                    except FileNotFoundError:
                        pass
                raise invalid(f"{directory} already holds a different commit "
                              f"(checkpoint {existing.get('checkpoint_id')!r})") from None
        # Also on a retry that found its manifest: the write that linked it may have failed here.
        chain.fsync()
        return manifest
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass


# -- reading -------------------------------------------------------------------------------------

def _load_manifest(directory: int, path: Path) -> dict[str, Any]:
    """Read ``manifest.json`` of an open participant directory: a regular file, not through a link,
    at most :data:`MANIFEST_MAX_BYTES`."""
    where = path / MANIFEST
    try:
        fd, info = _open_regular(directory, MANIFEST, where)
    except ProtocolError as exc:
        raise invalid(f"no manifest at {where}: {exc.detail}") from None
    try:
        if info.st_size > MANIFEST_MAX_BYTES:
            raise invalid(f"manifest {where} is {info.st_size} bytes, more than the {MANIFEST_MAX_BYTES} "
                          "a manifest may hold")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, MANIFEST_MAX_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MANIFEST_MAX_BYTES:
                raise invalid(f"manifest {where} holds more than the {MANIFEST_MAX_BYTES} bytes a manifest "
                              "may hold")
    except OSError as exc:
        raise invalid(f"cannot read {where}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        manifest = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise invalid(f"manifest {where} is not JSON") from None
    if not isinstance(manifest, dict):
        raise invalid(f"manifest {where} is not a JSON object")
    return manifest


def validate_manifest(manifest: dict[str, Any], kind: str, instance: str) -> None:
    """Refuse a manifest that is not exactly what :func:`write_records` publishes.

    ``records_bytes`` (the records file's size) is written by every commit since it was added and
    checked when present; a manifest without it (written before) is read up to the records file's
    size when it is opened — either way never further.
    """
    fields: dict[str, type | tuple[type, ...]] = {
        "schema_version": int, "kind": str, "instance": str, "checkpoint_id": str, "records_file": str,
        "records_sha256": str, "record_count": int}
    for name, expected in fields.items():
        if name not in manifest:
            raise invalid(f"manifest has no {name}")
        value = manifest[name]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise invalid(f"manifest {name} has the wrong type ({type(value).__name__})")
    size = manifest.get("records_bytes")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise invalid(f"manifest records_bytes {size!r} is not a byte count")
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
#: How many lines a restore reads between two looks at its deadline.
_DEADLINE_EVERY = 1024


def read_records(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str,
                 select: Callable[[dict[str, Any]], Any | None], *,
                 keys: frozenset[str] | None = None, root: str | os.PathLike[str] | None = None,
                 deadline: float | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Stream and verify the whole records file; keep what ``select`` returns (not ``None``).

    With ``keys`` (the capture keys a restore keeps), a line whose prefix names an episode outside
    them (:func:`~.codec.line_key`) is hashed and counted but not parsed, since ``select`` would
    drop it; lines of any other form are parsed and given to ``select``. The digest and count
    always cover the whole file. Holds one line, its parsed record and the records kept, never the
    file.

    Confinement and bounds: with ``root``, ``checkpoint_dir`` must lie under it (:func:`confine`);
    every directory is opened without following a symbolic link; the manifest and the records file
    are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files (a FIFO or a device is
    refused at once, never waited on); the manifest is read up to :data:`MANIFEST_MAX_BYTES`, the
    records file up to the byte size (``records_bytes``) and the record count the manifest declares
    — a file that holds more is refused as soon as the excess is read. ``deadline`` (a
    :func:`time.monotonic` time) is looked at every :data:`_DEADLINE_EVERY` lines; past it the read
    stops with ``deadline_exceeded``.
    """
    try:
        chain = _chain(checkpoint_dir, kind, instance, root, create=False)
    except OSError as exc:
        label = participant_dir(checkpoint_dir, kind, instance)
        raise invalid(f"no manifest at {label / MANIFEST}: {exc.strerror or exc}") from None
    try:
        manifest = _load_manifest(chain.fd, chain.path)
        validate_manifest(manifest, kind, instance)
        path = chain.path / manifest["records_file"]
        fd, info = _open_regular(chain.fd, manifest["records_file"], path)
    finally:
        chain.close()
    declared = manifest.get("records_bytes")
    if declared is not None and info.st_size != declared:
        os.close(fd)
        raise invalid(f"{path.name} is {info.st_size} bytes, its manifest says {declared}")
    left = info.st_size if declared is None else declared
    most = manifest["record_count"]
    digest = hashlib.sha256()
    count = 0
    kept: list[Any] = []
    try:
        with os.fdopen(fd, "rb", buffering=_READ_BUFFER) as src, _gc_paused():
            while line := src.readline(left + 1):
                left -= len(line)
                if left < 0:
                    raise invalid(f"{path.name} holds more than the {info.st_size if declared is None else declared} "
                                  "bytes its manifest declares")
                digest.update(line)
                count += 1
                if count > most:
                    raise invalid(f"{path.name} holds more than the {most} records its manifest says")
                if deadline is not None and count % _DEADLINE_EVERY == 0 and time.monotonic() > deadline:
                    raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED,
                                        f"reading {path.name} did not finish before the restore's deadline")
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
