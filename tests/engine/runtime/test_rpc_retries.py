"""RpcClient transport retries (tenacity) against a real loopback aiohttp server that drops connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from engine.runtime.rpc import RemoteError, RpcClient, TransportError


class Dropper:
    """``/drop`` closes the connection without a reply; ``/refuse`` answers a typed 409."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.url = ""

    async def drop(self, request: web.Request) -> web.StreamResponse:
        self.calls["drop"] = self.calls.get("drop", 0) + 1
        assert request.transport is not None
        request.transport.abort()  # the client sees the connection go away mid-request
        return web.Response()

    async def refuse(self, _: web.Request) -> web.Response:
        self.calls["refuse"] = self.calls.get("refuse", 0) + 1
        return web.json_response({"error": {"code": "invalid_phase", "detail": "not now"}}, status=409)

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/drop", self.drop)
        app.router.add_route("*", "/refuse", self.refuse)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return runner


@pytest.fixture
async def dropper() -> AsyncIterator[Dropper]:
    d = Dropper()
    runner = await d.start()
    yield d
    await runner.cleanup()


@pytest.mark.parametrize("tries", [1, 3, 5])
async def test_a_dropped_connection_is_tried_exactly_transport_tries_times(dropper: Dropper, tries: int) -> None:
    rpc = RpcClient(token=None, transport_tries=tries, retry_backoff_s=0.01)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            await rpc.call(dropper.url, "POST", "/drop", {"x": 1}, timeout_s=30)
        elapsed = time.monotonic() - started
    finally:
        await rpc.close()
    assert dropper.calls["drop"] == tries
    assert type(err.value) is TransportError and err.value.sent is True
    # The backoff between tries: 0.01, 0.02, 0.04, 0.08 s.
    assert elapsed >= sum(0.01 * 2 ** i for i in range(tries - 1))


async def test_per_call_tries_override_the_client_default(dropper: Dropper) -> None:
    rpc = RpcClient(token=None, transport_tries=5, retry_backoff_s=0.0)
    try:
        with pytest.raises(TransportError):
            await rpc.call(dropper.url, "POST", "/drop", {"x": 1}, timeout_s=30, tries=2)
    finally:
        await rpc.close()
    assert dropper.calls["drop"] == 2


async def test_a_call_not_safe_to_repeat_that_may_have_arrived_is_tried_once(dropper: Dropper) -> None:
    rpc = RpcClient(token=None, transport_tries=4, retry_backoff_s=0.0)
    try:
        with pytest.raises(TransportError) as err:
            await rpc.call(dropper.url, "POST", "/drop", {"x": 1}, timeout_s=30, repeatable=False)
    finally:
        await rpc.close()
    assert dropper.calls["drop"] == 1 and err.value.sent is True


async def test_a_typed_4xx_is_never_retried(dropper: Dropper) -> None:
    rpc = RpcClient(token=None, transport_tries=4, retry_backoff_s=0.0)
    try:
        with pytest.raises(RemoteError) as err:
            await rpc.call(dropper.url, "POST", "/refuse", {"x": 1}, timeout_s=30)
    finally:
        await rpc.close()
    assert dropper.calls["refuse"] == 1 and err.value.status == 409 and err.value.code == "invalid_phase"


async def test_a_refused_connection_is_retried_even_when_not_safe_to_repeat() -> None:
    # Port 9 (discard) is closed on loopback: the connection is never made, so nothing was sent.
    rpc = RpcClient(token=None, transport_tries=3, retry_backoff_s=0.05)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            await rpc.call("http://127.0.0.1:9", "POST", "/x", {"x": 1}, timeout_s=30, repeatable=False)
        elapsed = time.monotonic() - started
    finally:
        await rpc.close()
    assert err.value.sent is False and "cannot connect" in err.value.detail
    assert elapsed >= 0.05 + 0.1  # two backoffs: three tries


async def test_retries_stop_at_the_call_deadline(dropper: Dropper) -> None:
    # Try 1 at 0 s, try 2 after 0.4 s; the next wait (0.8 s) ends past the 0.6 s deadline.
    rpc = RpcClient(token=None, transport_tries=10, retry_backoff_s=0.4)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError):
            await rpc.call(dropper.url, "POST", "/drop", {"x": 1}, timeout_s=0.6)
        elapsed = time.monotonic() - started
    finally:
        await rpc.close()
    assert dropper.calls["drop"] == 2
    assert elapsed < 5


async def test_the_deadline_bounds_the_whole_call() -> None:
    async def never(_: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.Response()

    app = web.Application()
    app.router.add_get("/never", never)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    rpc = RpcClient(token=None, transport_tries=3, retry_backoff_s=0.0)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            await rpc.call(f"http://{host}:{port}", "GET", "/never", timeout_s=0.3)
        assert time.monotonic() - started < 3
        assert err.value.sent is True
    finally:
        await rpc.close()
        await runner.cleanup()
