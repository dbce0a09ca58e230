"""The resources participant over real HTTP: the three modes, closed-admission refusals, replay
verify, commit and restore into a fresh server, and retired sessions.

Each test runs a tiny resources server whose routes go through
:meth:`ResourcesParticipant.request`: ``/ng-rollout/<key>/seed_session`` creates a session and
binds it (its reply carries the checkpoint headers), ``/step`` counts a call in the session's
state (optionally held until released), ``/verify`` and ``/close_session`` end it. The session
id travels in an ``x-session`` header, as a cookie would.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.workers.kinds.harness import KindServer, error_code, until
from workers.participant import storage
from workers.participant.kinds import (RESTART_HEADER, VERIFY_HEADER, ResourcesParticipant, verify_mode_of)
from workers.participant.kinds.resources import Route
from workers.protocol import EpisodeId


class FakeResources:
    """The resources server: session states in memory, and the state hooks over them."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.retired: list[str] = []
        self.participant: ResourcesParticipant | None = None
        self.ids = itertools.count(1)
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.release: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def export_session_states(self, session_ids: Sequence[str]) -> Mapping[str, Any]:
        return {sid: copy.deepcopy(self.states[sid]) for sid in session_ids}

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        self.states.update(copy.deepcopy(dict(states)))

    async def retire_session_state(self, session_id: str) -> None:
        self.states.pop(session_id, None)
        self.retired.append(session_id)

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/ng-rollout/{key}/seed_session", self.seed)
        for route in ("step", "verify", "close_session"):
            app.router.add_post(f"/ng-rollout/{{key}}/{route}", self.handler(route))

    async def seed(self, request: web.Request) -> web.Response:
        assert self.participant is not None
        episode = EpisodeId.from_capture_key(request.match_info["key"])
        body = await request.json()
        async with self.participant.request(episode, "seed") as req:
            sid = f"sess-{next(self.ids)}"
            self.states[sid] = {"calls": 0}
            headers = req.bind(sid, verify_mode=body.get("verify_mode"))
        return web.json_response({"session_id": sid}, headers=headers)

    def handler(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        route: Route = {"step": "data", "verify": "verify", "close_session": "close"}[name]  # type: ignore[assignment]

        async def handle(request: web.Request) -> web.Response:
            assert self.participant is not None
            key = request.match_info["key"]
            sid = request.headers.get("x-session")
            body = await request.json()
            async with self.participant.request(EpisodeId.from_capture_key(key), route, session_id=sid):
                self.entered[f"{key}/{name}"].set()
                if body.get("hold"):
                    await self.release[f"{key}/{name}"].wait()
                state = self.states.get(sid) if sid is not None else None
                if name == "step" and state is not None:
                    state["calls"] += 1
            return web.json_response({"state": copy.deepcopy(state)})
        return handle


Server = KindServer[ResourcesParticipant]
Make = Callable[..., Awaitable[tuple[Server, FakeResources]]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    servers: list[Server] = []

    async def build(name: str = "r1", **options: Any) -> tuple[Server, FakeResources]:
        fake = FakeResources()
        if options.get("mode") == "exported":
            options["hooks"] = fake
        participant = ResourcesParticipant("res-0", **options)
        fake.participant = participant
        server = KindServer(participant, tmp_path / f"state-{name}", lease_grace_seconds=60)
        fake.mount(server.app)
        servers.append(await server.start())
        return server, fake
    yield build
    for server in servers:
        await server.stop()


def scope(*keys: str) -> list[dict[str, Any]]:
    return [EpisodeId.from_capture_key(k).model_dump() for k in keys]


async def seed(srv: Server, key: str, verify_mode: str | None = None) -> tuple[str, dict[str, str]]:
    status, body, headers = await srv.post(f"/ng-rollout/{key}/seed_session", {"verify_mode": verify_mode})
    assert status == 200, body
    return str(body["session_id"]), headers


async def call(srv: Server, key: str, route: str, sid: str | None, **body: Any) -> tuple[int, Any]:
    status, reply, _ = await srv.post(f"/ng-rollout/{key}/{route}", body, headers={"x-session": sid} if sid else {})
    return status, reply


def test_modes_and_hooks_are_checked() -> None:
    assert ResourcesParticipant("res-0").mode == "restart_only"
    with pytest.raises(ValueError):
        ResourcesParticipant("res-0", mode="exported")
    with pytest.raises(ValueError):
        ResourcesParticipant("res-0", mode="stateless", hooks=FakeResources())
    with pytest.raises(ValueError):
        ResourcesParticipant("res-0", mode="snapshot")  # type: ignore[arg-type]
    assert verify_mode_of({"X-NG-Checkpoint-Verify": "replay"}) == "replay"
    assert verify_mode_of({"x-ng-checkpoint-verify": "later"}) == "wait" == verify_mode_of({})


async def test_restart_only_is_the_default_and_fails_closed(make: Make, tmp_path: Path) -> None:
    srv, fake = await make()
    sid, headers = await seed(srv, "e1")
    assert headers[RESTART_HEADER] == "1" and headers[VERIFY_HEADER] == "wait"
    held = asyncio.create_task(call(srv, "e1", "step", sid, hold=True))
    await fake.entered["e1/step"].wait()

    prepared = await srv.ok("prepare", "ck-1")  # in-flight restart_only work never blocks
    assert prepared["phase"] == "prepared" and prepared["report"]["restarts"] == ["e1"]
    assert (await srv.status())["mode"] == "restart_only"
    status, body = await call(srv, "e1", "step", sid)
    assert status == 409 and error_code(body) == "admission_closed"
    late_seed = asyncio.create_task(seed(srv, "e2"))  # restart_only seeds wait
    await asyncio.sleep(0.05)
    assert not late_seed.done()

    status, body = await srv.ctl("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("e1"))
    assert status == 409 and error_code(body) == "restart_in_scope"
    assert (await call(srv, "e1", "close_session", sid))[0] == 200  # close is never refused
    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=[])
    assert reply["episode_ids"] == []
    await srv.ok("resume", "ck-1")
    await late_seed
    fake.release["e1/step"].set()
    assert (await held)[0] == 200
    assert srv.participant.restarts() == ["e2"]


async def test_exported_sessions_admission_replay_verify_and_round_trip(make: Make, tmp_path: Path) -> None:
    srv, fake = await make("r1", mode="exported")
    sid1, headers = await seed(srv, "e1")
    assert headers[VERIFY_HEADER] == "wait" and RESTART_HEADER not in headers
    sid2, headers = await seed(srv, "e2", verify_mode="replay")
    assert headers[VERIFY_HEADER] == "replay"
    assert (await call(srv, "e1", "step", sid1))[0] == 200
    fake.entered["e1/step"].clear()
    held = asyncio.create_task(call(srv, "e1", "step", sid1, hold=True))
    await fake.entered["e1/step"].wait()

    # An in-flight request blocks: the prepare misses its deadline, then re-joins once it ends.
    missed = await srv.ok("prepare", "ck-1", seconds=0.3)
    assert missed["phase"] == "preparing" and missed["report"]["blockers"] == ["e1"]
    fake.release["e1/step"].set()
    assert (await held)[1] == {"state": {"calls": 2}}
    assert (await srv.ok("prepare", "ck-1"))["phase"] == "prepared"

    status, body = await call(srv, "e1", "step", sid1)
    assert status == 409 and error_code(body) == "admission_closed"
    status, body = await call(srv, "e1", "verify", sid1)
    assert status == 409 and error_code(body) == "admission_closed"
    status, body = await call(srv, "e3", "seed_session", None)
    assert status == 409 and error_code(body) == "admission_closed"
    # A replay-mode verify is admitted, does not block, and its session is still exported.
    assert (await call(srv, "e2", "verify", sid2))[0] == 200
    assert srv.participant.ready()

    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("e1", "e2"))
    assert reply["episode_ids"] == ["e1", "e2"]
    _, records = storage.read_records(tmp_path / "ckpt", "resources", "res-0", lambda r: r)
    assert records == [
        {"episode_id": {"rollout_id": "e1", "attempt": 0}, "session_id": sid1, "state": {"calls": 2},
         "owner": "res-0"},
        {"episode_id": {"rollout_id": "e2", "attempt": 0}, "session_id": sid2, "state": {"calls": 0},
         "owner": "res-0"},
    ]
    await srv.ok("resume", "ck-1")
    assert fake.retired == [sid2], "the verified session ends once the checkpoint reopens"

    # A fresh server restores identical state under the replacement attempts.
    fresh, fake2 = await make("r2", mode="exported")
    restored = await fresh.ok("restore", "ck-r", checkpoint_dir=str(tmp_path / "ckpt"),
                              episode_ids=scope("e1", "e2"))
    assert restored["restored"] == ["e1-a1", "e2-a1"]
    assert fake2.states == {sid1: {"calls": 2}, sid2: {"calls": 0}}
    status, body = await call(fresh, "e1-a1", "step", sid1)
    assert status == 409 and error_code(body) == "admission_closed"
    await fresh.ok("resume", "ck-r")
    status, body = await call(fresh, "e1", "step", sid1)
    assert status == 409 and error_code(body) == "stale_attempt"
    assert await call(fresh, "e1-a1", "step", sid1) == (200, {"state": {"calls": 3}})
    assert [e.capture_key for e in fresh.participant.restored_pending()] == ["e2-a1"]
    assert (await call(fresh, "e1-a1", "close_session", sid1))[0] == 200
    assert fake2.retired == [sid1]


async def test_stateless_sessions_export_no_state_and_keep_routing(make: Make, tmp_path: Path) -> None:
    srv, _ = await make("r1", mode="stateless")
    sid, headers = await seed(srv, "e1")
    assert RESTART_HEADER not in headers
    await srv.ok("prepare", "ck-1")
    await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("e1"))
    _, records = storage.read_records(tmp_path / "ckpt", "resources", "res-0", lambda r: r)
    assert records == [{"episode_id": {"rollout_id": "e1", "attempt": 0}, "session_id": sid, "state": None,
                        "owner": "res-0"}]
    fresh, _ = await make("r2", mode="stateless")
    await fresh.ok("restore", "ck-r", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("e1"))
    assert (await fresh.status())["sessions"] == 1
    await fresh.ok("resume", "ck-r")
    assert (await call(fresh, "e1-a1", "step", sid))[0] == 200
    assert fresh.participant.restored_pending() == []


async def test_retired_sessions_are_refused_until_forget(make: Make) -> None:
    srv, fake = await make(mode="exported")
    sid, _ = await seed(srv, "e1")
    held = asyncio.create_task(call(srv, "e1", "step", sid, hold=True))
    await fake.entered["e1/step"].wait()
    assert (await srv.ok("retire", "ck-x", episode_ids=scope("e1")))["retired_count"] == 1
    status, body = await held
    assert status == 409 and error_code(body) == "stale_attempt"
    assert fake.retired == [sid]
    status_body = await srv.status()
    assert status_body["retired_sessions"] == 1 and status_body["sessions"] == 0
    # The next attempt may not reuse the retired session.
    status, body = await call(srv, "e1-a1", "step", sid)
    assert status == 409 and error_code(body) == "stale_attempt"
    await until(lambda: srv.participant.readiness().counts["inflight"] == 0)
    await srv.ok("forget", "ck-x", rollout_ids=["e1"])
    assert (await srv.status())["retired_sessions"] == 0
    assert (await call(srv, "e1", "step", sid))[0] == 200
