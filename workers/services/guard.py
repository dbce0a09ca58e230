"""The process guard: runs one service's command in its own process group, tied to its owner.

``python -m workers.services.guard OWNER_FD GRACE_S LOG_PATH -- PROGRAM [ARG...]``

The owner (the orchestrator that launched the stack) starts this guard in a new session with the
read end of a pipe as ``OWNER_FD`` and keeps the write end for as long as it lives; the guard:

- starts the command in a new process group (its leader is the command), stdin from /dev/null,
  stdout and stderr appended to ``LOG_PATH``, with the guard's own environment and directory;
- prints one JSON line on stdout, ``{"pid", "start", "guard", "guard_start"}`` (``start``: the
  leader's start time in clock ticks, from /proc, so that a reused pid is never taken for it;
  ``guard``: its own pid), or ``{"error": ...}`` and exits 127 when the command cannot be started;
- on EOF on ``OWNER_FD`` (the owner died, SIGKILL included: the kernel closes its end) kills the
  whole group with SIGKILL at once;
- on SIGTERM (a stop) sends SIGTERM to the group, then SIGKILL after ``GRACE_S``;
- once the leader has exited, kills what is left of its group (a child that outlived it), prints
  ``{"exit": code}`` and exits with the leader's status: its exit code, or 128 + the signal that
  ended it (the line serves an owner that started the guard through an intermediate process).

A command must stay in the foreground: one that detaches into a session of its own escapes its
group, and with it every guarantee above.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print("usage: python -m workers.services.guard OWNER_FD GRACE_S LOG_PATH -- PROGRAM [ARG...]",
              file=sys.stderr)
        return 2
    owner_fd, grace, log_path, command = int(argv[0]), float(argv[1]), argv[2], argv[4:]
    stopping: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, lambda *_: stopping.setdefault("at", time.monotonic()))
    try:
        with open(log_path, "ab", buffering=0) as log:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    except OSError as exc:
        print(json.dumps({"error": f"cannot start {command[0]!r}: {exc.strerror or exc}"}), flush=True)
        return 127
    print(json.dumps({"pid": child.pid, "start": start_time(child.pid), "guard": os.getpid(),
                      "guard_start": start_time(os.getpid())}), flush=True)
    termed = killed = False
    while child.poll() is None:
        readable, _, _ = select.select([owner_fd], [], [], 0.05)
        if readable and not os.read(owner_fd, 64):
            _killpg(child.pid, signal.SIGKILL)  # the owner is gone: nothing of the group outlives it
            killed = True
        if "at" in stopping and not termed:
            _killpg(child.pid, signal.SIGTERM)
            termed = True
        if termed and not killed and time.monotonic() - stopping["at"] >= grace:
            _killpg(child.pid, signal.SIGKILL)
            killed = True
    _killpg(child.pid, signal.SIGKILL)  # what outlived the leader in its group
    code = child.returncode
    code = code if code >= 0 else 128 - code
    try:
        print(json.dumps({"exit": code}), flush=True)  # for an owner that is not this guard's parent
    except (BrokenPipeError, OSError):
        pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
