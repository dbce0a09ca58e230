"""A pre-imported parent that forks the harness's short-lived processes (a "zygote").

The crash drills start hundreds of real processes: orchestrators SIGKILLed at a commit, then a
second one that must finish. A fresh interpreter spends well over a second of CPU importing the
engine before it does anything, which on a two-core machine is most of what a drill costs. The
zygote imports the given modules once, then forks a child per request. The child sets its
environment, working directory and standard streams (files), runs the module as ``python -m``
would (:func:`runpy.run_module` as ``__main__``, so ``multiprocessing``'s spawned children
import it as they would) and exits with its code. The child is still its own process, killed and
reaped for real; only the imports are shared.

What differs from ``python -m`` and why it does not matter here: the preloaded modules were
imported under the zygote's environment, so a module that read the environment at import time
would see the wrong one (none of ``engine``, ``journal`` or ``workers`` does: each reads it when
called); the child's parent is the zygote, not the test. The zygote forks from a single thread
(no event loop runs in it), so no lock is held across a fork.

Protocol, one JSON object per line: the test writes ``{"id", "module", "args", "env", "cwd",
"stdin", "stdout", "stderr", "append_stderr"}`` to the zygote's stdin; the zygote answers ``{"id", "pid"}`` once
the child is forked and ``{"id", "code"}`` when it has exited (``code`` as
:attr:`subprocess.Popen.returncode`: negative for a signal).

    python -m tests.support.zygote MODULE...   # the modules to import first
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: What the session's zygote imports: the CLI (every registered family with it), the harness
#: workers, the reference inference engine (torch: 2.7 s of CPU per engine otherwise) and the
#: reference participants. Nothing here opens a connection or starts a Python thread at import
#: (torch starts one native thread, as it does in every process that ``fork``s after importing
#: it, such as a DataLoader's).
PRELOAD = ("engine.cli.commands", "engine.runtime.service", "tests.support.training_worker",
           "tests.support.workflow_worker", "tests.support.pipeline_worker", "tests.support.batching_worker", "workers.inference.reference",
           "workers.reference.environment", "workers.reference.agent", "workers.reference.model",
           "workers.reference.resources")


# -- the zygote's side ------------------------------------------------------------------------------

def _child(req: dict[str, Any]) -> None:
    """In the forked child: become the requested process, run it, never return."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        err_mode = os.O_APPEND if req.get("append_stderr") else os.O_TRUNC
        for fd, path, flags in ((0, req.get("stdin") or os.devnull, os.O_RDONLY),
                                (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | err_mode)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["module"], *req["args"]]
        code = 0
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # what an uncaught exception does to `python -m`
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _emit(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def serve(preload: list[str]) -> None:
    """Import ``preload``, say ``ready``, then fork a child per request until stdin closes."""
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the preloaded objects stay shared with the children instead of being copied
    _emit({"ready": os.getpid()})
    children: dict[int, Any] = {}
    buffer = b""
    open_ = True
    while open_ or children:
        readable, _, _ = select.select([0] if open_ else [], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                open_ = False
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                children[pid] = req["id"]
                _emit({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                _emit({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


# -- the test's side ------------------------------------------------------------------------------

class Zygote:
    """A running zygote; :meth:`run` is safe to call from several event loops and threads at once."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", *preload], cwd=ROOT,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the zygote exited before it was ready ({self._proc.wait()})")
        self._lock = threading.Lock()
        self._next = 0
        self._pids: dict[int, Future[int]] = {}
        self._codes: dict[int, Future[int]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "pid" in message:
                    self._pids.pop(message["id"]).set_result(message["pid"])
                else:
                    self._codes.pop(message["id"]).set_result(message["code"])
        with self._lock:  # the zygote is gone: nothing pending will be answered
            for fut in (*self._pids.values(), *self._codes.values()):
                fut.set_exception(RuntimeError("the zygote exited"))
            self._pids.clear()
            self._codes.clear()

    def start(self, module: str, args: list[str], *, env: dict[str, str], cwd: Path, stdout: Path,
              stderr: Path, stdin: Path | None = None, append_stderr: bool = False) -> tuple[int, Future[int]]:
        """Fork ``python -m module args``; its pid and a future of its exit code. The streams are
        files, truncated first (``stderr`` appended to when ``append_stderr``)."""
        assert self._proc.stdin is not None
        pid: Future[int] = Future()
        code: Future[int] = Future()
        with self._lock:
            self._next += 1
            ident = self._next
            self._pids[ident], self._codes[ident] = pid, code
            self._proc.stdin.write((json.dumps({
                "id": ident, "module": module, "args": args, "env": env, "cwd": str(cwd),
                "stdin": str(stdin) if stdin else None, "stdout": str(stdout), "stderr": str(stderr),
                "append_stderr": append_stderr}) + "\n").encode())
            self._proc.stdin.flush()
        return pid.result(timeout=30), code

    def spawn(self, module: str, args: list[str], *, env: dict[str, str], cwd: Path, stdout: Path,
              stderr: Path, append_stderr: bool = False) -> Child:
        """Fork ``python -m module args`` and return at once: a :class:`Child` to poll, wait for or kill."""
        pid, code = self.start(module, args, env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                               append_stderr=append_stderr)
        return Child([module, *args], pid, code)

    async def run(self, module: str, args: list[str], *, env: dict[str, str], cwd: Path, stdout: Path,
                  stderr: Path, stdin: Path | None = None, timeout: float) -> int:
        """Run it to its end (SIGKILLed after ``timeout`` s, then ``TimeoutError``); its exit code."""
        pid, code = await asyncio.to_thread(self.start, module, args, env=env, cwd=cwd, stdout=stdout,
                                            stderr=stderr, stdin=stdin)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(code)), timeout)
        except BaseException:  # a time-out, or the caller cancelled: the process must not outlive it
            if not code.done():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await asyncio.wrap_future(code)
            raise

    async def communicate(self, module: str, args: list[str], *, env: dict[str, str], cwd: Path = ROOT,
                          input: bytes | None = None, timeout: float) -> tuple[int, bytes, bytes]:
        """Like ``asyncio.create_subprocess_exec(python, -m, ...)`` then ``communicate(input)``: the exit
        code, stdout and stderr (the streams go through files in a temporary directory)."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
            folder = Path(tmp)
            stdin = None
            if input is not None:
                stdin = folder / "stdin"
                stdin.write_bytes(input)
            code = await self.run(module, args, env=env, cwd=cwd, stdout=folder / "stdout",
                                  stderr=folder / "stderr", stdin=stdin, timeout=timeout)
            return code, (folder / "stdout").read_bytes(), (folder / "stderr").read_bytes()

    def call(self, module: str, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT,
             input: str | None = None, timeout: float) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run([python, -m, module, *args], capture_output=True, text=True)``
        (``env`` defaults to this process's environment; ``TimeoutExpired`` after SIGKILL)."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
            folder = Path(tmp)
            stdin = None
            if input is not None:
                stdin = folder / "stdin"
                stdin.write_text(input)
            pid, code = self.start(module, args, env=dict(os.environ) if env is None else env, cwd=cwd,
                                   stdout=folder / "stdout", stderr=folder / "stderr", stdin=stdin)
            try:
                returncode = code.result(timeout=timeout)
            except TimeoutError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                code.result()
                raise subprocess.TimeoutExpired([module, *args], timeout) from None
            return subprocess.CompletedProcess([module, *args], returncode, (folder / "stdout").read_text(),
                                               (folder / "stderr").read_text())

    def close(self) -> None:
        """Stop taking requests; the zygote exits once its children have."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class Child:
    """A process the zygote forked, with the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, args: list[str], pid: int, code: Future[int]) -> None:
        self.args, self.pid, self._code = args, pid, code

    @property
    def returncode(self) -> int | None:
        return self._code.result() if self._code.done() else None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._code.result(timeout=timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None

    def send_signal(self, signum: int) -> None:
        # Once the zygote has reaped the child its pid may be reused: signal only a live child.
        if not self._code.done():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_server(module: str, args: list[str], *, env: dict[str, str], cwd: Path, log: Path,
                 timeout: float, what: str) -> tuple[Child, str]:
    """Fork a server from :func:`shared` and wait for its ``listening on URL`` line: the child and
    the URL. Its stdout goes to ``LOG.out``, its stderr is appended to ``log``. A child that exits
    or does not listen within ``timeout`` s is SIGKILLed and ``RuntimeError`` names ``what`` with
    the log's tail."""
    out = log.with_name(log.name + ".out")
    child = shared().spawn(module, args, env=env, cwd=cwd, stdout=out, stderr=log, append_stderr=True)
    end = time.monotonic() + timeout
    while True:
        text = out.read_text(errors="replace") if out.exists() else ""  # the child creates it
        for line in text.splitlines():
            if line.startswith("listening on "):
                return child, line.split()[-1].rstrip("/")
        if child.poll() is not None or time.monotonic() > end:
            child.kill()
            child.wait(10)
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not start (exit {child.returncode}):\n{tail}")
        time.sleep(0.02)


_SHARED: Zygote | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Zygote:
    """This test process's zygote (one per xdist worker), started on first use with ``PRELOAD``
    and closed when the process exits."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._proc.poll() is not None:
            _SHARED = Zygote(list(PRELOAD))
            atexit.register(_SHARED.close)
        return _SHARED


if __name__ == "__main__":
    serve(sys.argv[1:])
