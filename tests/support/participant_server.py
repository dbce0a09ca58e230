"""Real aiohttp servers that stand in for participants during discovery tests.

Each answers ``GET /ng-control/v1/checkpoint/status`` in one configurable way:
a valid status of a given kind, an unknown kind, a 404 (not a participant),
a malformed reply, or never answering at all (the handler waits forever).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

STATUS = "/ng-control/v1/checkpoint/status"


class StatusServer:
    def __init__(self, mode: str = "ok", kind: str = "environment", phase: str = "idle") -> None:
        self.mode = mode
        self.kind = kind
        self.phase = phase
        self.calls = 0
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._forever = asyncio.Event()

    async def status(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.headers.append(dict(request.headers))
        if self.mode == "hang":
            await self._forever.wait()
        if self.mode == "404":
            return web.json_response({"error": {"code": "not_found", "detail": "no participant"}}, status=404)
        if self.mode == "garbage":
            return web.json_response({"kind": self.kind})  # no instance, no phase
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        body: dict[str, Any] = {"kind": self.kind, "instance": f"{self.kind}-1", "phase": self.phase,
                                "checkpoint_id": None, "lease_expires_at": None, "retired_rollouts": 0,
                                "report": {"ready": True, "blockers": [], "blocker_count": 0,
                                           "counts": {}, "restarts": []},
                                "extra_field": "participants may add extras"}
        return web.json_response(body)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(STATUS, self.status)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        self._forever.set()
        if self._runner is not None:
            await self._runner.cleanup()
