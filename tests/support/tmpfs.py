"""A small tmpfs a test mounts, for the disk-full and read-only cases (real filesystems, no mocks).

:func:`mounted_tmpfs` mounts ``tmpfs`` of a given size at a directory and unmounts it at the end.
Mounting needs root (or CAP_SYS_ADMIN): the test machines run the tests as root; anywhere the
mount is refused the test is skipped with the reason printed. :func:`fill` takes every free byte
of it; :func:`remount_read_only` makes it read-only.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(where: Path, size: str = "8m") -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)
        why = "" if done.returncode == 0 else \
            f"mount -t tmpfs exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        why = f"cannot run mount: {exc}"
    if why:
        reason = f"a small tmpfs is needed for the disk-full case and cannot be mounted here (it needs root or CAP_SYS_ADMIN): {why}"
        print(reason)
        pytest.skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)


def fill(where: Path, name: str = ".filler") -> int:
    """Write ``where/name`` until the filesystem has no byte left; the bytes written."""
    fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    written = 0
    try:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    n = os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n
                if n < chunk:
                    break
    finally:
        os.close(fd)
    return written


def remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True, timeout=30)
