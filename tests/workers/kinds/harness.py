"""A participant kind on a real aiohttp server on loopback: control routes plus a test data plane.

:class:`KindServer` builds ``ControlPlane(participant, state_dir=...)``, mounts the checkpoint
routes with the bearer token, lets the test add its own data-plane routes (which call the kind's
API), binds 127.0.0.1 on an ephemeral port and talks to both over a real ``aiohttp`` client. A
:class:`~workers.protocol.ProtocolError` raised by a data-plane handler is answered with its typed
body and status, as a real server would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import aiohttp
from aiohttp import web

from workers.participant.base import Participant
from workers.participant.control import ControlPlane
from workers.participant.routes import mount
from workers.protocol import CONTROL_PREFIX, ProtocolError

TOKEN = "kinds-test-token"
P = TypeVar("P", bound=Participant)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


@web.middleware
async def protocol_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProtocolError as exc:
        return web.json_response(exc.body(), status=exc.status)


class KindServer(Generic[P]):
    def __init__(self, participant: P, state_dir: Path, **options: Any) -> None:
        self.participant = participant
        # The tests' checkpoints live beside the state directory (both in the test's tmp_path).
        options.setdefault("checkpoint_root", state_dir.parent)
        self.control = ControlPlane(participant, state_dir=state_dir, **options)
        self.app = web.Application(middlewares=[protocol_errors])
        mount(self.app, self.control, token=TOKEN)
        self._runner = web.AppRunner(self.app)
        self._client: aiohttp.ClientSession | None = None
        self.base = ""

    async def start(self) -> KindServer[P]:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"
        self._client = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        await self._runner.cleanup()

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None
        return self._client

    async def ctl(self, op: str, checkpoint_id: str, *, seconds: float = 10.0, **fields: Any
                  ) -> tuple[int, dict[str, Any]]:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline(seconds), **fields}
        async with self.client.post(f"{self.base}{CONTROL_PREFIX}/{op}", json=body,
                                    headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            return resp.status, await resp.json(content_type=None)

    async def ok(self, op: str, checkpoint_id: str, **fields: Any) -> dict[str, Any]:
        status, body = await self.ctl(op, checkpoint_id, **fields)
        assert status == 200, (op, status, body)
        return body

    async def status(self) -> dict[str, Any]:
        async with self.client.get(f"{self.base}{CONTROL_PREFIX}/status",
                                   headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None
                   ) -> tuple[int, Any, dict[str, str]]:
        """A data-plane call: status, JSON (or text) body, reply headers."""
        async with self.client.post(f"{self.base}{path}", json=body if body is not None else {},
                                    headers=headers or {}) as resp:
            text = await resp.text()
            try:
                parsed: Any = await resp.json(content_type=None)
            except ValueError:
                parsed = text
            return resp.status, parsed, dict(resp.headers)


def error_code(body: Any) -> str:
    return str(body["error"]["code"])


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` holds (the server runs in this loop)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
