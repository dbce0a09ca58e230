"""The agent participant over real HTTP: checkpointed sessions (with session hooks) and
restart-only agents (without), restore into a fresh agent, and retire.

Each test runs a tiny agent server. ``POST /v1/agent_sessions`` seeds a session through
:meth:`AgentParticipant.seed` (its reply carries the session's headers); ``POST /activate/<key>``
runs one activation that optionally works (running, blocking) until released, appends a turn,
reports a boundary and optionally waits on a policy call (at a boundary) until released.
"""

from __future__ import annotations

import asyncio
import copy
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.workers.kinds.harness import KindServer, error_code, until
from workers.participant import storage
from workers.participant.kinds import RESTART_HEADER, AgentParticipant, RestoredSession
from workers.protocol import EpisodeId


class FakeAgent:
    """The agent server: session states in memory, and the session hooks over them."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.restored: list[RestoredSession] = []
        self.retired: list[str] = []
        self.agent: AgentParticipant | None = None
        self.working: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.release_work: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.awaiting: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.model_reply: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    # -- SessionHooks ---------------------------------------------------------------------------

    async def export_sessions(self, keys: Sequence[str]) -> Mapping[str, Any]:
        return {key: copy.deepcopy(self.states[key]) for key in keys}

    async def restore_sessions(self, sessions: Sequence[RestoredSession]) -> None:
        for session in sessions:
            self.states[session.session_key] = copy.deepcopy(session.session)
        self.restored.extend(sessions)

    async def retire_session(self, key: str) -> None:
        self.states.pop(key, None)
        self.retired.append(key)

    # -- data plane -----------------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/v1/agent_sessions", self.seed)
        app.router.add_post("/activate/{key}", self.activate)

    async def seed(self, request: web.Request) -> web.Response:
        assert self.agent is not None
        body = await request.json()
        episode = EpisodeId(rollout_id=body["rollout_id"], attempt=body.get("attempt", 0))
        session = await self.agent.seed(body["session_key"], episode)
        self.states.setdefault(session.key, {"turns": []})
        return web.json_response({"continuation": session.continuation}, headers=session.headers)

    async def activate(self, request: web.Request) -> web.Response:
        assert self.agent is not None
        key = request.match_info["key"]
        body = await request.json()
        session = self.agent.get(key)
        if session is None:
            return web.json_response({"error": "no such session"}, status=404)
        async with session.activation():
            self.working[key].set()
            if body.get("work"):
                await self.release_work[key].wait()
            state = self.states[key]
            state["turns"].append(len(state["turns"]) + 1)
            snapshot = {"next": "model", "turn": len(state["turns"])}
            await session.boundary(lambda: snapshot)
            if body.get("model"):
                async with session.awaiting_model():
                    self.awaiting[key].set()
                    await self.model_reply[key].wait()
        return web.json_response({"state": self.states.get(key)})


Server = KindServer[AgentParticipant]
Make = Callable[..., Awaitable[tuple[Server, FakeAgent]]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    servers: list[Server] = []

    async def build(name: str = "a1", *, hooks: bool = True) -> tuple[Server, FakeAgent]:
        fake = FakeAgent()
        participant = AgentParticipant("agent-0", fake if hooks else None)
        fake.agent = participant
        server = KindServer(participant, tmp_path / f"state-{name}", lease_grace_seconds=60)
        fake.mount(server.app)
        servers.append(await server.start())
        return server, fake
    yield build
    for server in servers:
        await server.stop()


def scope(*keys: str) -> list[dict[str, Any]]:
    return [EpisodeId.from_capture_key(k).model_dump() for k in keys]


async def seed(srv: Server, key: str, rollout: str, attempt: int = 0) -> tuple[int, Any, dict[str, str]]:
    return await srv.post("/v1/agent_sessions", {"session_key": key, "rollout_id": rollout, "attempt": attempt})


async def test_sessions_checkpoint_at_boundaries_and_restore_into_a_fresh_agent(make: Make, tmp_path: Path) -> None:
    srv, fake = await make("a1")
    status, _, headers = await seed(srv, "s1", "r1")
    assert status == 200 and RESTART_HEADER not in headers
    await seed(srv, "s2", "r2")
    # s1 works (running, blocking); s2 waits on its policy call (at a boundary).
    act1 = asyncio.create_task(srv.post("/activate/s1", {"work": True}))
    act2 = asyncio.create_task(srv.post("/activate/s2", {"model": True}))
    await fake.working["s1"].wait()
    await fake.awaiting["s2"].wait()

    prepare = asyncio.create_task(srv.ok("prepare", "ck-1"))
    await until(lambda: srv.control.phase == "preparing")
    report = (await srv.status())["report"]
    assert report["blockers"] == ["r1"] and report["counts"] == {"sessions": 2, "running": 1, "at_boundary": 1}
    assert report["restarts"] == []
    await asyncio.sleep(0.05)
    assert not prepare.done()
    fake.release_work["s1"].set()  # s1 reaches its boundary and parks there
    assert (await prepare)["phase"] == "prepared"
    assert (await srv.status())["report"]["counts"]["at_boundary"] == 2

    # A new session seeded mid-checkpoint waits for it to reopen.
    late = asyncio.create_task(seed(srv, "s3", "r3"))
    await asyncio.sleep(0.05)
    assert not late.done()

    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("r1", "r2"))
    assert reply["episode_ids"] == ["r1", "r2"]
    _, records = storage.read_records(tmp_path / "ckpt", "agent", "agent-0", lambda r: r)
    assert records == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_key": "s1", "session": {"turns": [1]},
         "boundary": {"next": "model", "turn": 1}},
        {"episode_id": {"rollout_id": "r2", "attempt": 0}, "session_key": "s2", "session": {"turns": [1]},
         "boundary": {"next": "model", "turn": 1}},
    ]
    await srv.ok("resume", "ck-1")
    assert (await late)[0] == 200
    fake.model_reply["s2"].set()
    assert (await act1)[0] == 200 and (await act2)[0] == 200

    # A fresh agent process restores both sessions under the replacement attempts.
    fresh, fake2 = await make("a2")
    restored = await fresh.ok("restore", "ck-r", checkpoint_dir=str(tmp_path / "ckpt"),
                              episode_ids=scope("r1", "r2"))
    assert restored["restored"] == ["r1-a1", "r2-a1"]
    assert fake2.restored == [
        RestoredSession("s1", EpisodeId(rollout_id="r1", attempt=1), {"turns": [1]}, {"next": "model", "turn": 1}),
        RestoredSession("s2", EpisodeId(rollout_id="r2", attempt=1), {"turns": [1]}, {"next": "model", "turn": 1}),
    ]
    assert [e.capture_key for e in fresh.participant.restored_pending()] == ["r1-a1", "r2-a1"]
    await fresh.ok("resume", "ck-r")
    status, body, _ = await seed(fresh, "s1", "r1", 0)
    assert status == 409 and error_code(body) == "stale_attempt"
    status, body, _ = await seed(fresh, "s1", "r1", 1)
    assert status == 200 and body == {"continuation": {"next": "model", "turn": 1}}
    status, body, _ = await fresh.post("/activate/s1", {})
    assert status == 200 and body == {"state": {"turns": [1, 2]}}

    # The unclaimed restored session is re-exported while unclaimed, and deleted when left out.
    await fresh.ok("prepare", "ck-2")
    again = await fresh.ok("commit", "ck-2", checkpoint_dir=str(tmp_path / "ckpt2"), episode_ids=scope("r1-a1"))
    assert again["episode_ids"] == ["r1-a1"]
    assert fake2.retired == ["s2"] and fresh.participant.get("s2") is None


async def test_restore_requires_no_live_sessions(make: Make, tmp_path: Path) -> None:
    srv, _ = await make()
    await seed(srv, "s1", "r1")
    status, body = await srv.ctl("restore", "ck-r", checkpoint_dir=str(tmp_path / "none"), episode_ids=[])
    assert status == 409 and error_code(body) == "invalid_phase"


async def test_restart_only_agent_reports_restarts_and_refuses_them_in_scope(make: Make, tmp_path: Path) -> None:
    srv, fake = await make(hooks=False)
    status, _, headers = await seed(srv, "s1", "r1")
    assert status == 200 and headers[RESTART_HEADER] == "1"
    act = asyncio.create_task(srv.post("/activate/s1", {"work": True}))
    await fake.working["s1"].wait()

    prepared = await srv.ok("prepare", "ck-1")  # a running restart never blocks
    assert prepared["phase"] == "prepared"
    assert prepared["report"]["restarts"] == ["r1"] and prepared["report"]["blocker_count"] == 0
    assert (await srv.status())["restart_only"] is True

    status, body = await srv.ctl("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("r1"))
    assert status == 409 and error_code(body) == "restart_in_scope"
    # The restart keeps running through the checkpoint.
    fake.release_work["s1"].set()
    assert (await act)[0] == 200
    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=[])
    assert reply["episode_ids"] == [] and reply["manifest"]["record_count"] == 0
    await srv.ok("resume", "ck-1")


async def test_retire_cancels_an_activation_and_refuses_the_attempt(make: Make) -> None:
    srv, fake = await make()
    await seed(srv, "s1", "r1")
    act = asyncio.create_task(srv.post("/activate/s1", {"work": True}))
    await fake.working["s1"].wait()
    assert (await srv.ok("retire", "ck-x", episode_ids=scope("r1")))["retired_count"] == 1
    status, body, _ = await act
    assert status == 409 and error_code(body) == "stale_attempt"
    assert fake.retired == ["s1"] and srv.participant.get("s1") is None
    status, body, _ = await seed(srv, "s1", "r1")
    assert status == 409 and error_code(body) == "stale_attempt"
    assert (await srv.status())["retired_rollouts"] == 1
    assert (await seed(srv, "s1", "r1", 1))[0] == 200
