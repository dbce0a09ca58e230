"""The RPC client over an in-process transport (``HandlerTransport``): what goes on the wire, how
replies and faults become typed errors and retries, and a controller run by a whole orchestrator
with no participant process at all. The network faults here are injected by the handler (a
``TransportFailure``), the one thing a loopback server cannot produce on demand."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.clock import VirtualClock
from engine.runtime.leader import LEASE_NAME
from engine.runtime.rpc import CallTimeout, RemoteError, RpcClient, TransportError
from engine.runtime.service import Orchestrator
from engine.runtime.transport import HandlerTransport, Request, Response, TransportFailure
from journal import lease, models
from workers.protocol import STATUS_PATH


def ok(body: object, status: int = 200) -> Response:
    return Response(status, orjson.dumps(body))


async def test_a_call_carries_token_epoch_and_key_and_decodes_the_reply() -> None:
    async def handler(request: Request) -> Response:
        return ok({"echo": json.loads(request.content or b"null"), "path": request.url.path})

    transport = HandlerTransport(handler)
    rpc = RpcClient(token="s3cret", epoch=lambda: 7, lineage=lambda: "ab" * 16, transport=transport)
    reply = await rpc.call("http://p1:9", "POST", "/x/y", {"a": 1}, timeout_s=5, idempotency_key="k-1",
                           pool="data")
    assert reply == {"echo": {"a": 1}, "path": "/x/y"}
    sent = transport.requests[0]
    assert sent.method == "POST" and str(sent.url) == "http://p1:9/x/y" and sent.pool == "data"
    assert sent.headers["Authorization"] == "Bearer s3cret" and sent.headers["X-Tidelog-Epoch"] == "7"
    assert sent.headers["X-Tidelog-Lineage"] == "ab" * 16
    assert sent.headers["Idempotency-Key"] == "k-1" and sent.headers["Content-Type"] == "application/json"
    assert 0 < sent.timeout_s <= 5


async def test_a_typed_refusal_is_a_remote_error_and_never_retried() -> None:
    async def handler(request: Request) -> Response:
        return ok({"error": {"code": "not_prepared", "detail": "prepare first"}}, status=409)

    transport = HandlerTransport(handler)
    rpc = RpcClient(token=None, transport=transport, transport_tries=5, retry_backoff_s=0)
    with pytest.raises(RemoteError) as caught:
        await rpc.call("http://p1:9", "POST", "/c", {}, timeout_s=5)
    assert (caught.value.status, caught.value.code, caught.value.detail) == (409, "not_prepared", "prepare first")
    assert len(transport.requests) == 1


async def test_connect_failures_are_retried_and_a_broken_exchange_of_an_unrepeatable_call_is_not() -> None:
    script: list[TransportFailure | Response] = [TransportFailure("connect", "refused"),
                                                 TransportFailure("connect", "refused"), ok({"n": 3})]

    async def handler(request: Request) -> Response:
        step = script.pop(0)
        if isinstance(step, TransportFailure):
            raise step
        return step

    transport = HandlerTransport(handler)
    rpc = RpcClient(token=None, transport=transport, transport_tries=3, retry_backoff_s=0)
    # Never connected, so not even a call that is not safe to repeat can have arrived: retried.
    assert await rpc.call("http://p1:9", "POST", "/c", {}, timeout_s=5, repeatable=False) == {"n": 3}
    assert len(transport.requests) == 3

    script[:] = [TransportFailure("broken", "ServerDisconnectedError: gone"), ok({"never": True})]
    transport.requests.clear()
    with pytest.raises(TransportError) as caught:
        await rpc.call("http://p1:9", "POST", "/c", {}, timeout_s=5, repeatable=False)
    assert caught.value.sent and "ServerDisconnectedError: gone" in str(caught.value)
    assert len(transport.requests) == 1

    # A repeatable call is retried after a broken exchange; a refused connection after it still
    # reports that an earlier attempt may have arrived.
    script[:] = [TransportFailure("broken", "reset"), TransportFailure("connect", "refused"),
                 TransportFailure("connect", "refused")]
    with pytest.raises(TransportError) as caught:
        await rpc.call("http://p1:9", "GET", "/s", timeout_s=5)
    assert caught.value.sent and "cannot connect: refused" in str(caught.value)


async def test_a_reply_that_does_not_come_is_a_call_timeout_that_may_have_arrived() -> None:
    async def handler(request: Request) -> Response:
        raise TransportFailure("reply_timeout", "no reply in time")

    rpc = RpcClient(token=None, transport=HandlerTransport(handler), transport_tries=3, retry_backoff_s=0)
    with pytest.raises(CallTimeout) as caught:
        await rpc.call("http://p1:9", "GET", "/s", timeout_s=2)
    assert caught.value.sent and "no reply within 2s" in str(caught.value)


async def test_the_backoff_and_the_deadline_are_measured_on_the_clients_clock() -> None:
    """On a virtual clock a retry waits for ``advance`` (not for the wall clock), and the deadline
    that stops the retries and bounds each attempt is read from the same clock."""
    async def handler(request: Request) -> Response:
        raise TransportFailure("connect", "refused")

    clock = VirtualClock()
    transport = HandlerTransport(handler)
    # Backoff 1 s, 2 s, 4 s... capped at 2 s; the deadline is 2.5 s: tries at 0 s and 1 s, the next
    # wait ends at 3 s, past the deadline, so the second try's error is raised.
    rpc = RpcClient(token=None, transport=transport, transport_tries=10, retry_backoff_s=1.0, clock=clock)
    call = asyncio.ensure_future(rpc.call("http://p1:9", "GET", "/s", timeout_s=2.5))
    await clock.advance(0)
    assert len(transport.requests) == 1 and not call.done()
    await asyncio.sleep(0.05)  # real time does not move the retry
    assert len(transport.requests) == 1 and not call.done()
    await clock.advance(1.0)
    assert len(transport.requests) == 2 and not call.done()
    assert transport.requests[1].timeout_s == pytest.approx(1.5)  # what is left of the deadline
    await clock.advance(2.0)
    with pytest.raises(TransportError) as caught:
        await call
    assert not caught.value.sent and "cannot connect: refused" in str(caught.value)
    assert len(transport.requests) == 2


async def test_discovery_runs_in_an_orchestrator_against_an_in_process_participant(journal_url: str) -> None:
    """No participant process: the transport answers the status probe of ``p1`` and refuses ``p2``."""
    async def handler(request: Request) -> Response:
        if request.url.host == "p1.test" and request.url.path == STATUS_PATH:
            return ok({"kind": "environment", "instance": "env-1", "phase": "idle"})
        raise TransportFailure("connect", "connection refused")

    settings = Settings.model_validate({
        "journal": {"url": journal_url}, "logging": {"level": "WARNING"},
        "orchestrator": {"lease_ttl_s": 2, "lease_renew_s": 0.5, "shutdown_grace_s": 1},
        "rpc": {"transport_tries": 1},
        "participants": [{"name": "p1", "url": "http://p1.test:1"}, {"name": "p2", "url": "http://p2.test:1"}]})
    transport = HandlerTransport(handler)
    orch = Orchestrator(settings, transport=transport)
    await orch.start()
    try:
        t = models.participants
        for _ in range(200):
            async with orch.journal.read() as conn:
                rows = {r.id: r for r in (await conn.execute(sa.select(t))).all()}
            if {r.state for r in rows.values()} == {"healthy", "unreachable"}:
                break
            await asyncio.sleep(0.05)
        assert rows["p1"].state == "healthy" and rows["p1"].kind == "environment" and rows["p1"].instance == "env-1"
        assert rows["p2"].state == "unreachable"
        assert {r.url.host for r in transport.requests} == {"p1.test", "p2.test"}
        # Every call names this journal's line of leaders beside the epoch (the participants' fence).
        held = await lease.read_lease(orch.journal, LEASE_NAME)
        assert held is not None and held.lineage is not None
        assert {(r.headers["X-Tidelog-Epoch"], r.headers["X-Tidelog-Lineage"]) for r in transport.requests} == {
            (str(held.epoch), held.lineage)}
    finally:
        await orch.stop()
