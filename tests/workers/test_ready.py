"""``python -m workers.participant.ready``: exit 0 only when the participant's checkpoint status
answers 200 to the control token; 1 with the reason (and no token) otherwise; 2 without a token.
Against a real aiohttp server on loopback that checks the token as the participant kit does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from engine.demos.ports import free_port
from workers.participant.ready import STATUS_PATH, check

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ready-test-token-xyz"


@pytest.fixture
async def status_server() -> AsyncIterator[str]:
    async def status(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"code": "unauthorized"}}, status=401)
        return web.json_response({"phase": "idle"})

    app = web.Application()
    app.router.add_get(STATUS_PATH, status)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_check_needs_the_token_and_a_200(status_server: str) -> None:
    assert await asyncio.to_thread(check, status_server, TOKEN, 2.0) is None
    assert await asyncio.to_thread(check, status_server + "/", TOKEN, 2.0) is None
    assert await asyncio.to_thread(check, status_server, "wrong", 2.0) == "HTTP 401"
    why = await asyncio.to_thread(check, f"http://127.0.0.1:{free_port()}", TOKEN, 2.0)
    assert why is not None and "refused" in why.lower(), why


async def test_the_command_exits_by_the_answer_and_never_prints_the_token(status_server: str) -> None:
    def run(url: str, token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TIDELOG_CONTROL_TOKEN"}
        if token is not None:
            env["TIDELOG_CONTROL_TOKEN"] = token
        return subprocess.run([sys.executable, "-m", "workers.participant.ready", url], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=30)

    ok = await asyncio.to_thread(run, status_server, TOKEN)
    assert ok.returncode == 0, ok.stderr
    refused = await asyncio.to_thread(run, status_server, TOKEN + "-other")
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr and TOKEN not in refused.stderr
    missing = await asyncio.to_thread(run, status_server, None)
    assert missing.returncode == 2 and "TIDELOG_CONTROL_TOKEN is not set" in missing.stderr
