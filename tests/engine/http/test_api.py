"""The HTTP API over a real loopback server: reads, auth on mutating routes, bad queries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine.http.app import make_app
from engine.config import Settings
from engine.runtime.service import Orchestrator
from journal import models
from tests.support.participant_server import StatusServer

TOKEN = "api-token"


@pytest.fixture
async def api(journal_url: str) -> AsyncIterator[tuple[str, Orchestrator, StatusServer]]:
    participant = StatusServer("ok", "resources")
    await participant.start()
    settings = Settings.model_validate({
        "journal": {"url": journal_url}, "control": {"token": TOKEN},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "discovery": {"probe_timeout_s": 1, "interval_s": 60},
        "participants": [{"name": "res-0", "url": participant.url}], "logging": {"level": "WARNING"}})
    orch = Orchestrator(settings)
    runner = web.AppRunner(make_app(orch), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await orch.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(f"{base}/v1/participants") as r:
                body = await r.json()
            if body["participants"] and body["participants"][0]["health"] == "healthy":
                break
            await asyncio.sleep(0.05)
    try:
        yield base, orch, participant
    finally:
        await runner.cleanup()
        await orch.stop()
        await participant.stop()


async def get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def post(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, **kw) as r:
        return r.status, await r.json()


async def test_reads(api: tuple[str, Orchestrator, StatusServer]) -> None:
    base, orch, _ = api
    assert await get(f"{base}/healthz") == (200, {"ok": True})
    status, ready = await get(f"{base}/readyz")
    assert status == 200 and ready["ready"] and ready["leader"] is True
    status, body = await get(f"{base}/v1/status")
    assert status == 200 and body["role"] == "leader" and body["lease"]["epoch"] == 1
    assert body["entities"]["participants"] == {"healthy": 1}
    status, body = await get(f"{base}/v1/participants")
    (p,) = body["participants"]
    assert (p["name"], p["health"], p["kind"], p["phase"]) == ("res-0", "healthy", "resources", "idle")
    status, text = await get(f"{base}/metrics")
    assert status == 200
    assert 'tidelog_entities{kind="participants",state="healthy"} 1' in text
    assert "tidelog_leader 1" in text and 'tidelog_discovery_probes_total{result="healthy"}' in text


async def test_events_filters_and_paging(api: tuple[str, Orchestrator, StatusServer]) -> None:
    base, _, _ = api
    status, body = await get(f"{base}/v1/events", params={"kind": "participants", "entity": "res-0"})
    assert status == 200
    assert [(e["from_state"], e["to_state"]) for e in body["events"]] == [(None, "pending"), ("pending", "healthy")]
    assert body["next_after"] is None
    status, page1 = await get(f"{base}/v1/events", params={"limit": "1"})
    assert len(page1["events"]) == 1 and page1["next_after"] == page1["events"][0]["seq"]
    status, page2 = await get(f"{base}/v1/events", params={"limit": "1", "after": str(page1["next_after"])})
    assert page2["events"][0]["seq"] > page1["events"][0]["seq"]
    status, body = await get(f"{base}/v1/events", params={"state": "healthy"})
    assert [e["to_state"] for e in body["events"]] == ["healthy"]
    status, body = await get(f"{base}/v1/events", params={"since": "2999-01-01T00:00:00+00:00"})
    assert body["events"] == []


@pytest.mark.parametrize(("params", "needle"), [
    ({"limit": "0"}, "limit='0': must be between 1 and 1000"),
    ({"limit": "ten"}, "limit='ten': must be an integer"),
    ({"after": "-1"}, "after='-1'"),
    ({"kind": "widgets"}, "kind='widgets': unknown entity kind"),
    ({"since": "yesterday"}, "since='yesterday': must be an ISO-8601"),
    ({"since": "2026-01-01T00:00:00"}, "must carry a timezone"),
    ({"since": "2026-02-01T00:00:00+00:00", "until": "2026-01-01T00:00:00+00:00"}, "later than until"),
    ({"colour": "red"}, "colour='red': unknown parameter"),
    ({"state": "nosuchstate"}, "state='nosuchstate': not a state of any kind"),
    ({"kind": "participants", "state": "succeeded"}, "not a state of participants"),
])
async def test_bad_query_parameters_are_named(api: tuple[str, Orchestrator, StatusServer],
                                              params: dict[str, str], needle: str) -> None:
    base, _, _ = api
    status, body = await get(f"{base}/v1/events", params=params)
    assert status == 400
    assert body["error"]["code"] == "invalid_query" and needle in body["error"]["detail"]


async def test_a_parameter_given_twice_is_refused(api: tuple[str, Orchestrator, StatusServer]) -> None:
    base, _, _ = api
    status, body = await get(f"{base}/v1/events?limit=1&limit=2")
    assert status == 400 and "limit='1,2': given more than once" in body["error"]["detail"]


async def test_mutating_route_needs_the_token(api: tuple[str, Orchestrator, StatusServer]) -> None:
    base, orch, participant = api
    before = await count_events(orch)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, body = await post(f"{base}/v1/participants/probe", headers=headers)
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        assert TOKEN not in body["error"]["detail"]
    assert await count_events(orch) == before
    calls = participant.calls
    status, body = await post(f"{base}/v1/participants/probe", headers={"Authorization": f"Bearer {TOKEN}"})
    assert (status, body) == (202, {"queued": ["res-0"]})
    for _ in range(100):
        if participant.calls > calls:
            break
        await asyncio.sleep(0.05)
    assert participant.calls > calls, "an operator-requested probe was not made"
    status, body = await post(f"{base}/v1/participants/probe", params={"name": "nope"},
                              headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and "nope" in body["error"]["detail"]


async def count_events(orch: Orchestrator) -> int:
    import sqlalchemy as sa

    async with orch.journal.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(models.events))).scalar_one())


async def test_a_standby_refuses_mutations_and_names_the_leader(
        api: tuple[str, Orchestrator, StatusServer], journal_url: str) -> None:
    _, leader, participant = api
    settings = Settings.model_validate({
        "journal": {"url": journal_url}, "control": {"token": TOKEN},
        "orchestrator": {"id": "standby-1", "lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "participants": [{"name": "res-0", "url": participant.url}], "logging": {"level": "WARNING"}})
    standby = Orchestrator(settings)
    runner = web.AppRunner(make_app(standby), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await standby.start()
    host, port = runner.addresses[0][:2]
    try:
        status, body = await get(f"http://{host}:{port}/v1/status")
        assert body["role"] == "standby" and body["lease"]["holder"] == leader.holder
        status, body = await post(f"http://{host}:{port}/v1/participants/probe",
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 503 and body["error"]["code"] == "not_leader"
        assert leader.holder in body["error"]["detail"]
    finally:
        await runner.cleanup()
        await standby.stop()
