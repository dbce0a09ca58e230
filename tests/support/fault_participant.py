"""A real participant on loopback with one injected fault on its control routes.

The participant is the kit's own (``ControlPlane`` over a stateless ``ResourcesParticipant``);
a middleware injects the fault a real server cannot be made to produce on demand:

- ``hang`` — every control POST is accepted and never answered;
- ``error`` — every control POST answers HTTP 500;
- ``slow`` — ``prepare`` does its work, then its answer takes ``delay_s`` to arrive;
- ``export_failed`` — the commits of the first checkpoint id it is asked to commit answer
  ``409 export_failed``, as the kit answers every commit of a checkpoint whose export failed (a
  real export fails only on state no reference server holds); later ids commit as normal.

``GET status`` always answers, so discovery finds the participant healthy. :meth:`stop` makes it
a participant that is down.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from workers.participant import ControlPlane, mount
from workers.participant.kinds import ResourcesParticipant
from workers.protocol import CONTROL_PREFIX, ErrorCode, ProtocolError

from .reference_procs import TOKEN


class FaultyParticipant:
    def __init__(self, fault: str, state_dir: Path, *, delay_s: float = 0.0, instance: str = "faulty-0",
                 checkpoint_root: Path | None = None) -> None:
        self.fault = fault
        self.delay_s = delay_s
        self.control = ControlPlane(ResourcesParticipant(instance, mode="stateless"), state_dir=state_dir,
                                    checkpoint_root=checkpoint_root)
        self.calls: list[str] = []
        self.failed_export: str | None = None
        self._never = asyncio.Event()
        app = web.Application(middlewares=[self._inject])
        mount(app, self.control, token=TOKEN)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        self.url = ""

    @web.middleware
    async def _inject(self, request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        if request.method == "POST" and request.path.startswith(CONTROL_PREFIX):
            op = request.path.rsplit("/", 1)[-1]
            self.calls.append(op)
            if self.fault == "hang":
                await self._never.wait()
            if self.fault == "error":
                return web.Response(status=500, text="injected failure")
            if self.fault == "export_failed" and op == "commit":
                checkpoint_id = (await request.json()).get("checkpoint_id")
                self.failed_export = self.failed_export or checkpoint_id
                if checkpoint_id == self.failed_export:
                    return web.json_response(ProtocolError(ErrorCode.EXPORT_FAILED, (
                        f"checkpoint {checkpoint_id!r}: its export failed (injected); resume, then prepare "
                        "again under a new id")).body(), status=409)
            if self.fault == "slow" and op == "prepare":
                response = await handler(request)
                await asyncio.sleep(self.delay_s)  # the answer is slow to arrive, not the work
                return response
        return await handler(request)

    async def start(self) -> FaultyParticipant:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        self._never.set()
        await self._runner.cleanup()
