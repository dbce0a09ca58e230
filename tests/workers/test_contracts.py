"""Contract tests over real HTTP: malformed bodies never reach a 500, and every corrupt
checkpoint a restore meets is a typed 422 with nothing installed and admission open.

The hypothesis test drives a participant served from its own event loop in a background
thread (hypothesis runs synchronous examples), over loopback HTTP with the stdlib client.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support.checkpoints import CORRUPT_MANIFESTS, corrupt_manifest
from tests.support.participant_http import TOKEN, ControlServer, ScriptedEpisode, error_code
from workers.participant.control import ControlPlane
from workers.participant.kinds.environment import EnvironmentParticipant
from workers.participant.routes import mount
from workers.participant.storage import participant_dir
from workers.protocol import CONTROL_PREFIX, REQUEST_MODELS

# -- malformed bodies ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def threaded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        control = ControlPlane(EnvironmentParticipant("env-0"), state_dir=tmp_path_factory.mktemp("state"))
        app = web.Application()
        mount(app, control, token=TOKEN)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{holder['port']}{CONTROL_PREFIX}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _post(url: str, data: bytes) -> int:
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}, body
        return int(exc.code)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
VALID = {"checkpoint_id": "c1", "deadline_ts": 4e9, "episode_ids": [{"rollout_id": "r", "attempt": 0}],
         "rollout_ids": ["r"], "checkpoint_dir": "/nonexistent/ck"}
FIELDS = {op: set(model.model_fields) for op, model in REQUEST_MODELS.items()}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, Any]:
    op = draw(st.sampled_from(sorted(REQUEST_MODELS)))
    base = {k: v for k, v in VALID.items() if k in FIELDS[op]}
    how = draw(st.sampled_from(["any", "replace", "drop", "extra"]))
    if how == "any":
        return op, draw(json_values)
    field = draw(st.sampled_from(sorted(base)))
    if how == "replace":
        base[field] = draw(json_values)
    elif how == "drop":
        base.pop(field)
    else:
        base[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in FIELDS[op]))] = 1
    return op, base


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_every_route_refuses_malformed_bodies_with_a_4xx(threaded_url: str, case: tuple[str, Any]) -> None:
    op, body = case
    try:
        REQUEST_MODELS[op].model_validate(body)
        valid = True
    except ValidationError:
        valid = False
    assume(not valid)  # valid bodies act on the participant; the contract is about the others
    assert _post(f"{threaded_url}/{op}", json.dumps(body).encode()) == 422


# -- corrupt checkpoints over the restore route -------------------------------------------------

@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[ControlServer, ControlServer, dict[str, Any]]]:
    """A committed checkpoint of one parked episode, and a fresh participant to restore it into."""
    first = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "s1").start()
    env = first.participant
    assert isinstance(env, EnvironmentParticipant)
    episode = ScriptedEpisode(env, "r1").start()
    await episode.in_step.wait()
    prepare = asyncio.create_task(first.ok("prepare", "c1"))
    while await first.phase() != "preparing":
        await asyncio.sleep(0.01)
    episode.release()
    await prepare
    manifest = (await first.ok("commit", "c1", checkpoint_dir=str(tmp_path / "ck")))["manifest"]
    await first.ok("resume", "c1")
    episode.release(3)
    await episode.task_handle  # type: ignore[misc]
    fresh = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "s2").start()
    yield first, fresh, manifest
    await first.stop()
    await fresh.stop()


async def assert_refused_and_open(fresh: ControlServer, status: int, body: dict[str, Any]) -> None:
    assert (status, error_code(body)) == (422, "invalid_checkpoint_state"), body
    _, st_body = await fresh.status()
    env = fresh.participant
    assert isinstance(env, EnvironmentParticipant)
    assert st_body["phase"] == "idle" and st_body["checkpoint_id"] is None and env.restored_pending() == []
    probe = ScriptedEpisode(env, "probe").start()  # admission is open: a new episode begins
    await probe.in_step.wait()
    await env.retire(probe.id)


@pytest.mark.parametrize("how", CORRUPT_MANIFESTS)
async def test_every_corrupt_manifest_is_a_422_with_nothing_installed(
        pair: tuple[ControlServer, ControlServer, dict[str, Any]], tmp_path: Path, how: str) -> None:
    _, fresh, manifest = pair
    corrupt_manifest(participant_dir(tmp_path / "ck", "environment", "env-0"), manifest, how)
    status, body = await fresh.call("restore", "c1", checkpoint_dir=str(tmp_path / "ck"),
                                    episode_ids=[{"rollout_id": "r1"}])
    await assert_refused_and_open(fresh, status, body)


async def test_a_tampered_records_file_is_a_422_with_nothing_installed(
        pair: tuple[ControlServer, ControlServer, dict[str, Any]], tmp_path: Path) -> None:
    _, fresh, manifest = pair
    records = participant_dir(tmp_path / "ck", "environment", "env-0") / manifest["records_file"]
    data = records.read_bytes()
    records.write_bytes(data.replace(b"turn", b"tUrn", 1))
    status, body = await fresh.call("restore", "c1", checkpoint_dir=str(tmp_path / "ck"),
                                    episode_ids=[{"rollout_id": "r1"}])
    await assert_refused_and_open(fresh, status, body)


async def test_a_commit_into_a_directory_that_cannot_hold_state_is_a_422(tmp_path: Path) -> None:
    server = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "s").start()
    try:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        await server.ok("prepare", "c1")
        status, body = await server.call("commit", "c1", checkpoint_dir=str(blocker / "ck"))
        assert (status, error_code(body)) == (422, "invalid_checkpoint_state")
        assert await server.phase() == "prepared"  # nothing changed; the controller resumes
        await server.ok("resume", "c1")
        _, st_body = await server.status()
        assert st_body["phase"] == "idle"
    finally:
        await server.stop()
