"""``SGLangEngine.flush_cache`` against a scripted loopback server: a 400 (requests still running)
is tried again ``flush_interval`` later, up to ``flush_attempts`` tries in all; any other error is
raised at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from workers.inference import SGLangConfig
from workers.inference.engine import EngineCallError
from workers.inference.sglang import SGLangEngine


class Flush:
    """``/flush_cache`` answers the scripted statuses in turn, then 200."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.calls = 0
        self.url = ""

    async def flush(self, _: web.Request) -> web.Response:
        self.calls += 1
        status = self.script.pop(0) if self.script else 200
        return web.Response(status=status, text="busy" if status != 200 else "Cache flushed.")


@pytest.fixture
async def server() -> AsyncIterator[Flush]:
    flush = Flush()
    app = web.Application()
    app.router.add_post("/flush_cache", flush.flush)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    flush.url = f"http://{host}:{port}"
    yield flush
    await runner.cleanup()


async def test_a_refused_flush_is_tried_again_after_the_interval(server: Flush) -> None:
    server.script = [400, 400]
    engine = SGLangEngine(SGLangConfig(server.url, timeout=5.0, flush_attempts=3, flush_interval=0.05))
    try:
        started = time.monotonic()
        await engine.flush_cache()
        elapsed = time.monotonic() - started
    finally:
        await engine.close()
    assert server.calls == 3
    assert elapsed >= 0.1  # two waits of flush_interval


async def test_the_last_refusal_is_raised_after_the_attempts(server: Flush) -> None:
    server.script = [400] * 5
    engine = SGLangEngine(SGLangConfig(server.url, timeout=5.0, flush_attempts=60, flush_interval=0.0))
    try:
        with pytest.raises(EngineCallError) as err:
            await engine.flush_cache(attempts=4)
    finally:
        await engine.close()
    assert err.value.status == 400 and server.calls == 4


async def test_another_error_is_not_retried(server: Flush) -> None:
    server.script = [500]
    engine = SGLangEngine(SGLangConfig(server.url, timeout=5.0, flush_attempts=5, flush_interval=0.0))
    try:
        with pytest.raises(EngineCallError) as err:
            await engine.flush_cache()
    finally:
        await engine.close()
    assert err.value.status == 500 and server.calls == 1
