"""A checkpoint's own files, written by the publisher: ``<dir>/<id>/checkpoint.json``, then ``<dir>/LATEST``.

:class:`Publication` is one publish's file work, run on :data:`engine.workflows.checkpoint.confined.FILES`; it is
all or nothing (a failure, or the controller giving up at the deadline, leaves neither file
changed) and it never writes through a symlink: ``<dir>/<id>`` must be a plain directory whose
real path is that of ``<dir>`` plus the id (the API confined ``<dir>`` to the checkpoint roots;
this check keeps a link planted below it since from leading the writes elsewhere).
:class:`PublishFailed` says which file failed and why, for the checkpoint's ``detail``.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

from workers.files import write_atomically

#: Publish errors a retry may cure (a network filesystem's hiccup). Anything else — a full disk
#: (ENOSPC, EDQUOT), a read-only or unwritable directory (EROFS, EACCES, EPERM) — aborts at once.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE})
#: The most bytes read of the ``LATEST`` a publish replaces (kept to put back if the publish fails).
_POINTER_MAX = 4096


class PublishFailed(Exception):
    """Writing one of a checkpoint's files failed (``error``, the OS error), or did not finish in time
    (``error`` is ``None``); ``note`` says what the clean-up could not undo."""

    def __init__(self, path: Path, error: OSError | None, note: str = "") -> None:
        self.path, self.error, self.note = path, error, note
        super().__init__(self.describe())

    @property
    def transient(self) -> bool:
        return self.error is not None and self.error.errno in TRANSIENT_ERRNOS

    def describe(self) -> str:
        if self.error is None:
            what = f"publishing did not finish by the commit deadline (writing {self.path})"
        else:
            code = errno.errorcode.get(self.error.errno or 0, str(self.error.errno))
            what = f"publishing failed writing {self.path}: {self.error.strerror or self.error} ({code})"
        return f"{what}; not published{'; ' + self.note if self.note else ''}"


def _read_pointer(path: Path) -> bytes | None:
    """The ``LATEST`` file's bytes, or ``None`` where there is none (or it is not a small regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _POINTER_MAX:
            return None
        return os.read(fd, _POINTER_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)


class Publication:
    """One publish's file work, run in a worker thread: the manifest, then ``LATEST``.

    All or nothing: on any failure — or once the controller has stopped waiting (:meth:`abandon`,
    at the deadline) — the manifest is removed and ``LATEST`` put back as it was, so an
    unpublished checkpoint leaves neither behind. (:func:`write_atomically` removes its own
    temporary file when it fails.) ``writing`` is the file being written now.
    """

    def __init__(self, manifest: Path, data: bytes, latest: Path, checkpoint_id: str) -> None:
        self.manifest, self.data, self.latest = manifest, data, latest
        self.pointer = (checkpoint_id + "\n").encode()
        self.writing = manifest
        self._lock = threading.Lock()  # held only to set or read the two flags below
        self._abandoned = False
        self._finished = False

    def abandon(self) -> bool:
        """The controller stops waiting: whatever is still written is undone. ``True`` where both
        files were written in time after all (the thread finished as the wait ran out)."""
        with self._lock:
            self._abandoned = True
            return self._finished

    def _finish(self) -> bool:
        """Whether the publish stands (``False``: it was abandoned)."""
        with self._lock:
            self._finished = not self._abandoned
            return self._finished

    def run(self) -> None:
        if self._abandoned:  # it waited for a thread of the pool past the deadline: nothing to do
            return
        self._check_plain()
        try:
            write_atomically(self.manifest, self.data)
        except OSError as exc:  # the rename may have happened (a failed directory fsync)
            raise PublishFailed(self.manifest, exc, self._undo(None)) from None
        if self._abandoned:
            self._undo(None)
            return
        self.writing = self.latest
        previous = _read_pointer(self.latest)
        try:
            write_atomically(self.latest, self.pointer)
        except OSError as exc:
            raise PublishFailed(self.latest, exc, self._undo(previous)) from None
        if not self._finish():
            self._undo(previous)

    def _check_plain(self) -> None:
        """Refuse to write where ``<dir>/<id>`` is a symlink or resolves anywhere but below ``<dir>``."""
        directory = self.manifest.parent
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            return  # write_atomically creates it
        except OSError as exc:
            raise PublishFailed(self.manifest, exc) from None
        real_parent = os.path.realpath(directory.parent)
        if stat.S_ISLNK(info.st_mode) or os.path.realpath(directory) != os.path.join(real_parent, directory.name):
            raise PublishFailed(self.manifest, OSError(errno.ELOOP, f"{directory} is a symlink, not a plain "
                                                                    "directory below the checkpoint root"))

    def _undo(self, previous: bytes | None) -> str:
        """Remove the manifest and put ``LATEST`` back (if this publish replaced it); what failed."""
        problems: list[str] = []
        if self.writing == self.latest and _read_pointer(self.latest) == self.pointer and previous != self.pointer:
            try:
                if previous is None:
                    self.latest.unlink(missing_ok=True)
                else:
                    write_atomically(self.latest, previous)
            except OSError as exc:
                problems.append(f"LATEST could not be put back ({exc.strerror or exc})")
        try:
            self.manifest.unlink(missing_ok=True)
        except OSError as exc:
            problems.append(f"{self.manifest} could not be removed ({exc.strerror or exc})")
        return "; ".join(problems)


__all__ = ["TRANSIENT_ERRNOS", "Publication", "PublishFailed"]
