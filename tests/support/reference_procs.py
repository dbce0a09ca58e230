"""The reference participants as real processes, and a controller's calls to them.

:class:`RefProc` starts ``python -m workers.reference.<kind> --port 0 --state-dir DIR ...`` (forked
from the test process's zygote)
(:class:`Procs` adds ``--checkpoint-root`` the test's directory)
with ``TIDELOG_CONTROL_TOKEN`` in its environment, reads the port from its
``listening on http://127.0.0.1:PORT`` line, and sends its log (stderr) to a file, whose
tail an error quotes. :class:`Procs` starts them for one test and kills every one it
started at the end. :func:`start_stack` starts the four servers of the reference task
wired together; :class:`ParticipantClient` calls their checkpoint routes and data planes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.zygote import Child, start_server
from workers.protocol import CONTROL_PREFIX

REPO = Path(__file__).resolve().parents[2]
TOKEN = "reference-test-token"
KINDS = ("environment", "model", "agent", "resources")


def deadline(seconds: float = 20.0) -> float:
    return time.time() + seconds


class RefProc:
    """One reference server process, forked from this test process's zygote
    (:func:`tests.support.zygote.start_server`; the reference servers are imported there once:
    0.7 s of CPU per process otherwise)."""

    def __init__(self, kind: str, state_dir: Path, args: tuple[str, ...], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.kind, self.state_dir, self.args, self.log = kind, state_dir, args, log
        self.env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN} if env is None else env
        self.proc: Child | None = None
        self.url = ""

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.arguments()]

    @property
    def module(self) -> str:
        return f"workers.reference.{self.kind}"

    def arguments(self) -> list[str]:
        return ["--port", "0", "--state-dir", str(self.state_dir), *self.args]

    def start(self, timeout: float = 30.0) -> RefProc:
        self.proc, self.url = start_server(self.module, self.arguments(), env=dict(self.env), cwd=REPO,
                                           log=self.log, timeout=timeout, what=self.kind)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Procs:
    """Every process one test started; :meth:`kill_all` ends them (the fixture's finalizer)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[RefProc] = []
        self._n = 0

    def start(self, kind: str, state_dir: Path, *args: str, env: dict[str, str] | None = None) -> RefProc:
        """Start one server; its checkpoint root is the test's directory (which holds the
        orchestrator's checkpoint directory) unless ``args`` name another."""
        self._n += 1
        if "--checkpoint-root" not in args:
            args = ("--checkpoint-root", str(self.tmp), *args)
        proc = RefProc(kind, state_dir, args, self.tmp / f"{self._n:02d}-{kind}.log", env)
        self.started.append(proc)
        return proc.start()

    async def astart(self, kind: str, state_dir: Path, *args: str) -> RefProc:
        return await asyncio.to_thread(self.start, kind, state_dir, *args)

    def kill_all(self) -> None:
        for proc in self.started:
            proc.kill()


@dataclass
class Stack:
    """The four servers of the reference task, by kind."""

    procs: dict[str, RefProc]

    def url(self, kind: str) -> str:
        return self.procs[kind].url

    def kill(self) -> None:
        for proc in self.procs.values():
            proc.kill()


async def start_stack(procs: Procs, dirs: dict[str, Path], *, env_delay: float = 0.0,
                      model_delay: float = 0.0, resources_mode: str | None = None) -> Stack:
    """Model and resources (in ``resources_mode`` when given: ``restart_only`` saves nothing, so
    every rollout is a restart), then the agent (pointed at the model), then the environment."""
    model, resources = await asyncio.gather(
        procs.astart("model", dirs["model"], "--step-delay", str(model_delay)),
        procs.astart("resources", dirs["resources"], *(() if resources_mode is None else ("--mode", resources_mode))))
    agent = await procs.astart("agent", dirs["agent"], "--model", model.url)
    env = await procs.astart("environment", dirs["environment"], "--agent", agent.url,
                             "--resources", resources.url, "--step-delay", str(env_delay))
    return Stack({"environment": env, "model": model, "agent": agent, "resources": resources})


class ParticipantClient:
    """HTTP calls a controller (or a test) makes: checkpoint routes with the bearer, data routes."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.auth = {"Authorization": f"Bearer {TOKEN}"}

    async def status(self, base: str) -> dict[str, Any]:
        async with self.http.get(f"{base}{CONTROL_PREFIX}/status", headers=self.auth) as resp:
            assert resp.status == 200, await resp.text()
            body: dict[str, Any] = await resp.json()
            return body

    async def control(self, base: str, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.http.post(f"{base}{CONTROL_PREFIX}/{op}", json=body, headers=self.auth) as resp:
            return resp.status, await resp.json(content_type=None)

    async def ok(self, base: str, op: str, body: dict[str, Any]) -> dict[str, Any]:
        status, reply = await self.control(base, op, body)
        assert status == 200, f"{op} on {base}: HTTP {status} {reply}"
        return reply

    async def post(self, base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.http.post(f"{base}{path}", json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def run(self, env: str, rollout_id: str, task: dict[str, Any], attempt: int = 0) -> dict[str, Any]:
        status, reply = await self.post(env, "/run", {"rollout_id": rollout_id, "attempt": attempt, "task": task})
        assert status == 200, f"/run of {rollout_id} attempt {attempt}: HTTP {status} {reply}"
        return reply
