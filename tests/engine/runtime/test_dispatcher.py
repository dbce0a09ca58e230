"""The dispatcher and the RPC client against a real aiohttp server with scripted replies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web

from engine.runtime.clock import SystemClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.dispatcher import Dispatcher
from engine.runtime.rpc import CallTimeout, RemoteError, RpcClient, TransportError
from journal import Journal, audit, lease, models, outbox


class Scripted:
    """``POST /<name>`` answers per a script of statuses; ``/slow`` (and ``/slow-…``) never answers in time."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[int]] = {}
        self.calls: dict[str, int] = {}
        self.headers: list[dict[str, str]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.calls[name] = self.calls.get(name, 0) + 1
        self.headers.append(dict(request.headers))
        if name.startswith("slow"):
            await asyncio.sleep(5)
        script = self.scripts.get(name, [200])
        status = script.pop(0) if len(script) > 1 else script[0]
        if status == 200:
            return web.json_response({"ok": name, "body": await request.json()})
        if status == 409:
            return web.json_response({"error": {"code": "invalid_phase", "detail": "not now"}}, status=409)
        return web.Response(status=status, text="server trouble")

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/{name}", self.handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return runner


@pytest.fixture
async def remote() -> AsyncIterator[Scripted]:
    s = Scripted()
    runner = await s.start()
    yield s
    await runner.cleanup()


async def test_rpc_client_errors_are_typed(remote: Scripted) -> None:
    rpc = RpcClient(token="t0k", epoch=lambda: 7, transport_tries=3, retry_backoff_s=0.01)
    try:
        assert (await rpc.call(remote.url, "POST", "/a", {"x": 2**70}, timeout_s=2,
                               idempotency_key="k1"))["body"] == {"x": 2**70}
        h = remote.headers[-1]
        assert (h["Authorization"], h["X-Tidelog-Epoch"], h["Idempotency-Key"]) == ("Bearer t0k", "7", "k1")
        remote.scripts["b"] = [409]
        with pytest.raises(RemoteError) as info:
            await rpc.call(remote.url, "POST", "/b", {}, timeout_s=2)
        assert (info.value.status, info.value.code, info.value.retryable) == (409, "invalid_phase", False)
        assert remote.calls["b"] == 1, "a typed protocol error is never retried"
        with pytest.raises(CallTimeout):
            await rpc.call(remote.url, "POST", "/slow", {}, timeout_s=2.0)  # reaches the handler even on a loaded machine
        assert remote.calls["slow"] == 1, "a timeout is not retried"
        with pytest.raises(TransportError) as refused:
            await rpc.call("http://127.0.0.1:9", "POST", "/x", {}, timeout_s=2, repeatable=False)
        assert refused.value.sent is False
    finally:
        await rpc.close()


async def make_dispatcher(journal: Journal, rpc: RpcClient) -> tuple[Dispatcher, GroupCommitter, list[Any]]:
    held = await lease.acquire(journal, "orchestrator", "test", 60)
    assert held is not None
    committer = GroupCommitter(journal, held.fence)
    woken: list[Any] = []
    d = Dispatcher(journal, committer, rpc, SystemClock(), held.fence, lambda k, i: woken.append((k, i)),
                   poll_s=0.05, backoff_base_s=0.01, backoff_cap_s=0.02)
    journal.add_commit_listener(d.on_commit)
    return d, committer, woken


async def queue(journal: Journal, target: str, path: str, **kw: Any) -> str:
    async with journal.write() as tx:
        owner = await tx.create("participants", f"owner{path.replace('/', '-')}", reason="owner",
                                values={"url": target})
        assert owner is not None
        row = await tx.get("participants", owner.entity_id)
        assert row is not None
        return await outbox.ensure(tx, outbox.Intent.for_row(row, target=target, method="POST", path=path,
                                                            body={"p": path}, **kw), reason="test")


async def wait_settled(journal: Journal, ids: list[str]) -> dict[str, Any]:
    for _ in range(200):
        async with journal.write() as tx:
            rows = {i: await outbox.get(tx, i) for i in ids}
        if all(r is not None and r.state in ("succeeded", "failed", "ambiguous") for r in rows.values()):
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError(f"not settled: {rows}")


async def test_outcomes_are_recorded_and_owners_woken(journal: Journal, remote: Scripted) -> None:
    rpc = RpcClient(token=None, transport_tries=1)
    d, committer, woken = await make_dispatcher(journal, rpc)
    remote.scripts = {"flaky": [503, 503, 200], "refuse": [409], "broken": [500]}
    ids = {
        "ok": await queue(journal, remote.url, "/ok"),
        "flaky": await queue(journal, remote.url, "/flaky"),
        "refuse": await queue(journal, remote.url, "/refuse"),
        "broken": await queue(journal, remote.url, "/broken", max_attempts=3),
        # 2 s: long enough for the request to reach the handler on a loaded machine (it sleeps 5 s).
        "step": await queue(journal, remote.url, "/slow", repeatable=False, timeout_s=2.0),
        "down": await queue(journal, "http://127.0.0.1:9", "/x", max_attempts=2),
        # Not safe to repeat, but the connection was never made: it cannot have arrived.
        "down_unsafe": await queue(journal, "http://127.0.0.1:9", "/y", repeatable=False, max_attempts=1),
    }
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, list(ids.values()))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    r = {name: rows[i] for name, i in ids.items()}
    assert r["ok"].state == "succeeded" and r["ok"]["result"]["body"] == {"p": "/ok"}
    assert r["flaky"].state == "succeeded" and r["flaky"]["attempts"] == 3 and remote.calls["flaky"] == 3
    assert r["refuse"].state == "failed" and r["refuse"]["error"]["code"] == "invalid_phase"
    assert remote.calls["refuse"] == 1
    assert r["broken"].state == "failed" and r["broken"]["attempts"] == 3 and remote.calls["broken"] == 3
    # Not safe to repeat and may have arrived: ambiguous, never re-sent.
    assert r["step"].state == "ambiguous" and remote.calls["slow"] == 1
    assert r["down"].state == "failed" and r["down"]["error"]["sent"] is False
    assert r["down_unsafe"].state == "failed" and r["down_unsafe"]["error"]["sent"] is False
    assert {i for _, i in woken} >= {f"owner-{n}" for n in ("ok", "flaky", "refuse", "broken", "slow", "x", "y")}
    assert await audit.verify(journal) == []


