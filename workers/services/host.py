"""The far side of a ``ray`` service: :class:`ServiceHost`, made a Ray actor by the orchestrator
(``ray.remote(ServiceHost)``) and placed on a node, runs one service there under the process guard
(:mod:`workers.services.guard`), exactly as the ``uni`` executor does locally.

The actor process holds the owner end of the guard's pipe. Ray kills a (non-detached) actor when
the driver that created it dies, so the orchestrator's death closes the pipe, and the guard kills
the service's whole group with SIGKILL. The service's log is written on the node and read back in
slices (:meth:`read_log`) by the orchestrator, which appends it to ``run_dir/SERVICE.log``.
No pid of this node is ever signalled from elsewhere: every signal goes through this actor.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from workers.services.guard import start_time

#: At most this much of the log is returned by one :meth:`ServiceHost.read_log`.
LOG_SLICE = 1 << 20


class ServiceHost:
    """One service on this node (see the module docs). Every method is a plain call: the actor
    runs them one at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"tidelog-{name}-")
        self.log = os.path.join(self.dir, f"{name}.log")
        self.out: IO[bytes] | None = None
        self.code: int | None = None
        self.pid = self.guard_pid = 0
        self.start_ticks: int | None = None
        self.guard_start: int | None = None
        self.owner_fd: int | None = None

    def node(self) -> str:
        """This node's address (what ``{host}`` becomes in the service's endpoint)."""
        try:
            import ray  # noqa: PLC0415 - only inside a Ray worker

            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        except Exception:  # noqa: BLE001 - outside Ray (tests of this class): the host's address
            return socket.gethostbyname(socket.gethostname())

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, grace_s: float) -> dict[str, Any]:
        """Start the guard (which starts the command); ``{"pid", "start", ...}`` or ``{"error"}``.

        The guard is started through a shell that exits at once, so it is not this actor's child:
        Ray kills a dying worker's children, and a guard killed with it could not kill the group.
        It reports the exit on its stdout instead (``{"exit": code}``)."""
        read_end, write_end = os.pipe()
        guard = [sys.executable, "-m", "workers.services.guard", str(read_end), str(grace_s), self.log, "--", *argv]
        try:
            shell = subprocess.Popen(["sh", "-c", '"$@" &', "sh", *guard], env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     pass_fds=(read_end,), start_new_session=True)
        except OSError as exc:
            os.close(write_end)
            return {"error": f"cannot start the guard: {exc.strerror or exc}"}
        finally:
            os.close(read_end)
        self.owner_fd = write_end
        assert shell.stdout is not None
        self.out = shell.stdout
        line = self.out.readline()
        shell.wait()
        said: dict[str, Any] = json.loads(line) if line.strip() else {"error": "the guard did not start"}
        if "pid" in said:
            self.pid, self.start_ticks = int(said["pid"]), said.get("start")
            self.guard_pid, self.guard_start = int(said["guard"]), said.get("guard_start")
        else:
            self.kill()
        return said

    def wait(self, timeout: float) -> int | None:
        """The service's exit code (as the guard reports it) once it has exited, else ``None``
        after ``timeout`` seconds. A guard gone without a word counts as exit code 255."""
        if self.out is None:
            return self.code
        if self.code is None:
            readable, _, _ = select.select([self.out], [], [], timeout)
            if not readable:
                return None
            line = self.out.readline()
            self.code = int(json.loads(line)["exit"]) if line.strip() else 255
        return self.code

    def read_log(self, offset: int) -> tuple[bytes, int]:
        """The log from ``offset`` (at most :data:`LOG_SLICE` bytes) and the offset after it."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read(LOG_SLICE)
        except OSError:
            return b"", offset
        return data, offset + len(data)

    def stop(self, grace_s: float) -> int:
        """SIGTERM through the guard, SIGKILL after ``grace_s``; the exit code."""
        if self.out is None:
            return 0
        if self.code is None and self._guard_is_ours():
            os.kill(self.guard_pid, signal.SIGTERM)
        code = self.wait(grace_s + 5.0)
        if code is None:
            self.kill()
            code = self.wait(5.0)
        return 255 if code is None else code

    def kill(self) -> None:
        """SIGKILL the group (if its leader is still the same process) and the guard."""
        if self.pid and start_time(self.pid) == self.start_ticks:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._guard_is_ours():
            os.kill(self.guard_pid, signal.SIGKILL)
        if self.owner_fd is not None:
            os.close(self.owner_fd)
            self.owner_fd = None

    def _guard_is_ours(self) -> bool:
        return bool(self.guard_pid) and start_time(self.guard_pid) == self.guard_start

    def group_alive(self) -> bool:
        return bool(self.pid) and start_time(self.pid) is not None and start_time(self.pid) == self.start_ticks

    def check(self, argv: list[str], env: dict[str, str], cwd: str | None, timeout: float) -> int | str:
        """A readiness command run on this node with the service's environment: its exit code, or
        why it could not run or finish."""
        try:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return f"readiness command {argv[0]!r}: {exc.strerror or exc}"
        end = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"readiness command did not finish within {timeout:g} s"
        return int(proc.returncode)
