"""Participant discovery against real aiohttp servers, through the whole orchestrator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.workflows.discovery.controller import classify
from engine.runtime.rpc import RemoteError, TransportError
from engine.runtime.service import Orchestrator
from journal import audit, models
from tests.support.participant_server import StatusServer

TOKEN = "discovery-token"


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, StatusServer]]:
    made = {"env": StatusServer("ok", "environment"), "model": StatusServer("ok", "model", phase="prepared"),
            "judge": StatusServer("404"), "weird": StatusServer("ok", "critic"),
            "garbage": StatusServer("garbage"), "mute": StatusServer("hang")}
    for s in made.values():
        await s.start()
    yield made
    for s in made.values():
        await s.stop()


def settings(journal_url: str, participants: dict[str, str]) -> Settings:
    return Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "control": {"token": TOKEN},
        # 2 s per probe: a healthy in-process server must be able to answer while a loaded machine
        # (CI runs two workers beside many processes) stalls this loop for a moment; the mute one
        # still costs at most 2 tries x 2 s, inside the 10 s bound below.
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 60},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "logging": {"level": "WARNING"},
    })


async def rows(orch: Orchestrator) -> dict[str, Any]:
    t = models.participants
    async with orch.journal.read() as conn:
        return {r.id: r._mapping for r in (await conn.execute(sa.select(t))).all()}


async def settle(orch: Orchestrator, names: set[str], timeout: float = 15) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        current = await rows(orch)
        if set(current) == names and all(r["state"] not in ("pending", "removed") for r in current.values()):
            return current
        await asyncio.sleep(0.05)
    raise AssertionError(f"discovery did not settle: {await rows(orch)}")


async def test_discovery_records_kind_phase_and_health(journal_url: str, servers: dict[str, StatusServer]) -> None:
    configured = {name: s.url for name, s in servers.items()}
    configured["down"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    orch = Orchestrator(settings(journal_url, configured))
    await orch.start()
    started = time.monotonic()
    try:
        got = await settle(orch, set(configured))
    finally:
        await orch.stop()
    # Nobody is waited on forever: the mute server costs one bounded probe.
    assert time.monotonic() - started < 10
    assert got["env"]["state"] == "healthy"
    assert (got["env"]["kind"], got["env"]["instance"], got["env"]["phase"]) == ("environment", "environment-1", "idle")
    assert (got["model"]["kind"], got["model"]["phase"]) == ("model", "prepared")
    assert got["judge"]["state"] == "incompatible" and "not a participant" in got["judge"]["detail"]
    assert got["weird"]["state"] == "incompatible" and "unknown participant kind 'critic'" in got["weird"]["detail"]
    assert got["garbage"]["state"] == "incompatible" and "invalid status reply" in got["garbage"]["detail"]
    assert got["mute"]["state"] == "unreachable" and "no reply within" in got["mute"]["detail"]
    assert got["down"]["state"] == "unreachable" and "cannot connect" in got["down"]["detail"]
    assert got["down"]["probe_failures"] == 1
    # Probes carry the token and the fencing epoch; the token never lands in the journal.
    headers = servers["env"].headers[0]
    assert headers["Authorization"] == f"Bearer {TOKEN}" and headers["X-Tidelog-Epoch"] == "1"
    orch2 = Orchestrator(settings(journal_url, {}))
    try:
        assert await audit.verify(orch2.journal) == []
        async with orch2.journal.read() as conn:
            payloads = (await conn.execute(sa.select(sa.cast(models.events.c.payload, sa.Text)))).scalars().all()
        assert not any(TOKEN in (p or "") for p in payloads)
    finally:
        await orch2.journal.dispose()


async def test_reconfiguration_removes_and_readds(journal_url: str, servers: dict[str, StatusServer]) -> None:
    env = servers["env"].url
    orch = Orchestrator(settings(journal_url, {"env": env, "model": servers["model"].url}))
    await orch.start()
    try:
        await settle(orch, {"env", "model"})
    finally:
        await orch.stop()
    # "model" leaves the configuration: its row becomes removed, its history stays.
    orch = Orchestrator(settings(journal_url, {"env": env}))
    await orch.start()
    try:
        for _ in range(200):
            got = await rows(orch)
            if got["model"]["state"] == "removed":
                break
            await asyncio.sleep(0.05)
        assert got["model"]["state"] == "removed" and got["env"]["state"] == "healthy"
    finally:
        await orch.stop()
    orch = Orchestrator(settings(journal_url, {"env": env, "model": servers["model"].url}))
    await orch.start()
    try:
        got = await settle(orch, {"env", "model"})
        assert got["model"]["state"] == "healthy"
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()


def test_classify_covers_each_failure() -> None:
    assert classify({"kind": "agent", "instance": "a", "phase": "idle"}).state == "healthy"
    assert classify({"kind": "agent", "instance": "a", "phase": "sleeping"}).state == "incompatible"
    assert classify([1, 2]).state == "incompatible"
    err404 = RemoteError("http://x", "GET", "/s", 404, None, "")
    assert classify(error=err404).state == "incompatible"
    assert classify(error=RemoteError("http://x", "GET", "/s", 503, None, "")).state == "unreachable"
    assert classify(error=TransportError("http://x", "GET", "/s", "reset", sent=True)).state == "unreachable"


async def test_a_service_that_becomes_ready_has_every_participant_probed_at_once(
        journal_url: str, servers: dict[str, StatusServer]) -> None:
    """A participant seen down is probed again only after ``interval_s`` (60 s here, doubling); a
    ``services`` row moving to ``ready`` (the stack started or rebuilt a service) has it probed at once."""
    env = servers["env"]
    orch = Orchestrator(settings(journal_url, {"env": env.url}))
    await orch.start()
    try:
        assert (await settle(orch, {"env"}))["env"]["state"] == "healthy"
        env.mode = "500"  # the participant's process died: a probe made now finds it down
        orch.handle("discovery").request_probe("env")
        orch.reconciler.enqueue("participants", "env")
        await until_state(orch, "env", "unreachable")
        env.mode = "ok"  # its service was started again ...
        calls = env.calls
        await asyncio.sleep(0.5)
        assert env.calls == calls  # ... and nothing probes it before its backoff (a minute) ends
        async with orch.journal.write() as tx:
            await tx.create("services", "env-service", reason="declared by the configuration",
                            values={"executor": "uni", "desired": "up"})
            await tx.transition("services", "env-service", from_state="pending", version=1, to_state="starting",
                                reason="launched")
            await tx.transition("services", "env-service", from_state="starting", version=2, to_state="ready",
                                reason="its readiness check passed")
        await until_state(orch, "env", "healthy")
        assert env.calls == calls + 1
    finally:
        await orch.stop()


async def until_state(orch: Orchestrator, name: str, state: str, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while (await rows(orch))[name]["state"] != state:
        assert time.monotonic() < end, f"{name} is not {state}: {(await rows(orch))[name]}"
        await asyncio.sleep(0.02)
