"""A participant's control plane on a real aiohttp server on loopback, and episodes to drive.

:class:`ControlServer` mounts :func:`workers.participant.routes.mount` on an
application bound to 127.0.0.1 (an ephemeral port) and calls its routes over
HTTP with a real client. :class:`ScriptedEpisode` runs one environment episode
in a task whose steps advance only when the test releases them, so a test can
hold an episode inside a step, at a boundary, or parked.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from workers.participant.base import Participant
from workers.participant.control import ControlPlane
from workers.participant.kinds.environment import EnvironmentParticipant
from workers.participant.routes import mount
from workers.participant.steps import StepMode
from workers.protocol import CONTROL_PREFIX, EpisodeId

TOKEN = "test-control-token"


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


class ControlServer:
    def __init__(self, participant: Participant, state_dir: Path, **options: Any) -> None:
        self.participant = participant
        # The tests' checkpoints live beside the state directory (both in the test's tmp_path).
        options.setdefault("checkpoint_root", state_dir.parent)
        self.control = ControlPlane(participant, state_dir=state_dir, **options)
        self.app = web.Application()
        mount(self.app, self.control, token=TOKEN)
        self._runner = web.AppRunner(self.app)
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> ControlServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}{CONTROL_PREFIX}"
        self._session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._runner.cleanup()

    async def post(self, op: str, body: Any, *, token: str | None = TOKEN, raw: bytes | None = None
                   ) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        data = raw if raw is not None else None
        kwargs: dict[str, Any] = {"data": data} if raw is not None else {"json": body}
        async with self._session.post(f"{self.url}/{op}", headers=headers, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)

    async def call(self, op: str, checkpoint_id: str, *, seconds: float = 10.0, **fields: Any
                   ) -> tuple[int, dict[str, Any]]:
        return await self.post(op, {"checkpoint_id": checkpoint_id, "deadline_ts": deadline(seconds), **fields})

    async def ok(self, op: str, checkpoint_id: str, **fields: Any) -> dict[str, Any]:
        status, body = await self.call(op, checkpoint_id, **fields)
        assert status == 200, (op, status, body)
        return body

    async def status(self, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with self._session.get(f"{self.url}/status", headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def phase(self) -> str:
        _, body = await self.status()
        return str(body["phase"])


def error_code(body: dict[str, Any]) -> str:
    return str(body["error"]["code"])


class ScriptedEpisode:
    """One environment episode whose steps run only when released (:meth:`release`).

    State is ``{"turn": n, "log": [...]}``; each step appends its turn, so a restored episode
    shows exactly which steps ran before the checkpoint.
    """

    def __init__(self, env: EnvironmentParticipant, rollout_id: str, *, attempt: int = 0, turns: int = 3,
                 mode: StepMode = "wait", task: Any = None, deadline_s: float | None = None) -> None:
        self.env = env
        self.id = EpisodeId(rollout_id=rollout_id, attempt=attempt)
        self.turns = turns
        self.mode = mode
        self.task = task if task is not None else {"task": rollout_id}
        self.deadline_s = deadline_s
        self._go: asyncio.Queue[None] = asyncio.Queue()
        self.in_step = asyncio.Event()
        self.steps_run = 0
        self.continuation: Any = None
        self.result: Any = None
        self.task_handle: asyncio.Task[Any] | None = None

    def start(self) -> ScriptedEpisode:
        self.task_handle = asyncio.get_running_loop().create_task(self._run())
        return self

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._go.put_nowait(None)

    async def _run(self) -> Any:
        async with self.env.episode(self.id, self.task, deadline_s=self.deadline_s) as ep:
            self.continuation = ep.continuation
            state = ep.continuation if ep.continuation is not None else {"turn": 0, "log": []}
            while state["turn"] < self.turns:
                async with ep.step(self.mode):
                    self.in_step.set()
                    await self._go.get()
                    self.in_step.clear()
                    self.steps_run += 1
                    state = {"turn": state["turn"] + 1, "log": [*state["log"], state["turn"] + 1]}
                await ep.boundary(state)
            self.result = state
            return state
