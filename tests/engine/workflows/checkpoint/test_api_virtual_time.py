"""The checkpoint API on virtual time: the id ``POST /v1/checkpoints`` mints and the resume deadline
``POST /v1/checkpoints/<id>/abort`` writes come from ``orch.clock``, not from the wall clock.

A real orchestrator (both journal backends) on a :class:`VirtualClock` that starts on 2030-01-01, its
API on a loopback port, and one real participant (a status server) that discovery finds healthy.
The checkpoint kind is given a controller that leaves its rows alone, so the row stays exactly
where the API leaves it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa
from aiohttp import web

from engine.config import Settings
from engine.http.app import make_app
from engine.runtime.clock import VirtualClock
from engine.runtime.reconciler import BaseController, Context, Result
from engine.runtime.service import Orchestrator
from journal import models
from tests.support.participant_server import StatusServer
from tests.support.reference_procs import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = datetime(2030, 1, 1, tzinfo=timezone.utc)
RESUME_S = 17.0


class LeavesCheckpointsAlone(BaseController):
    """The checkpoint kind's controller here: it never moves a checkpoint."""

    kind = "checkpoints"

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        return Result()


async def call(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 120.0) -> Any:
    end = time.monotonic() + timeout
    while not (value := await check()):
        assert time.monotonic() < end, f"timed out: {what}"
        await asyncio.sleep(0.05)
    return value


async def test_the_api_mints_ids_and_abort_deadlines_from_the_orchestrators_clock(
        journal_url: str, tmp_path: Path) -> None:
    participant = StatusServer("ok", "environment")
    await participant.start()
    s = Settings.model_validate({
        "journal": {"url": journal_url}, "control": {"token": TOKEN},
        # Virtual time moves only on advance(): a lease it cannot outrun, renewed only after the test.
        "orchestrator": {"lease_ttl_s": 3600, "lease_renew_s": 600, "shutdown_grace_s": 1},
        "discovery": {"probe_timeout_s": 1, "interval_s": 60},
        "checkpoint": {"resume_timeout_s": RESUME_S, "roots": [str(tmp_path)]},
        "participants": [{"name": "env-0", "url": participant.url}],
        "logging": {"level": "WARNING"}})
    clock = VirtualClock(START)
    orch = Orchestrator(s, clock=clock, controllers=[LeavesCheckpointsAlone()])
    runner = web.AppRunner(make_app(orch), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    await orch.start()
    try:
        async def healthy() -> bool:
            _, body = await call("GET", f"{base}/v1/participants")
            return [p["health"] for p in body["participants"]] == ["healthy"]
        await until(healthy, "the participant to be found healthy")

        status, started = await call("POST", f"{base}/v1/checkpoints", headers=AUTH,
                                     json={"directory": str(tmp_path / "ckpts")})
        assert status == 202, started
        cid = started["checkpoint_id"]
        assert cid.startswith("ck-20300101T000000Z-"), cid

        await clock.advance(42.0)
        status, aborted = await call("POST", f"{base}/v1/checkpoints/{cid}/abort", headers=AUTH,
                                     json={"reason": "virtual time"})
        assert status == 202, aborted
        t = models.checkpoints
        async with orch.journal.read() as conn:
            row = (await conn.execute(sa.select(t.c.state, t.c.deadline_ts).where(t.c.id == cid))).one()
        assert row.state == "aborting"
        assert row.deadline_ts == START.timestamp() + 42.0 + RESUME_S
    finally:
        await runner.cleanup()
        await orch.stop()
        await participant.stop()
