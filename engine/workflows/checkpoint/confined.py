"""The orchestrator's checkpoint files: which directories it may use, and how it reads what is there.

Rules (docs/security.md):

- **Roots.** Checkpoints live under configured roots: ``checkpoint.directory`` and the operator's
  allow-list ``checkpoint.roots``, each taken as its real path (symlinks resolved) once.
  :func:`confine` accepts a directory a request names only if it is absolute, free of NUL, and
  its real path is a root or lies below one; anything else is a :class:`DirectoryRefused`
  naming the rule. Symlinks are resolved before the check, so a link that leads out of a root
  is refused like the place it leads to.
- **Reads.** :func:`read_file` opens each component below the root with ``O_NOFOLLOW`` (a
  symlink anywhere in the checkpoint tree is refused, not followed), opens the file itself
  with ``O_NONBLOCK`` (a FIFO cannot block the open), refuses anything but a regular file, and
  reads at most ``limit`` bytes.
- **Threads.** Blocking file work runs on :data:`FILES`, a small pool of its own, under a
  deadline (:func:`run`), never on the event loop's default executor: a file that hangs (a
  stuck network mount) can tie up at most this pool, never the threads the rest of the
  service (aiohttp's resolver, the database drivers) depends on.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: The pool for checkpoint file work (reads of LATEST and manifests, the publisher's writes).
FILES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tidelog-files")
#: Default deadline of one piece of file work.
FILE_TIMEOUT_S = 30.0
#: Longest path a request may name.
MAX_PATH = 4096


class DirectoryRefused(ValueError):
    """A requested checkpoint directory breaks a confinement rule (``rule`` says which)."""

    def __init__(self, given: str, rule: str) -> None:
        self.given, self.rule = given, rule
        shown = given if len(given) <= 200 else given[:197] + "..."
        super().__init__(f"{shown!r}: {rule}")


class UnsafeFile(OSError):
    """A checkpoint file that is not a plain, bounded, regular file inside its tree."""


def roots(directory: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The real paths of the configured roots, the default one first, without repeats."""
    out: list[str] = []
    for d in (directory, *extra):
        real = os.path.realpath(d)
        if real not in out:
            out.append(real)
    return tuple(out)


def confine(given: str, allowed: Sequence[str]) -> str:
    """The real path of ``given`` if it lies under one of ``allowed`` (real paths); else :class:`DirectoryRefused`."""
    if "\x00" in given:
        raise DirectoryRefused(given, "must not contain a NUL character")
    if len(given) > MAX_PATH:
        raise DirectoryRefused(given, f"must be at most {MAX_PATH} characters")
    if not os.path.isabs(given):
        # A relative path would resolve against wherever `tidelog serve` happens to run.
        raise DirectoryRefused(given, "must be an absolute path")
    real = os.path.realpath(given)
    for root in allowed:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise DirectoryRefused(given, f"resolves to {real}, which is not under a configured checkpoint root "
                                  f"({', '.join(allowed)}; add it to checkpoint.roots to allow it)")


def read_file(root: str, parts: Sequence[str], limit: int) -> bytes:
    """The bytes of ``root/parts...``: no symlink below ``root``, a regular file, at most ``limit`` bytes.

    Raises :class:`FileNotFoundError` when a component is missing and :class:`UnsafeFile` (an
    ``OSError``) when a component is a symlink or not a directory, the file is not regular, or
    it is larger than ``limit``.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFile(exc.errno, f"{part} is not a plain directory (a symlink or a file)") from None
                raise
            os.close(fd)
            fd = nxt
        try:
            ffd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFile(exc.errno, f"{parts[-1]} is a symlink") from None
            raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{parts[-1]} is not a regular file")
        if st.st_size > limit:
            raise UnsafeFile(errno.EFBIG, f"{parts[-1]} is {st.st_size} bytes, more than the {limit} allowed")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(ffd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # it grew while being read
            raise UnsafeFile(errno.EFBIG, f"{parts[-1]} is more than the {limit} bytes allowed")
        return data
    finally:
        os.close(ffd)


async def run(fn: Callable[..., T], *args: object, timeout: float = FILE_TIMEOUT_S) -> T:
    """``fn(*args)`` on :data:`FILES`, or :class:`TimeoutError` after ``timeout`` seconds (the thread
    may finish later; its result is dropped)."""
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.run_in_executor(FILES, lambda: fn(*args)), timeout)


__all__ = ["FILES", "FILE_TIMEOUT_S", "DirectoryRefused", "UnsafeFile", "confine", "read_file", "roots", "run"]