async def test_recovery_resends_repeatable_and_parks_the_rest(journal: Journal, remote: Scripted) -> None:
    rpc = RpcClient(token=None)
    d, committer, woken = await make_dispatcher(journal, rpc)
    safe = await queue(journal, remote.url, "/safe")
    unsafe = await queue(journal, remote.url, "/unsafe", repeatable=False)
    async with journal.write() as tx:  # a dispatcher claimed both, then died
        assert len(await outbox.claim_due(tx, limit=10)) == 2
    recovered = {row.id: row.state for row in await d.recover()}
    assert recovered == {safe: "pending", unsafe: "ambiguous"}
    assert ("participants", "owner-unsafe") in woken
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, [safe])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    assert rows[safe].state == "succeeded"
    assert remote.calls == {"safe": 1}, "the ambiguous call must never be re-sent"


async def test_credentials_in_a_target_never_reach_an_error() -> None:
    rpc = RpcClient(token=None, transport_tries=1)
    try:
        with pytest.raises(TransportError) as info:
            await rpc.call("http://alice:s3cret@127.0.0.1:9", "GET", "/status", timeout_s=2)
    finally:
        await rpc.close()
    assert "s3cret" not in str(info.value) and "alice" not in str(info.value)
    assert "s3cret" not in str(info.value.as_dict())


async def test_calls_of_one_shared_body_send_the_same_bytes_and_a_missing_body_sends_nothing(
        journal: Journal, remote: Scripted) -> None:
    rpc = RpcClient(token=None, transport_tries=1)
    d, committer, _ = await make_dispatcher(journal, rpc)
    shared = outbox.Body.of({"checkpoint_id": "ck", "episode_ids": [{"rollout_id": "r", "attempt": 2 ** 70}]})
    lost = outbox.Body.of({"lost": True})
    async with journal.write() as tx:
        owner = await tx.create("participants", "owner", reason="owner", values={"url": remote.url})
        assert owner is not None
        row = await tx.get("participants", "owner")
        assert row is not None
        intents = [outbox.Intent.for_row(row, target=remote.url, method="POST", path=f"/s{i}", shared=shared)
                   for i in range(3)]
        intents.append(outbox.Intent.for_row(row, target=remote.url, method="POST", path="/gone", shared=lost,
                                             max_attempts=2))
        await outbox.ensure_all(tx, [(i, "test") for i in intents])
        # The body of the last call disappears (rpc_bodies is not an entity table; nothing else deletes it).
        await tx.execute(models.rpc_bodies.delete().where(models.rpc_bodies.c.id == lost.id))
    with pytest.raises(ValueError, match="either a body or a shared body"):
        async with journal.write() as tx:
            await outbox.ensure_all(tx, [(outbox.Intent.for_row(row, target=remote.url, method="POST", path="/b",
                                                                body={"x": 1}, shared=shared), "both")])
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, [i.id for i in intents])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    stored = [rows[i.id] for i in intents[:3]]
    assert all(r.state == "succeeded" and r["body"] is None and r["body_id"] == shared.id for r in stored)
    assert all(r["result"]["body"] == json.loads(shared.content) for r in stored)
    gone = rows[intents[3].id]
    assert gone.state == "failed" and gone["attempts"] == 2 and gone["error"]["sent"] is False
    assert "shared body unavailable" in gone["error"]["detail"] and "gone" not in remote.calls
    assert await audit.verify(journal) == []


