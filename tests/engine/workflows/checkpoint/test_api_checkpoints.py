"""The checkpoint workflows through the HTTP API, over a real orchestrator and loopback server, against
the four reference participants as real processes, on both journal backends: a checkpoint started by
``POST /v1/checkpoints`` is published and ``GET`` shows its members and timings; one held open by a
blocking episode is aborted by ``POST .../abort``; a restore of the published checkpoint into fresh
participants; retire and forget of a rollout. Bad bodies, a missing token and a standby are refused
with typed errors and change nothing (those cases need no reference processes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web

from engine.http.app import make_app
from engine.config import Settings
from engine.workflows.checkpoint.retirement import RetirementController, RetirementSettings
from engine.runtime.service import Orchestrator
from journal import Journal, models
from tests.support.participant_server import StatusServer
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, start_stack
from tests.support.workflows import add_rollouts, settings, state_dirs

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TERMINAL = ("done", "aborted", "failed")


def orchestrator(s: Settings) -> Orchestrator:
    """The orchestrator with its own workflow controllers; retirements poll faster than by default."""
    return Orchestrator(s, controllers=[RetirementController(RetirementSettings(retire_timeout_s=20, poll_s=0.1))])


@asynccontextmanager
async def served(s: Settings, *, lead: bool = True) -> AsyncIterator[tuple[str, Orchestrator]]:
    """The orchestrator with its API on a loopback port, once it leads (unless ``lead`` is false: a
    standby); stopped (lease released) at the end."""
    orch = orchestrator(s)
    runner = web.AppRunner(make_app(orch), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await orch.start()
    host, port = runner.addresses[0][:2]
    try:
        async def leading() -> bool:  # a standby refuses writes (not_leader): wait for the election
            return orch.is_leader
        if lead:
            await until(leading, what="the orchestrator to lead")
        yield f"http://{host}:{port}", orch
    finally:
        await runner.cleanup()
        await orch.stop()


async def call(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def until(check: Any, timeout: float = 120.0, what: str = "") -> Any:
    end = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < end, f"timed out: {what}"
        await asyncio.sleep(0.05)


async def wait_healthy(base: str, n: int = 4) -> None:
    async def ok() -> bool:
        _, body = await call("GET", f"{base}/v1/participants")
        return sum(p["health"] == "healthy" for p in body["participants"]) == n
    await until(ok, what="participants healthy")


async def wait_state(base: str, path: str, states: tuple[str, ...], timeout: float = 120.0) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        status, body = await call("GET", f"{base}{path}")
        assert status == 200, body
        return body if body["state"] in states else None
    body: dict[str, Any] = await until(reached, timeout, f"{path} to reach {states}")
    return body


async def count_events(journal_url: str) -> int:
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(models.events))).scalar_one())
    finally:
        await journal.dispose()


# -- against the reference participants ---------------------------------------------------------

@pytest.mark.slow
async def test_a_checkpoint_started_through_the_api_is_published_and_shown(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=0.2)
    runs = [asyncio.create_task(controller.run(stack.url("environment"), f"r{i}", {"prompt": f"p{i}", "turns": 3}))
            for i in range(3)]
    async with served(settings(journal_url, stack, prepare_timeout_s=10, roots=[str(tmp_path)])) as (base, orch):
        await wait_healthy(base)
        status, started = await call("POST", f"{base}/v1/checkpoints", headers=AUTH,
                                     json={"directory": str(tmp_path / "ckpts")})
        assert status == 202, started
        cid = started["checkpoint_id"]
        assert cid.startswith("ck-") and started["directory"] == str(tmp_path / "ckpts")
        assert sorted(started["participants"]) == sorted(f"{k}-0" for k in KINDS)
        # A second one while the first is open is refused, naming it; so is a restore.
        status, body = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={})
        assert (status, body["error"]["code"]) == (409, "checkpoint_open") and cid in body["error"]["detail"]
        status, body = await call("POST", f"{base}/v1/restores", headers=AUTH,
                                  json={"directory": str(tmp_path / "ckpts"), "checkpoint_id": "nope"})
        assert status == 404 and body["error"]["field"] == "checkpoint_id", body

        row = await wait_state(base, f"/v1/checkpoints/{cid}", TERMINAL)
        list_status, listed = await call("GET", f"{base}/v1/checkpoints")
        results = await asyncio.gather(*runs)
        # Retire and forget one of the finished rollouts, through the API.
        status, retire = await call("POST", f"{base}/v1/rollouts/r0/retire", headers=AUTH, json={"attempt": 0})
        assert status == 202, retire
        retired = await wait_state(base, f"/v1/retirements/{retire['retirement_id']}", ("done", "failed"))
        status, forget = await call("POST", f"{base}/v1/rollouts/r0/forget", headers=AUTH)
        assert status == 202, forget
        forgotten = await wait_state(base, f"/v1/retirements/{forget['retirement_id']}", ("done", "failed"))
        statuses = {k: await controller.status(stack.url(k)) for k in KINDS}

    assert row["state"] == "done" and row["terminal"], row
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == cid
    assert row["manifest_path"] == str(tmp_path / "ckpts" / cid / "checkpoint.json")
    members = {m["participant"]: m for m in row["members"]}
    assert set(members) == {f"{k}-0" for k in KINDS}
    for name, m in members.items():
        assert m["state"] == "resumed" and m["manifest"]["checkpoint_id"] == cid, m
        assert m["blockers"] == [] and m["report"]["blocker_count"] == 0, m
    t = row["timings"]
    assert set(t["per_state_s"]) >= {"prepared", "committing", "committed", "published", "resuming"}
    assert t["in_state_s"] is None and t["total_s"] > 0
    phases = [(p["state"], p["stage"]) for p in t["phases"]]
    assert phases == [("preparing", s) for s in KINDS] + [
        ("prepared", None), ("committing", None), ("committed", None), ("published", None),
        ("resuming", None), ("done", None)], phases
    assert all(p["seconds"] is not None and p["seconds"] >= 0 for p in t["phases"][:-1])
    assert list_status == 200 and listed["checkpoints"][0]["id"] == cid and listed["next_before"] is None
    assert all(len(r["actions"]) == 3 for r in results)
    assert retired["state"] == "done" and retired["op"] == "retire", retired
    assert [p["stage"] for p in retired["timings"]["phases"] if p["state"] == "running"] == [
        "environment", "agent", "model+resources"]
    assert forgotten["state"] == "done" and forgotten["op"] == "forget", forgotten
    assert all(s["phase"] == "idle" and s["retired_rollouts"] == 0 for s in statuses.values()), statuses


@pytest.mark.slow
async def test_an_open_checkpoint_is_aborted_through_the_api(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    # Each step takes 3 s: 3.5 s in, the episode is inside a wait step for 2.5 s more, so the
    # environment cannot prepare; with a 60 s prepare deadline the checkpoint would stay open a minute.
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=3.0)
    run = asyncio.create_task(controller.run(stack.url("environment"), "slow", {"prompt": "p", "turns": 1}))
    await asyncio.sleep(3.5)
    async with served(settings(journal_url, stack, prepare_timeout_s=60, roots=[str(tmp_path)])) as (base, orch):
        await wait_healthy(base)
        status, started = await call("POST", f"{base}/v1/checkpoints", headers=AUTH,
                                     json={"checkpoint_id": "ck-held", "directory": str(tmp_path / "ckpts")})
        assert status == 202, started

        async def preparing() -> bool:
            _, body = await call("GET", f"{base}/v1/checkpoints/ck-held")
            return any(m["state"] == "preparing" for m in body["members"])
        await until(preparing, what="the environment's prepare to be sent")
        _, open_row = await call("GET", f"{base}/v1/checkpoints/ck-held")
        asked = time.monotonic()
        status, aborted = await call("POST", f"{base}/v1/checkpoints/ck-held/abort", headers=AUTH,
                                     json={"reason": "operator test"})
        assert status == 202, aborted
        row = await wait_state(base, "/v1/checkpoints/ck-held", TERMINAL, timeout=30)
        took = time.monotonic() - asked
        again = await call("POST", f"{base}/v1/checkpoints/ck-held/abort", headers=AUTH)
        missing = await call("POST", f"{base}/v1/checkpoints/ck-nope/abort", headers=AUTH)
        status_get, nothing = await call("GET", f"{base}/v1/checkpoints/ck-nope")
        statuses = {k: await controller.status(stack.url(k)) for k in KINDS}
    assert open_row["state"] == "preparing" and open_row["stage_name"] == "environment"
    assert open_row["timings"]["in_state_s"] is not None
    assert aborted == {"checkpoint_id": "ck-held", "state": "aborting", "was": "preparing"}
    assert row["state"] == "aborted" and row["detail"] == "aborted by an operator: operator test", row
    assert took < 20, f"the abort took {took:.1f}s: it waited for the prepare deadline"
    assert all(m["state"] == "resumed" for m in row["members"]), row["members"]
    assert [p["state"] for p in row["timings"]["phases"]][-2:] == ["aborting", "aborted"]
    assert again[0] == 409 and again[1]["error"]["code"] == "not_abortable" and "aborted" in again[1]["error"]["detail"]
    assert missing[0] == 404 and missing[1]["error"]["code"] == "not_found"
    assert status_get == 404 and nothing["error"]["code"] == "not_found"
    assert not (tmp_path / "ckpts" / "LATEST").exists()
    assert all(s["phase"] == "idle" for s in statuses.values()), statuses
    assert (await run)["rollout_id"] == "slow"  # the episode went on after the abort


@pytest.mark.slow
async def test_a_published_checkpoint_is_restored_through_the_api_into_fresh_participants(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.2)
    runs = [asyncio.create_task(controller.run(stack.url("environment"), f"r{i}", {"prompt": f"p{i}", "turns": 3}))
            for i in range(2)]
    await asyncio.sleep(0.5)
    async with served(settings(journal_url, stack, prepare_timeout_s=10, roots=[str(tmp_path)])) as (base, orch):
        await wait_healthy(base)
        # The test's own dispatch, recorded: a checkpoint's scope is the journal's rollouts.
        await add_rollouts(orch, {f"r{i}": {"prompt": f"p{i}", "turns": 3} for i in range(2)})
        status, started = await call("POST", f"{base}/v1/checkpoints", headers=AUTH,
                                     json={"checkpoint_id": "ck-r", "directory": str(tmp_path / "ckpts")})
        assert status == 202, started
        row = await wait_state(base, "/v1/checkpoints/ck-r", TERMINAL)
    assert row["state"] == "done", row
    stack.kill()
    await asyncio.gather(*runs, return_exceptions=True)

    fresh = await start_stack(procs, dirs)
    async with served(settings(journal_url, fresh, roots=[str(tmp_path)])) as (base, _):
        await wait_healthy(base)

        async def moved() -> bool:  # discovery re-synced the new URLs
            _, body = await call("GET", f"{base}/v1/participants")
            return {p["url"] for p in body["participants"] if p["health"] == "healthy"} == {
                fresh.url(k) for k in KINDS}
        await until(moved, what="the fresh URLs")
        missing = await call("POST", f"{base}/v1/restores", headers=AUTH, json={"directory": str(tmp_path / "none")})
        status, started = await call("POST", f"{base}/v1/restores", headers=AUTH,
                                     json={"directory": str(tmp_path / "ckpts")})
        assert status == 202, started
        conflict = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={})
        restored = await wait_state(base, f"/v1/restores/{started['restore_id']}", ("done", "failed"))
        status, listed = await call("GET", f"{base}/v1/restores")
    assert missing[0] == 404 and "LATEST" in missing[1]["error"]["detail"], missing
    assert started["checkpoint_id"] == "ck-r" and started["episodes"] >= 1, started
    assert conflict[0] == 409 and conflict[1]["error"]["code"] == "restore_open", conflict
    assert restored["state"] == "done", restored
    assert [p["state"] for p in restored["timings"]["phases"]] == ["restoring", "resuming", "done"]
    assert listed["restores"][0]["id"] == started["restore_id"]
    for kind in KINDS:
        assert (await controller.status(fresh.url(kind)))["phase"] == "idle"


# -- refusals (no reference processes needed) ----------------------------------------------------

def light_settings(journal_url: str, participants: dict[str, str]) -> Settings:
    return Settings.model_validate({
        "journal": {"url": journal_url}, "control": {"token": TOKEN},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "discovery": {"probe_timeout_s": 1, "interval_s": 60},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "logging": {"level": "WARNING"}})


BAD = [
    ("/v1/checkpoints", {"checkpoint_id": "bad id"}, "checkpoint_id", "checkpoint_id='bad id': String should match"),
    ("/v1/checkpoints", {"checkpoint_id": 7}, "checkpoint_id", "checkpoint_id=7: Input should be a valid string"),
    ("/v1/checkpoints", {"checkpoint_id": "x" * 129}, "checkpoint_id", "at most 128 characters"),
    ("/v1/checkpoints", {"directory": ""}, "directory", "directory='': String should have at least 1 character"),
    ("/v1/checkpoints", {"colour": "red"}, "colour", "colour='red': Extra inputs are not permitted"),
    ("/v1/checkpoints", [1, 2], "body", "body: must be a JSON object, got list"),
    ("/v1/checkpoints", "{not json", "body", "body: not JSON"),
    ("/v1/restores", {"checkpoint_id": "../up"}, "checkpoint_id", "checkpoint_id='../up': String should match"),
    ("/v1/restores", {"directory": "a\x00b"}, "directory", "must not contain a NUL character"),
    ("/v1/rollouts/r1/retire", {}, "attempt", "attempt: Field required"),
    ("/v1/rollouts/r1/retire", {"attempt": -1}, "attempt", "attempt=-1: Input should be greater than or equal to 0"),
    ("/v1/rollouts/r1/retire", {"attempt": "1"}, "attempt", "attempt='1': Input should be a valid integer"),
    ("/v1/rollouts/r1/retire", {"attempt": True}, "attempt", "attempt=True: Input should be a valid integer"),
    ("/v1/rollouts/r1/retire", {"attempt": 0, "episodes": []}, "episodes", "Extra inputs are not permitted"),
    ("/v1/rollouts/r1-a2/retire", {"attempt": 0}, "rollout_id", "rollout_id='r1-a2': Value error, rollout id"),
    ("/v1/rollouts/r1/forget", {"attempt": 0}, "attempt", "attempt=0: Extra inputs are not permitted"),
    ("/v1/rollouts/-r1/forget", {}, "rollout_id", "rollout_id='-r1': String should match"),
    ("/v1/checkpoints/ck-1/abort", {"reason": ""}, "reason", "reason='': String should have at least 1"),
]


async def test_bad_bodies_missing_tokens_and_standbys_are_refused_and_change_nothing(
        journal_url: str, tmp_path: Path) -> None:
    participant = StatusServer("ok", "resources")
    await participant.start()
    try:
        async with served(light_settings(journal_url, {"res-0": participant.url})) as (base, orch):
            await wait_healthy(base, 1)
            await until(lambda: asyncio.sleep(0, result=orch.is_leader), what="leader")
            before = await count_events(journal_url)
            for path, body, field, needle in BAD:
                kw: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
                status, reply = await call("POST", f"{base}{path}", headers=AUTH, **kw)
                assert status == 422, (path, body, reply)
                err = reply["error"]
                assert err["code"] == "invalid_body" and err["field"] == field, (path, body, err)
                assert needle in err["detail"], (path, body, err)
            status, reply = await call("POST", f"{base}/v1/checkpoints?wait=1", headers=AUTH, json={})
            assert (status, reply["error"]["code"]) == (400, "invalid_query"), reply
            for path in ("/v1/checkpoints", "/v1/restores", "/v1/rollouts/r1/retire", "/v1/rollouts/r1/forget",
                         "/v1/checkpoints/ck-1/abort"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                    status, reply = await call("POST", f"{base}{path}", headers=headers, json={"attempt": 0})
                    assert (status, reply["error"]["code"]) == (401, "unauthorized"), (path, reply)
            for query, needle in (("limit=0", "limit='0': must be between"), ("state=nope", "not a state of checkpoints"),
                                  ("before=ck-x", "before='ck-x': no checkpoints row"), ("colour=1", "unknown")):
                status, reply = await call("GET", f"{base}/v1/checkpoints?{query}")
                assert status == 400 and needle in reply["error"]["detail"], (query, reply)
            assert await count_events(journal_url) == before, "a refused request wrote something"

            # A standby on the same journal answers reads but refuses writes.
            async with served(light_settings(journal_url, {"res-0": participant.url}), lead=False) as (standby, _):
                status, reply = await call("POST", f"{standby}/v1/checkpoints", headers=AUTH, json={})
                assert (status, reply["error"]["code"]) == (503, "not_leader"), reply
                assert (await call("GET", f"{standby}/v1/checkpoints"))[0] == 200

            # A participant that is not healthy is not checkpointed: nothing to do, and it says why.
            await participant.stop()
            await call("POST", f"{base}/v1/participants/probe", headers=AUTH)

            async def down() -> bool:
                _, body = await call("GET", f"{base}/v1/participants")
                return bool(body["participants"][0]["health"] != "healthy")
            await until(down, what="the participant to be seen down")
            status, reply = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={})
            assert (status, reply["error"]["code"]) == (409, "no_participants"), reply
            assert "res-0 is unreachable" in reply["error"]["detail"], reply
            assert (await call("GET", f"{base}/v1/checkpoints"))[1] == {"checkpoints": [], "next_before": None}
    finally:
        await participant.stop()


async def test_the_list_is_newest_first_and_paged(journal_url: str, tmp_path: Path) -> None:
    from engine.workflows.checkpoint.checkpoint import start_checkpoint
    from journal.writes import Row

    journal = Journal.open(journal_url)
    member = Row("participants", "res-0", "healthy", 2, {"kind": "resources", "url": "http://127.0.0.1:9"})
    try:
        for n in range(3):
            async with journal.write() as tx:
                await start_checkpoint(tx, f"ck-{n}", str(tmp_path), [member])
            async with journal.write() as tx:
                await tx.transition("checkpoints", f"ck-{n}", from_state="preparing", version=1, to_state="failed",
                                    reason="made up by the test", changes={"detail": "test"})
    finally:
        await journal.dispose()
    async with served(light_settings(journal_url, {})) as (base, _):
        status, page1 = await call("GET", f"{base}/v1/checkpoints", params={"limit": "2"})
        status2, page2 = await call("GET", f"{base}/v1/checkpoints",
                                    params={"limit": "2", "before": page1["next_before"]})
        _, failed = await call("GET", f"{base}/v1/checkpoints", params={"state": "failed"})
        _, one = await call("GET", f"{base}/v1/checkpoints/ck-1")
    assert status == status2 == 200
    assert [r["id"] for r in page1["checkpoints"]] == ["ck-2", "ck-1"] and page1["next_before"] == "ck-1"
    assert [r["id"] for r in page2["checkpoints"]] == ["ck-0"] and page2["next_before"] is None
    assert len(failed["checkpoints"]) == 3
    assert one["state"] == "failed" and one["terminal"] and one["members"][0]["participant"] == "res-0"
    assert [p["state"] for p in one["timings"]["phases"]] == ["preparing", "failed"]



async def test_membership_fails_closed_for_checkpoints_and_restores(journal_url: str, tmp_path: Path) -> None:
    """Two configured participants, one of them down: no checkpoint (409 ``membership_incomplete``
    naming it), nothing written. A restore of a published checkpoint whose members differ from the
    participants (its env-0 missing, res-0 not a member) is refused naming each, nothing written."""
    from tests.engine.http.test_hostile_input import MEMBERS, checkpoint_rows, publish_files

    root = tmp_path / "ckpts"
    root.mkdir()

    def configured(participants: dict[str, str]) -> Settings:
        return Settings.model_validate({
            "journal": {"url": journal_url}, "control": {"token": TOKEN},
            # No take-over here (each orchestrator releases its lease when it stops): a long lease,
            # so a test worker starved for seconds by the rest of the suite does not step down.
            "orchestrator": {"lease_ttl_s": 30, "lease_renew_s": 1, "shutdown_grace_s": 1},
            "discovery": {"probe_timeout_s": 1, "interval_s": 60}, "checkpoint": {"directory": str(root)},
            "participants": [{"name": n, "url": u} for n, u in participants.items()],
            "logging": {"level": "WARNING"}})

    up = StatusServer("ok", "resources")
    await up.start()
    try:
        async with served(configured({"res-0": up.url, "env-9": "http://127.0.0.1:9"})) as (base, _):
            await wait_healthy(base, 1)

            async def env_seen_down() -> bool:
                _, body = await call("GET", f"{base}/v1/participants")
                return {p["name"]: p["health"] for p in body["participants"]}.get("env-9") == "unreachable"
            await until(env_seen_down, what="env-9 to be seen unreachable")
            before = await count_events(journal_url)
            status, reply = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={})
            assert (status, reply["error"]["code"]) == (409, "membership_incomplete"), reply
            assert reply["error"]["missing"] == {"env-9": "unreachable"}, reply
            assert "covers every configured participant, and env-9 is unreachable" in reply["error"]["detail"]
            assert await count_events(journal_url) == before, "a refused checkpoint wrote something"
        # A published checkpoint of other members (env-0, an environment): refused, naming the difference.
        await checkpoint_rows(journal_url, "ck-other", root, "done", MEMBERS, ["r1"])
        publish_files(root, "ck-other", MEMBERS, ["r1"])
        async with served(configured({"res-0": up.url})) as (base, _):
            await wait_healthy(base, 1)
            status, reply = await call("POST", f"{base}/v1/restores", headers=AUTH, json={"checkpoint_id": "ck-other"})
            assert (status, reply["error"]["code"]) == (409, "membership_mismatch"), reply
            assert reply["error"]["missing"] == {"env-0": "not configured"} and reply["error"]["extra"] == ["res-0"]
            assert "restores into its own members only" in reply["error"]["detail"], reply
            assert (await call("GET", f"{base}/v1/restores"))[1]["restores"] == []
            listed = (await call("GET", f"{base}/v1/checkpoints"))[1]["checkpoints"]
            assert [c["id"] for c in listed] == ["ck-other"], listed
    finally:
        await up.stop()
