"""Where a participant's checkpoint files lie, and how they are reached without following a link.

Part of :mod:`workers.participant.storage` (which re-exports the public names): the participant
directory's path, the confinement of a checkpoint directory under the checkpoint root
(:func:`confine`), the chain of directory descriptors opened from the root down with
``O_NOFOLLOW`` (:class:`_Chain`, created on the way when writing), directory fsyncs, and opening a
file to read without following a link or blocking (:func:`_open_regular`). See the storage module
for the whole story.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from pathlib import Path, PurePosixPath

from ..protocol import ID_PATTERN, ErrorCode, ProtocolError
from .codec import invalid

_NAME = re.compile(ID_PATTERN)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: Files read from a checkpoint: never through a symbolic link, and without blocking on open (a FIFO
#: would block an ``open`` for reading until a writer came; it is refused by ``fstat`` instead).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def refused(detail: str) -> ProtocolError:
    """``checkpoint_dir_refused`` (422): a checkpoint directory outside the checkpoint root."""
    return ProtocolError(ErrorCode.CHECKPOINT_DIR_REFUSED, detail)


def participant_dir(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str) -> Path:
    """``<checkpoint_dir>/gym/<kind>/<instance>`` (a path to show or to test; storage never opens it
    by name, see :func:`confine`)."""
    _check_names(kind, instance)
    return Path(checkpoint_dir) / "gym" / kind / instance


def _check_names(kind: str, instance: str) -> None:
    for label, value in (("kind", kind), ("instance", instance)):
        if not _NAME.match(value):
            raise invalid(f"participant {label} {value!r} cannot name a checkpoint directory")


def resolve_root(root: str | os.PathLike[str]) -> Path:
    """The checkpoint root as :func:`confine` compares against it: absolute and without symbolic links.

    The root itself is the operator's choice, so links in *its own* path are followed once, here;
    nothing below it is ever reached through one.
    """
    text = os.fspath(root)
    if not text or "\x00" in text:
        raise ValueError(f"checkpoint root {text!r} is not a path")
    return Path(os.path.realpath(os.path.abspath(text)))


def confine(root: str | os.PathLike[str], checkpoint_dir: str) -> tuple[Path, tuple[str, ...]]:
    """Where ``checkpoint_dir`` lies under ``root``: the resolved root and the components below it.

    Rules, each refused with ``checkpoint_dir_refused`` naming it: the directory must be absolute
    (a relative one would resolve against the participant's working directory); it must have no
    ``..`` component (which the kernel resolves after symbolic links, not lexically); and it must be
    ``root`` or lie under it — as configured or as resolved. Symbolic links below the root are
    refused as each component is opened (:func:`_walk`), never resolved.
    """
    given = os.path.abspath(os.fspath(root))
    real = resolve_root(root)
    if "\x00" in checkpoint_dir:
        raise refused(f"checkpoint_dir {checkpoint_dir!r} holds a NUL byte")
    if not os.path.isabs(checkpoint_dir):
        raise refused(f"checkpoint_dir {checkpoint_dir!r} is relative; it must be an absolute path under "
                      f"the checkpoint root {str(real)!r}")
    parts = PurePosixPath(checkpoint_dir).parts
    if ".." in parts:
        raise refused(f"checkpoint_dir {checkpoint_dir!r} has a '..' component; it must name a directory "
                      f"under the checkpoint root {str(real)!r} directly")
    for base in (PurePosixPath(real).parts, PurePosixPath(given).parts):
        if parts[:len(base)] == base:
            return real, parts[len(base):]
    raise refused(f"checkpoint_dir {checkpoint_dir!r} is not under the checkpoint root {str(real)!r}")


class _Chain:
    """Open directory descriptors from a top directory down to a participant directory.

    Each component below the top is opened relative to its parent with ``O_NOFOLLOW``, so a symbolic
    link anywhere below the top — planted before or during the walk — is refused, never followed.
    """

    def __init__(self, top: Path, names: tuple[str, ...], *, create: bool) -> None:
        self.paths = [top]
        self.fds: list[int] = []
        try:
            if create:
                os.makedirs(top, exist_ok=True)
            self.fds.append(os.open(top, _DIR_FLAGS))
            for name in names:
                self.fds.append(self._open_below(self.fds[-1], name, self.paths[-1] / name, create))
                self.paths.append(self.paths[-1] / name)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open_below(parent: int, name: str, path: Path, create: bool) -> int:
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass  # made meanwhile by someone else: open (and check) what is there
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    try:
                        link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
                    except OSError:
                        link = exc.errno == errno.ELOOP
                    if link:
                        raise refused(f"{path} is a symbolic link; checkpoint directories are never "
                                      "reached through one") from None
                raise
        raise invalid(f"{path} keeps changing while it is opened")

    @property
    def fd(self) -> int:
        return self.fds[-1]

    @property
    def path(self) -> Path:
        return self.paths[-1]

    def fsync(self) -> None:
        """fsync the participant directory."""
        _fsync_dir(self.fd, self.path)

    def fsync_all(self) -> None:
        """fsync the participant directory and every directory above it, up to the top."""
        for fd, path in zip(reversed(self.fds), reversed(self.paths), strict=True):
            _fsync_dir(fd, path)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _chain(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str, root: str | os.PathLike[str] | None,
           *, create: bool) -> _Chain:
    """The directory chain of a participant directory: from ``root`` (confined) or, without one (a
    trusted caller), from ``checkpoint_dir`` itself."""
    _check_names(kind, instance)
    below: tuple[str, ...] = ()
    if root is None:
        top = Path(checkpoint_dir)
    else:
        top, below = confine(root, os.fspath(checkpoint_dir))
    return _Chain(top, (*below, "gym", kind, instance), create=create)


def check_dir(root: str | os.PathLike[str], checkpoint_dir: str, kind: str, instance: str) -> None:
    """Refuse ``checkpoint_dir`` now if it is not under ``root`` or an existing directory on the way
    to the participant directory is a symbolic link (``checkpoint_dir_refused``); creates nothing.

    A cheap first look, so a refused commit pins nothing; the write itself checks again as it opens
    each directory (a link planted in between is still refused there).
    """
    try:
        _chain(checkpoint_dir, kind, instance, root, create=False).close()
    except OSError:
        pass  # a directory not there yet (or unreadable): the write says what is wrong, if anything


def _fsync_dir(fd: int, path: Path) -> None:
    """fsync one open directory (``path`` names it, for errors and tests)."""
    os.fsync(fd)


def _open_regular(directory: int, name: str, path: Path) -> tuple[int, os.stat_result]:
    """Open a checkpoint file for reading: not through a link, not blocking, a regular file only."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        raise invalid(f"no file at {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise invalid(f"{path} is a symbolic link; checkpoint files are never read through one") from None
        raise invalid(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise invalid(f"{path} is not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, info