async def test_calls_claimed_at_creation_are_sent_once_without_a_claim_and_recovered_if_never_sent(
        journal: Journal, remote: Scripted) -> None:
    rpc = RpcClient(token=None, transport_tries=1)
    d, committer, _ = await make_dispatcher(journal, rpc)
    remote.scripts = {"flaky": [503, 200]}
    async with journal.write() as tx:
        await tx.create("participants", "owner", reason="owner", values={"url": remote.url})
        row = await tx.get("participants", "owner")
        assert row is not None

    def intent(path: str, **kw: Any) -> outbox.Intent:
        return outbox.Intent.for_row(row, target=remote.url, method="POST", path=path, body={"p": path}, **kw)

    early, late, flaky, unsafe = intent("/early"), intent("/late"), intent("/flaky"), intent("/u", repeatable=False)
    async with journal.write() as tx:  # /early exists before (pending): it is not claimed a second time
        await outbox.ensure_all(tx, [(early, "before")])
    task = asyncio.create_task(d.run())
    try:
        await asyncio.sleep(0)  # the run loop starts (send refuses nothing from here on)
        async with journal.write() as tx:
            claimed = await outbox.ensure_all(tx, [(i, "claimed") for i in (early, late, flaky, unsafe)], claim=True)
        # Only the repeatable calls this transaction created come back, inflight with their attempt counted.
        assert [(c.id, c.state, c.version, c["attempts"]) for c in claimed] == [
            (late.id, "inflight", 1, 1), (flaky.id, "inflight", 1, 1)]
        d.send(claimed)
        rows = await wait_settled(journal, [early.id, late.id, flaky.id, unsafe.id])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert {i.path: rows[i.id].state for i in (early, late, flaky, unsafe)} == {
        "/early": "succeeded", "/late": "succeeded", "/flaky": "succeeded", "/u": "succeeded"}
    assert remote.calls == {"early": 1, "late": 1, "flaky": 2, "u": 1}
    assert rows[flaky.id]["attempts"] == 2  # a transport error retries it through the normal claim
    async with journal.read() as conn:
        e = models.events
        trail = {(r.entity_id, r.from_state, r.to_state) for r in (await conn.execute(
            sa.select(e.c.entity_id, e.c.from_state, e.c.to_state).where(e.c.entity_kind == "rpc_calls"))).all()}
    assert (late.id, None, "inflight") in trail and (late.id, "pending", "inflight") not in trail
    assert (unsafe.id, None, "pending") in trail and (unsafe.id, "pending", "inflight") in trail

    # Claimed, committed, never sent (the dispatcher is not running): recovery re-sends it once.
    lost = intent("/lost")
    async with journal.write() as tx:
        left = await outbox.ensure_all(tx, [(lost, "claimed")], claim=True)
    d.send(left)  # not running: left inflight
    assert (await wait_state(journal, lost.id)) == "inflight"
    assert {r.id: r.state for r in await d.recover()} == {lost.id: "pending"}
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, [lost.id])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    assert rows[lost.id].state == "succeeded" and remote.calls["lost"] == 1
    assert await audit.verify(journal) == []


async def wait_state(journal: Journal, call_id: str) -> str:
    await asyncio.sleep(0.2)  # long enough for a send that should not happen to have happened
    async with journal.write() as tx:
        row = await outbox.get(tx, call_id)
    assert row is not None
    return row.state


async def test_data_calls_hold_their_own_slots_and_never_block_control_calls(journal: Journal, remote: Scripted) -> None:
    """Two data slots, two control slots: four long data calls (``/slow`` holds each 5 s) take the
    data slots only; the control calls queued behind them are sent and settled meanwhile, and the
    data calls beyond the bound wait in the outbox."""
    rpc = RpcClient(token=None, transport_tries=1)
    held = await lease.acquire(journal, "orchestrator", "test", 60)
    assert held is not None
    committer = GroupCommitter(journal, held.fence)
    d = Dispatcher(journal, committer, rpc, SystemClock(), held.fence, lambda k, i: None, concurrency=2,
                   data_concurrency=2, poll_s=0.05, backoff_base_s=0.01, backoff_cap_s=0.02)
    journal.add_commit_listener(d.on_commit)
    data = [await queue(journal, remote.url, f"/slow-{n}", pool="data", timeout_s=30, repeatable=False)
            for n in range(4)]
    task = asyncio.create_task(d.run())
    try:
        async def states() -> dict[str, str]:
            async with journal.read() as conn:
                rows = (await conn.execute(sa.select(models.rpc_calls.c.id, models.rpc_calls.c.state))).all()
            return {r.id: r.state for r in rows}

        for _ in range(200):
            seen = await states()
            if sum(1 for i in data if seen[i] == "inflight") == 2:
                break
            await asyncio.sleep(0.02)
        control = [await queue(journal, remote.url, f"/ok-{n}") for n in range(2)]
        settled = await wait_settled(journal, control)
        now = await states()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    assert {settled[i].state for i in control} == {"succeeded"}
    assert sorted(now[i] for i in data) == ["inflight", "inflight", "pending", "pending"], now
