"""A real aiohttp server that applies each idempotency key once and counts every call.

- ``POST /apply``: needs ``Idempotency-Key``; the first call with a key applies
  the effect (records it) and its reply is stored; a repeat returns the stored
  reply without applying again. Every call is counted per key.
- Fencing: it remembers the highest ``X-Tidelog-Epoch`` it has seen and refuses
  a lower one with 409 ``stale_epoch`` (counted in ``refused``).
- ``GET /ng-control/v1/checkpoint/status``: a participant status reply, so
  discovery can probe it; ``hold_epoch`` makes it hold the first status call of
  that epoch until ``release`` is set, then drop the connection.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class CountingServer:
    kind: str = "environment"
    calls: Counter[str] = field(default_factory=Counter)
    applied: dict[str, Any] = field(default_factory=dict)
    effects: list[Any] = field(default_factory=list)
    max_epoch: int = 0
    epochs_seen: list[int] = field(default_factory=list)
    refused: list[tuple[str, int]] = field(default_factory=list)
    hold_epoch: int | None = None
    held: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _runner: web.AppRunner | None = None

    def _fence(self, request: web.Request) -> web.Response | None:
        raw = request.headers.get("X-Tidelog-Epoch")
        if raw is None:
            return None
        epoch = int(raw)
        self.epochs_seen.append(epoch)
        if epoch < self.max_epoch:
            self.refused.append((request.path, epoch))
            return web.json_response({"error": {"code": "stale_epoch",
                                                "detail": f"epoch {epoch} < {self.max_epoch}"}}, status=409)
        self.max_epoch = epoch
        return None

    async def apply(self, request: web.Request) -> web.Response:
        refused = self._fence(request)
        if refused is not None:
            return refused
        key = request.headers.get("Idempotency-Key")
        if not key:
            return web.json_response({"error": {"code": "missing_key", "detail": "Idempotency-Key"}}, status=400)
        self.calls[key] += 1
        body = await request.json()
        if key not in self.applied:
            self.effects.append(body)
            self.applied[key] = {"applied": body, "n": len(self.effects)}
        return web.json_response(self.applied[key])

    async def status(self, request: web.Request) -> web.StreamResponse:
        raw = request.headers.get("X-Tidelog-Epoch")
        if self.hold_epoch is not None and raw is not None and int(raw) == self.hold_epoch \
                and not self.held.is_set():
            self.held.set()
            await self.release.wait()
            # Drop the connection: the caller sees a transport error and may retry.
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        refused = self._fence(request)
        if refused is not None:
            return refused
        return web.json_response({"kind": self.kind, "instance": "count-0", "phase": "idle",
                                  "checkpoint_id": None, "lease_expires_at": None, "retired_rollouts": 0})

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/apply", self.apply)
        app.router.add_get("/ng-control/v1/checkpoint/status", self.status)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        host, bound = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
