"""Durable file replacement, shared by everything that writes a file another process must trust.

:func:`write_atomically` leaves either the old file or the complete new one at ``path``, never
a mix, and the new one survives a power loss once the call returns: the bytes go to a uniquely
named temporary file in the same directory, which is flushed and fsynced, renamed over
``path``, and then the directory itself is fsynced so that the rename is durable.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably (see the module docs); creates missing parents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique temporary name, so two writers never truncate each other's half-written file.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # Never leave a stray temporary file behind a failed write.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(path.parent)


__all__ = ["fsync_directory", "write_atomically"]
