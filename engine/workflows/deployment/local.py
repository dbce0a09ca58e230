"""The ``uni`` executor: one service as a local process group under a guard
(:mod:`workers.services.guard`), tied to this process by the owner pipe.

Every owner pipe's write end is held by this process only: it is not inheritable (PEP 446), and a
child forked from this process closes it at once (``os.register_at_fork``), so the guards see EOF
exactly when this process dies, however it dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workers.services.guard import start_time

_OWNER_ENDS: set[int] = set()


def _close_owner_ends_in_child() -> None:
    for fd in list(_OWNER_ENDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _OWNER_ENDS.clear()


os.register_at_fork(after_in_child=_close_owner_ends_in_child)


class LaunchFailed(Exception):
    """The command could not be started (the guard said why)."""


@dataclass
class LocalProcess:
    """A launched service: its guard, and the group its command leads."""

    name: str
    guard: asyncio.subprocess.Process
    pid: int
    start: int | None
    owner_fd: int
    host: str = field(default_factory=socket.gethostname)
    _exit: asyncio.Task[int] | None = None

    @classmethod
    async def launch(cls, name: str, argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path,
                     grace_s: float) -> LocalProcess:
        """Start ``argv`` under a guard; ``LaunchFailed`` when the program cannot be started."""
        read_end, write_end = os.pipe()
        _OWNER_ENDS.add(write_end)
        try:
            guard = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.services.guard", str(read_end), str(grace_s), str(log_path), "--",
                *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, pass_fds=(read_end,), start_new_session=True)
        except BaseException:
            _OWNER_ENDS.discard(write_end)
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        assert guard.stdout is not None
        try:
            line = await guard.stdout.readline()
            said = json.loads(line) if line.strip() else {"error": f"the guard exited with {await guard.wait()}"}
        except BaseException:
            # Cancelled (a peer failed) or unreadable: the closed owner end makes the guard kill
            # whatever it started, so no launch outlives this call.
            # (The guard is not killed here: it might die before it killed the group.)
            _OWNER_ENDS.discard(write_end)
            os.close(write_end)
            raise
        if "pid" not in said:
            _OWNER_ENDS.discard(write_end)
            os.close(write_end)
            await guard.wait()
            raise LaunchFailed(str(said.get("error")))
        start = said.get("start")
        proc = cls(name, guard, int(said["pid"]), None if start is None else int(start), write_end)
        proc._exit = asyncio.ensure_future(proc._wait())
        return proc

    async def _wait(self) -> int:
        code = await self.guard.wait()
        self._release()
        return code

    def _release(self) -> None:
        if self.owner_fd in _OWNER_ENDS:
            _OWNER_ENDS.discard(self.owner_fd)
            try:
                os.close(self.owner_fd)
            except OSError:
                pass

    @property
    def exited(self) -> asyncio.Task[int]:
        """Done when the service has exited; its result is the exit code (128 + signal if killed)."""
        assert self._exit is not None
        return self._exit

    @property
    def pids(self) -> dict[str, int | None]:
        return {"guard": self.guard.pid, "service": self.pid, "start": self.start}

    async def stop(self, grace_s: float) -> int:
        """SIGTERM to the group (through the guard), SIGKILL after ``grace_s``; the exit code."""
        if not self.exited.done():
            try:
                self.guard.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            return await asyncio.wait_for(asyncio.shield(self.exited), grace_s + 5.0)
        except asyncio.TimeoutError:
            self.kill()
            return await self.exited

    def gone(self) -> bool:
        """Whether the group's leader is confirmed gone (the same pid and start time no longer run)."""
        return not group_alive(self.pids)

    #: A local service's readiness command runs here (no remote runner).
    check = None

    def kill(self) -> None:
        """SIGKILL the group and its guard now (closing the owner pipe alone would do it too)."""
        if start_time(self.pid) == self.start:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.guard.kill()
        except ProcessLookupError:
            pass
        self._release()


def group_alive(pids: dict[str, int | None] | None) -> bool:
    """Whether a recorded process group (``pids`` of a row on this host) still has its leader: the
    same pid with the same start time, so that a reused pid is not taken for it."""
    if not pids or pids.get("service") is None:
        return False
    pid = int(pids["service"] or 0)
    return pid > 0 and start_time(pid) is not None and start_time(pid) == pids.get("start")


def kill_group(pids: dict[str, int | None] | None) -> None:
    """SIGKILL a recorded group on this host if its leader is still the same process."""
    if group_alive(pids):
        assert pids is not None
        try:
            os.killpg(int(pids["service"] or 0), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
