"""The participant control plane over real HTTP: phases, fencing, lease, recorded results, commit,
restore, retire and forget (the seed's validation list, as far as it concerns one participant).

Episodes are real environment episodes (``EnvironmentParticipant`` + ``EpisodeSteps``) driven in
the test's event loop; every control call goes over loopback HTTP to the mounted routes. Where a
test needs a fault no real part produces (a close that raises, an export that fails or hangs), it
uses :class:`FaultyEnvironment`, which says so.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.participant_http import ControlServer, ScriptedEpisode, error_code
from workers.participant.base import ExportRecord
from workers.participant.kinds.environment import EnvironmentParticipant
from workers.protocol import EpisodeId, ErrorCode, ProtocolError

Factory = Callable[..., Awaitable[ControlServer]]


class FaultyEnvironment(EnvironmentParticipant):
    """A real environment participant with injected faults (close/open raising, export failing or
    slow) and counters — faults a real server cannot be made to produce on demand."""

    def __init__(self, instance: str = "env-0") -> None:
        super().__init__(instance)
        self.fail_close = 0
        self.fail_open = 0
        self.fail_export = False
        self.export_gate: asyncio.Event | None = None
        self.exports = 0
        self.opens = 0

    async def close_admission(self) -> None:
        await super().close_admission()
        if self.fail_close:
            self.fail_close -= 1
            raise RuntimeError("injected close failure")

    async def open_admission(self) -> None:
        self.opens += 1
        if self.fail_open:
            self.fail_open -= 1
            raise RuntimeError("injected open failure")
        await super().open_admission()

    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        self.exports += 1
        if self.export_gate is not None:
            await self.export_gate.wait()
        if self.fail_export:
            raise RuntimeError("injected export failure")
        return await super().export(scope)


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[Factory]:
    servers: list[ControlServer] = []

    async def make(participant: EnvironmentParticipant | None = None, name: str = "a", **options: Any
                   ) -> ControlServer:
        server = ControlServer(participant or FaultyEnvironment(), tmp_path / f"state-{name}", **options)
        servers.append(await server.start())
        return server
    yield make
    for server in servers:
        await server.stop()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- auth and bodies ----------------------------------------------------------------------------

async def test_a_missing_or_wrong_bearer_is_401(make_server: Factory) -> None:
    server = await make_server()
    for token in (None, "wrong"):
        status, body = await server.status(token=token)
        assert (status, error_code(body)) == (401, "unauthorized")
        status, body = await server.post("prepare", {"checkpoint_id": "c1", "deadline_ts": 1e10}, token=token)
        assert (status, error_code(body)) == (401, "unauthorized")
    assert await server.phase() == "idle"


@pytest.mark.parametrize("op,body", [
    ("retire", {"episode_ids": []}), ("retire", {"episode_ids": "r"}),
    ("retire", {"episode_ids": [{"rollout_id": "r-a1"}]}), ("forget", {"rollout_ids": []}),
    ("commit", {"checkpoint_dir": ""}), ("commit", {"checkpoint_dir": "/x", "extra": 1}),
    ("restore", {"checkpoint_dir": "/x"}), ("restore", {"checkpoint_dir": "/x", "episode_ids": [{"attempt": 1}]}),
    ("renew", {"deadline_ts": "soon"}), ("prepare", {"checkpoint_id": "../x"}), ("prepare", {"checkpoint_id": ""}),
])
async def test_malformed_bodies_are_refused_with_a_4xx_and_change_nothing(make_server: Factory, op: str,
                                                                          body: dict[str, Any]) -> None:
    server = await make_server()
    full = {"checkpoint_id": "c1", "deadline_ts": 1e10, **body}
    status, reply = await server.post(op, full)
    assert 400 <= status < 500 and error_code(reply) == "invalid_request", reply
    assert await server.phase() == "idle"
    status, reply = await server.post(op, None, raw=b"{not json")
    assert status == 422 and error_code(reply) == "invalid_request"


# -- prepare, resume, fencing -------------------------------------------------------------------

async def test_prepare_waits_for_episodes_to_park_and_a_replay_returns_the_same_reply(make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episode = ScriptedEpisode(env, "r1").start()
    await episode.in_step.wait()
    prepare = asyncio.create_task(server.ok("prepare", "c1"))
    await asyncio.sleep(0.2)
    assert not prepare.done() and await server.phase() == "preparing"
    episode.release()
    first = await prepare
    assert first["phase"] == "prepared" and first["report"]["ready"] is True
    assert await server.ok("prepare", "c1") == first
    assert episode.steps_run == 1


async def test_resume_interrupts_a_waiting_prepare_and_fences_its_id(make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episode = ScriptedEpisode(env, "r1").start()
    await episode.in_step.wait()
    prepare = asyncio.create_task(server.ok("prepare", "c1"))
    await asyncio.sleep(0.1)
    assert (await server.ok("resume", "c1"))["idempotent"] is False
    assert (await prepare)["phase"] == "idle"
    status, body = await server.call("prepare", "c1")
    assert (status, error_code(body)) == (409, "stale_checkpoint")
    assert await server.ok("resume", "c1") == {"phase": "idle", "idempotent": True}
    episode.release(3)
    assert (await episode.task_handle)["turn"] == 3  # type: ignore[misc]


async def test_resume_of_an_id_never_seen_fences_it(make_server: Factory) -> None:
    server = await make_server()
    assert await server.ok("resume", "never-prepared") == {"phase": "idle", "idempotent": True}
    status, body = await server.call("prepare", "never-prepared")
    assert (status, error_code(body)) == (409, "stale_checkpoint")


async def test_only_the_last_64_resumed_ids_are_fenced(make_server: Factory) -> None:
    server = await make_server()
    for i in range(65):
        await server.ok("resume", f"c{i}")
    assert (await server.ok("prepare", "c0"))["phase"] == "prepared"  # evicted: the oldest
    await server.ok("resume", "c0")
    status, body = await server.call("prepare", "c64")
    assert (status, error_code(body)) == (409, "stale_checkpoint")


async def test_a_failed_close_reopens_admission_without_fencing(make_server: Factory) -> None:
    env = FaultyEnvironment()
    env.fail_close = 1
    server = await make_server(env)
    status, _ = await server.call("prepare", "c1")
    assert status == 500
    _, body = await server.status()
    assert body["phase"] == "idle" and body["checkpoint_id"] is None
    ScriptedEpisode(env, "r1").start()  # admission is open again
    await settle()
    assert "r1" in env.steps
    assert (await server.ok("prepare", "c1", seconds=0.3))["phase"] == "preparing"  # r1 is mid-step


async def test_phase_rules_and_conflicts(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"))
    assert (status, error_code(body)) == (409, "invalid_phase")
    status, body = await server.call("renew", "c1")
    assert (status, error_code(body)) == (409, "invalid_phase")
    await server.ok("prepare", "c1")
    status, body = await server.call("prepare", "c2")
    assert (status, error_code(body)) == (409, "checkpoint_conflict")
    status, body = await server.call("retire", "c1", episode_ids=[{"rollout_id": "r"}])
    assert (status, error_code(body)) == (409, "invalid_phase")
    status, body = await server.call("forget", "c1", rollout_ids=["r"])
    assert (status, error_code(body)) == (409, "invalid_phase")
    status, body = await server.call("restore", "c1", checkpoint_dir=str(tmp_path), episode_ids=[])
    assert (status, error_code(body)) == (409, "invalid_phase")
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"), seconds=-1)
    assert (status, error_code(body)) == (409, "deadline_exceeded")


async def test_a_prepare_that_misses_its_deadline_lists_capped_blockers_and_keeps_admission_closed(
        make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episodes = [ScriptedEpisode(env, f"r{i:03d}").start() for i in range(150)]
    await asyncio.gather(*(e.in_step.wait() for e in episodes))
    reply = await server.ok("prepare", "c1", seconds=0.3)
    assert reply["phase"] == "preparing"
    report = reply["report"]
    assert report["blocker_count"] == 150 and len(report["blockers"]) == 100
    assert report["blockers"] == sorted(report["blockers"]) == [f"r{i:03d}" for i in range(100)]
    with pytest.raises(ProtocolError) as refused:
        async with env.episode(EpisodeId(rollout_id="late"), {"t": 1}):
            pass
    assert refused.value.code.value == "checkpoint_parked"
    await server.ok("resume", "c1")
    for e in episodes:
        e.release(3)
    await asyncio.gather(*(e.task_handle for e in episodes if e.task_handle))


# -- lease --------------------------------------------------------------------------------------

async def test_an_expired_lease_resumes_the_participant_and_fences_the_id(make_server: Factory,
                                                                         tmp_path: Path) -> None:
    server = await make_server(lease_grace_seconds=0.3)
    await server.ok("prepare", "c1", seconds=0.1)
    for _ in range(50):
        if await server.phase() == "idle":
            break
        await asyncio.sleep(0.05)
    assert await server.phase() == "idle"
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"))
    assert (status, error_code(body)) == (409, "stale_checkpoint")


async def test_renew_keeps_a_slow_controller_in_charge(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server(lease_grace_seconds=0.3)
    await server.ok("prepare", "c1", seconds=0.1)
    for _ in range(6):
        await asyncio.sleep(0.1)
        renewed = await server.ok("renew", "c1", seconds=0.1)
        assert renewed["lease_expires_at"] > 0
    assert await server.phase() == "prepared"
    assert (await server.ok("commit", "c1", checkpoint_dir=str(tmp_path / "ck")))["phase"] == "committed"


async def test_the_lease_retries_a_reopen_that_failed(make_server: Factory) -> None:
    env = FaultyEnvironment()
    server = await make_server(env, lease_grace_seconds=0.2, lease_retry_seconds=0.2)
    await server.ok("prepare", "c1", seconds=0.05)
    env.fail_open = 1
    for _ in range(60):
        if await server.phase() == "idle":
            break
        await asyncio.sleep(0.05)
    assert await server.phase() == "idle" and env.opens >= 2


# -- commit -------------------------------------------------------------------------------------

async def parked(server: ControlServer, names: list[str], *, checkpoint_id: str = "c1") -> list[ScriptedEpisode]:
    """Episodes inside their first step; a prepare closes, each step completes and parks at its
    boundary (turn 1), and the prepare answers ``prepared``."""
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episodes = [ScriptedEpisode(env, n).start() for n in names]
    for e in episodes:
        await e.in_step.wait()
    prepare = asyncio.create_task(server.ok("prepare", checkpoint_id))
    while await server.phase() != "preparing":
        await asyncio.sleep(0.01)
    for e in episodes:
        e.release()
    reply = await prepare
    assert reply["phase"] == "prepared", reply
    return episodes


async def test_commit_and_restore_round_trip_into_a_fresh_participant(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    episodes = await parked(server, ["r1", "r2"])
    ck = str(tmp_path / "ck")
    scope = [{"rollout_id": "r1"}, {"rollout_id": "r2"}]
    committed = await server.ok("commit", "c1", checkpoint_dir=ck, episode_ids=scope)
    assert committed["phase"] == "committed" and committed["episode_ids"] == ["r1", "r2"]
    assert committed["manifest"]["record_count"] == 2
    assert await server.ok("commit", "c1", checkpoint_dir=ck, episode_ids=scope[::-1]) == committed
    status, body = await server.call("commit", "c1", checkpoint_dir=ck + "-other", episode_ids=scope)
    assert (status, error_code(body)) == (409, "checkpoint_conflict")
    await server.ok("resume", "c1")
    for e in episodes:
        e.release(3)

    fresh_env = EnvironmentParticipant("env-0")
    fresh = await make_server(fresh_env, name="b")
    restored = await fresh.ok("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert restored == {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r1-a1"]}
    _, status = await fresh.status()
    assert status["retired_rollouts"] == 1  # the replaced attempt r1 is refused from now on
    await fresh.ok("resume", "c1")
    with pytest.raises(ProtocolError) as stale:
        async with fresh_env.episode(EpisodeId(rollout_id="r1"), {"task": "r1"}):
            pass
    assert stale.value.code.value == "stale_attempt"
    replacement = ScriptedEpisode(fresh_env, "r1", attempt=1).start()
    await replacement.in_step.wait()
    assert replacement.continuation == {"turn": 1, "log": [1]}
    replacement.release(2)
    assert (await replacement.task_handle) == {"turn": 3, "log": [1, 2, 3]}  # step 1 did not run again
    assert replacement.steps_run == 2


async def test_records_keep_key_order_nan_and_big_integers(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    state = {"z": 1, "a": float("nan"), "m": [2**70, -(2**70), float("inf")], "é": "ü"}
    gate = asyncio.Event()

    async def run() -> None:
        async with env.episode(EpisodeId(rollout_id="r1"), {"t": 1}) as ep:
            async with ep.step("wait"):
                await gate.wait()
            await ep.boundary(state)
    task = asyncio.create_task(run())
    await settle()
    prepare = asyncio.create_task(server.ok("prepare", "c1"))
    while await server.phase() != "preparing":
        await asyncio.sleep(0.01)
    gate.set()
    assert (await prepare)["phase"] == "prepared"
    ck = str(tmp_path / "ck")
    await server.ok("commit", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    await server.ok("resume", "c1")
    await task
    fresh_env = EnvironmentParticipant("env-0")
    fresh = await make_server(fresh_env, name="b")
    await fresh.ok("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    back = fresh_env.restored_pending()
    assert [e.capture_key for e in back] == ["r1-a1"]
    boundary = fresh_env._restored["r1-a1"].boundary
    assert list(boundary) == ["z", "a", "m", "é"] and math.isnan(boundary["a"])
    assert boundary["m"][:2] == [2**70, -(2**70)] and boundary["m"][2] == float("inf")


async def test_a_commit_past_its_deadline_can_be_retried_and_exports_once(make_server: Factory,
                                                                         tmp_path: Path) -> None:
    env = FaultyEnvironment()
    server = await make_server(env)
    await parked(server, ["r1"])
    env.export_gate = asyncio.Event()
    ck = str(tmp_path / "ck")
    status, body = await server.call("commit", "c1", seconds=0.2, checkpoint_dir=ck)
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    retry = asyncio.create_task(server.ok("commit", "c1", checkpoint_dir=ck))
    await asyncio.sleep(0.1)
    env.export_gate.set()
    first = await retry
    assert first["phase"] == "committed" and env.exports == 1
    assert await server.ok("commit", "c1", checkpoint_dir=ck) == first and env.exports == 1


async def test_a_failed_export_is_final_for_its_id(make_server: Factory, tmp_path: Path) -> None:
    env = FaultyEnvironment()
    server = await make_server(env)
    episodes = await parked(server, ["r1"])
    env.fail_export = True
    ck = str(tmp_path / "ck")
    for _ in range(2):
        status, body = await server.call("commit", "c1", checkpoint_dir=ck)
        assert (status, error_code(body)) == (409, "export_failed")
    assert env.exports == 1 and not (tmp_path / "ck").exists()
    await server.ok("resume", "c1")
    env.fail_export = False
    await episodes[0].in_step.wait()
    prepare = asyncio.create_task(server.ok("prepare", "c2"))
    while await server.phase() != "preparing":
        await asyncio.sleep(0.01)
    episodes[0].release()
    assert (await prepare)["phase"] == "prepared"
    committed = await server.ok("commit", "c2", checkpoint_dir=ck)
    assert committed["manifest"]["checkpoint_id"] == "c2"


async def test_a_commit_after_readiness_regressed_is_final_and_writes_nothing(make_server: Factory,
                                                                              tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    await parked(server, ["r1"])
    # A restored replacement may begin while closed; it starts running, so readiness regresses.
    env.steps.begin("intruder")
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"))
    assert (status, error_code(body)) == (409, "export_failed")
    env.steps.end("intruder")
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"))
    assert (status, error_code(body)) == (409, "export_failed")
    assert not (tmp_path / "ck").exists()


async def test_a_scope_naming_a_restart_is_refused(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    gate = asyncio.Event()

    async def restart_episode() -> None:
        async with env.episode(EpisodeId(rollout_id="rs"), {"t": 1}) as ep:
            await ep.mark_restart()
            await gate.wait()
    task = asyncio.create_task(restart_episode())
    await settle()
    reply = await server.ok("prepare", "c1")
    assert reply["report"]["restarts"] == ["rs"] and reply["phase"] == "prepared"
    status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"),
                                     episode_ids=[{"rollout_id": "rs"}])
    assert (status, error_code(body)) == (409, "restart_in_scope")
    committed = await server.ok("commit", "c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=[])
    assert committed["episode_ids"] == []
    await server.ok("resume", "c1")
    gate.set()
    await task


async def test_a_commit_deletes_unscoped_restored_state_without_fencing_it(make_server: Factory,
                                                                           tmp_path: Path) -> None:
    server = await make_server()
    await parked(server, ["r1", "r2"])
    ck = str(tmp_path / "ck")
    await server.ok("commit", "c1", checkpoint_dir=ck)
    await server.ok("resume", "c1")
    env = EnvironmentParticipant("env-0")
    fresh = await make_server(env, name="b")
    await fresh.ok("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}, {"rollout_id": "r2"}])
    await fresh.ok("resume", "c1")
    assert sorted(e.capture_key for e in env.restored_pending()) == ["r1-a1", "r2-a1"]
    await fresh.ok("prepare", "c2")
    committed = await fresh.ok("commit", "c2", checkpoint_dir=str(tmp_path / "ck2"),
                               episode_ids=[{"rollout_id": "r1", "attempt": 1}])
    assert committed["episode_ids"] == ["r1-a1"]
    assert [e.capture_key for e in env.restored_pending()] == ["r1-a1"]
    await fresh.ok("resume", "c2")
    # r2-a1 was deleted, not retired: the controller may still start it over as that attempt.
    replacement = ScriptedEpisode(env, "r2", attempt=1).start()
    await replacement.in_step.wait()
    assert replacement.continuation is None
    replacement.release(3)
    await replacement.task_handle  # type: ignore[misc]


# -- restore ------------------------------------------------------------------------------------

async def test_a_tampered_checkpoint_is_a_422_with_nothing_installed_and_admission_open(
        make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    await parked(server, ["r1"])
    ck = tmp_path / "ck"
    manifest = (await server.ok("commit", "c1", checkpoint_dir=str(ck)))["manifest"]
    await server.ok("resume", "c1")
    records = ck / "gym" / "environment" / "env-0" / manifest["records_file"]
    tampered = records.read_bytes().replace(b"turn", b"tUrn", 1)
    assert tampered != records.read_bytes()
    records.write_bytes(tampered)
    env = EnvironmentParticipant("env-0")
    fresh = await make_server(env, name="b")
    status, body = await fresh.call("restore", "c1", checkpoint_dir=str(ck), episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (422, "invalid_checkpoint_state")
    _, st = await fresh.status()
    assert st["phase"] == "idle" and env.restored_pending() == []
    ScriptedEpisode(env, "other").start()
    await settle()
    assert "other" in env.steps  # admission open


async def test_restore_needs_a_fresh_participant(make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    ScriptedEpisode(env, "live").start()
    await settle()
    status, body = await server.call("restore", "c1", checkpoint_dir=str(tmp_path), episode_ids=[])
    assert (status, error_code(body)) == (409, "invalid_phase")


# -- retire and forget --------------------------------------------------------------------------

async def test_retire_marks_stops_then_replies_and_only_forget_lifts_the_mark(make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episode = ScriptedEpisode(env, "r1").start()
    await episode.in_step.wait()
    reply = await server.ok("retire", "any", episode_ids=[{"rollout_id": "r1"}])
    assert reply == {"retired_count": 1}
    assert episode.task_handle is not None and episode.task_handle.done() and "r1" not in env.steps
    _, st = await server.status()
    assert st["retired_rollouts"] == 1
    with pytest.raises(ProtocolError) as stale:
        async with env.episode(EpisodeId(rollout_id="r1"), {"task": "r1"}):
            pass
    assert stale.value.code.value == "stale_attempt"
    ScriptedEpisode(env, "r1", attempt=1).start()  # a later attempt is not refused
    await settle()
    assert "r1-a1" in env.steps
    assert await server.ok("forget", "any", rollout_ids=["r1", "r1", "zz"]) == {"forgotten_count": 2}
    _, st = await server.status()
    assert st["retired_rollouts"] == 0


async def test_a_retire_cut_short_keeps_the_mark_and_the_episode_tracked(make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    cancelled = 0
    release = asyncio.Event()

    async def stubborn() -> None:
        nonlocal cancelled
        async with env.episode(EpisodeId(rollout_id="r1"), {"t": 1}):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled += 1
                await release.wait()  # cleanup that outlives the retire's deadline
                raise
    task = asyncio.create_task(stubborn())
    await settle()
    status, body = await server.call("retire", "x", seconds=0.2, episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    assert "r1" in env.steps and env.steps.blocker_count() == 1 and cancelled == 1
    _, st = await server.status()
    assert st["retired_rollouts"] == 1
    retry = asyncio.create_task(server.ok("retire", "x", episode_ids=[{"rollout_id": "r1"}]))
    await asyncio.sleep(0.1)
    assert not retry.done()
    release.set()
    assert await retry == {"retired_count": 1}
    assert cancelled == 1 and task.done() and "r1" not in env.steps


async def test_marks_survive_a_new_control_plane_on_the_same_state_dir(make_server: Factory) -> None:
    first = await make_server(name="same")
    await first.ok("retire", "x", episode_ids=[{"rollout_id": "r1", "attempt": 2}])
    await first.stop()
    env = EnvironmentParticipant("env-0")
    again = await make_server(env, name="same")
    _, st = await again.status()
    assert st["retired_rollouts"] == 1
    with pytest.raises(ProtocolError):
        async with env.episode(EpisodeId(rollout_id="r1", attempt=2), {"t": 1}):
            pass


async def test_a_replay_step_in_flight_does_not_block_and_is_exported_at_the_previous_boundary(
        make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    episode = ScriptedEpisode(env, "r1", mode="replay").start()
    await episode.in_step.wait()
    episode.release()  # step 1 completes: boundary turn 1
    await settle()
    await episode.in_step.wait()  # inside step 2 (replay), which the checkpoint does not wait for
    assert (await server.ok("prepare", "c1"))["phase"] == "prepared"
    ck = str(tmp_path / "ck")
    assert (await server.ok("commit", "c1", checkpoint_dir=ck))["episode_ids"] == ["r1"]
    await server.ok("resume", "c1")
    episode.release(2)
    await episode.task_handle  # type: ignore[misc]
    fresh_env = EnvironmentParticipant("env-0")
    fresh = await make_server(fresh_env, name="b")
    await fresh.ok("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    await fresh.ok("resume", "c1")
    replacement = ScriptedEpisode(fresh_env, "r1", attempt=1, mode="replay").start()
    await replacement.in_step.wait()
    assert replacement.continuation == {"turn": 1, "log": [1]}  # step 2 runs again


async def test_a_restored_record_that_fails_validation_is_a_422_naming_it_and_installs_nothing(
        make_server: Factory, tmp_path: Path) -> None:
    from workers.participant.storage import write_records
    ck = tmp_path / "ck"
    good = {"episode_id": {"rollout_id": "ok", "attempt": 0}, "task_digest": "0" * 64, "boundary": {"turn": 1}}
    bad = {"episode_id": {"rollout_id": "bad", "attempt": 0}, "task_digest": "nope", "boundary": {"turn": 1}}
    write_records(ck, "environment", "env-0", "c1", [("ok", good), ("bad", bad)])
    env = EnvironmentParticipant("env-0")
    server = await make_server(env)
    scope = [{"rollout_id": "ok"}, {"rollout_id": "bad"}]
    status, body = await server.call("restore", "c1", checkpoint_dir=str(ck), episode_ids=scope)
    assert (status, error_code(body)) == (422, "invalid_checkpoint_state") and "'bad'" in body["error"]["detail"]
    assert env.restored_pending() == [] and await server.phase() == "idle"
    # Only in-scope records are validated: without 'bad' in scope the same file restores.
    restored = await server.ok("restore", "c2", checkpoint_dir=str(ck), episode_ids=[{"rollout_id": "ok"}])
    assert restored["restored"] == ["ok-a1"] and restored["source_checkpoint_id"] == "c1"


async def test_a_restore_whose_close_fails_reopens_and_a_failed_reopen_is_retried_by_resume(
        make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    await parked(server, ["r1"])
    ck = str(tmp_path / "ck")
    await server.ok("commit", "c1", checkpoint_dir=ck)
    await server.ok("resume", "c1")
    env = FaultyEnvironment()
    fresh = await make_server(env, name="b")
    env.fail_close = 1
    status, _ = await fresh.call("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert status == 500 and env.opens == 1 and not env.steps.closed  # admission reopened
    assert env.restored_pending() == []
    env.fail_close, env.fail_open = 1, 1
    status, _ = await fresh.call("restore", "c2", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert status == 500 and env.steps.closed  # the reopen failed too: it stays pending
    status, body = await fresh.call("restore", "c3", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "invalid_phase")
    assert await fresh.ok("resume", "c2") == {"phase": "idle", "idempotent": True}
    assert not env.steps.closed and env.opens == 3  # the resume retried the pending reopen
    restored = await fresh.ok("restore", "c3", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert restored["restored"] == ["r1-a1"]


async def test_a_retire_after_a_timed_out_restore_waits_for_its_install(make_server: Factory,
                                                                      tmp_path: Path) -> None:
    server = await make_server()
    await parked(server, ["r1"])
    ck = str(tmp_path / "ck")
    await server.ok("commit", "c1", checkpoint_dir=ck)
    await server.ok("resume", "c1")

    class SlowInstall(EnvironmentParticipant):
        """Injected fault: an install that outlives its restore's deadline."""
        gate = asyncio.Event()

        async def install(self, records: Any, scope: Any) -> None:
            await self.gate.wait()
            await super().install(records, scope)
    env = SlowInstall("env-0")
    fresh = await make_server(env, name="b")
    status, body = await fresh.call("restore", "c1", seconds=0.3, checkpoint_dir=ck,
                                    episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    assert env.steps.closed  # admission stays closed while the install runs
    retire = asyncio.create_task(fresh.ok("retire", "c1", episode_ids=[{"rollout_id": "r1", "attempt": 1}]))
    await asyncio.sleep(0.1)
    assert not retire.done()
    env.gate.set()
    assert await retire == {"retired_count": 1}
    assert env.restored_pending() == []  # the retire freed what the install put in
    await settle()
    assert not env.steps.closed  # admission reopened once the install finished


# -- regressions found in review ----------------------------------------------------------------

async def test_a_retry_of_a_cut_short_retire_frees_an_episode_whose_task_ended_meanwhile(
        make_server: Factory) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    release = asyncio.Event()

    async def stubborn() -> None:
        async with env.episode(EpisodeId(rollout_id="r1"), {"t": 1}):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await release.wait()
                raise
    task = asyncio.create_task(stubborn())
    await settle()
    status, _ = await server.call("retire", "x", seconds=0.2, episode_ids=[{"rollout_id": "r1"}])
    assert status == 409
    release.set()
    with pytest.raises(ProtocolError) as ended:  # a retired episode ends with a typed error
        await task
    assert ended.value.code is ErrorCode.STALE_ATTEMPT
    assert "r1" in env.steps  # ended, but no retire has waited for it yet: still tracked
    assert await server.ok("retire", "x", episode_ids=[{"rollout_id": "r1"}]) == {"retired_count": 1}
    assert "r1" not in env.steps and env.steps.blocker_count() == 0
    assert (await server.ok("prepare", "c1"))["phase"] == "prepared"


async def test_a_commit_whose_export_a_resume_cancels_gets_stale_checkpoint(make_server: Factory,
                                                                            tmp_path: Path) -> None:
    env = FaultyEnvironment()
    server = await make_server(env)
    await parked(server, ["r1"])
    env.export_gate = asyncio.Event()
    commit = asyncio.create_task(server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck")))
    while env.exports == 0:
        await asyncio.sleep(0.01)
    await server.ok("resume", "c1")
    status, body = await commit
    assert (status, error_code(body)) == (409, "stale_checkpoint")
    assert not (tmp_path / "ck").exists()


class GatedInstall(EnvironmentParticipant):
    """Injected fault: an install that waits for the test (and may fail) — outliving its restore."""

    def __init__(self, instance: str = "env-0") -> None:
        super().__init__(instance)
        self.gate = asyncio.Event()
        self.fail = False

    async def install(self, records: Any, scope: Any) -> None:
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("injected install failure")
        await super().install(records, scope)


async def committed_checkpoint(make_server: Factory, tmp_path: Path, names: list[str]) -> str:
    server = await make_server(name="source")
    await parked(server, names)
    ck = str(tmp_path / "ck")
    await server.ok("commit", "c1", checkpoint_dir=ck)
    await server.ok("resume", "c1")
    return ck


async def test_resume_waits_for_an_install_that_outlived_its_restore(make_server: Factory, tmp_path: Path) -> None:
    ck = await committed_checkpoint(make_server, tmp_path, ["r1"])
    env = GatedInstall()
    fresh = await make_server(env, name="b")
    status, body = await fresh.call("restore", "c1", seconds=0.2, checkpoint_dir=ck,
                                    episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    resume = asyncio.create_task(fresh.ok("resume", "c1"))
    await asyncio.sleep(0.1)
    assert not resume.done()
    env.gate.set()
    assert await resume == {"phase": "idle", "idempotent": True}
    assert not env.steps.closed and [e.capture_key for e in env.restored_pending()] == ["r1-a1"]


async def test_waiting_for_a_failed_install_does_not_fail_the_waiter(make_server: Factory, tmp_path: Path) -> None:
    ck = await committed_checkpoint(make_server, tmp_path, ["r1"])
    env = GatedInstall()
    env.fail = True
    fresh = await make_server(env, name="b")
    status, _ = await fresh.call("restore", "c1", seconds=0.2, checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert status == 409
    retire = asyncio.create_task(fresh.call("retire", "c1", episode_ids=[{"rollout_id": "r1", "attempt": 1}]))
    await asyncio.sleep(0.05)
    env.gate.set()
    assert await retire == (200, {"retired_count": 1})


async def test_overlapping_restores_are_refused(make_server: Factory, tmp_path: Path) -> None:
    ck = await committed_checkpoint(make_server, tmp_path, ["r1"])
    env = GatedInstall()
    fresh = await make_server(env, name="b")
    first = asyncio.create_task(fresh.call("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}]))
    await asyncio.sleep(0.1)
    status, body = await fresh.call("restore", "c2", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "checkpoint_conflict")
    env.gate.set()
    assert (await first)[0] == 200
    status, body = await fresh.call("restore", "c1", checkpoint_dir=ck, episode_ids=[])
    assert (status, error_code(body)) == (409, "checkpoint_conflict")  # completed with another scope


async def test_a_restore_refused_for_live_work_marks_nothing_and_a_late_one_still_marks(
        make_server: Factory, tmp_path: Path) -> None:
    server = await make_server()
    env = server.participant
    assert isinstance(env, EnvironmentParticipant)
    ScriptedEpisode(env, "live").start()
    await settle()
    status, _ = await server.call("restore", "c1", checkpoint_dir=str(tmp_path), episode_ids=[{"rollout_id": "r1"}])
    assert status == 409
    assert (await server.status())[1]["retired_rollouts"] == 0
    fresh = await make_server(EnvironmentParticipant("env-0"), name="b")
    status, body = await fresh.call("restore", "c1", seconds=-1, checkpoint_dir=str(tmp_path),
                                    episode_ids=[{"rollout_id": "r1"}])
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    assert (await fresh.status())[1]["retired_rollouts"] == 1  # marked even past the deadline


async def test_a_resume_that_runs_out_of_time_keeps_the_phase_and_succeeds_on_retry(
        make_server: Factory, tmp_path: Path) -> None:
    ck = await committed_checkpoint(make_server, tmp_path, ["r1", "r2"])

    class SlowDelete(EnvironmentParticipant):
        """Injected fault: deleting unscoped restored state takes until the test says."""
        gate = asyncio.Event()

        async def delete_restored(self, episode: EpisodeId) -> None:
            await self.gate.wait()
            await super().delete_restored(episode)
    env = SlowDelete("env-0")
    fresh = await make_server(env, name="b")
    await fresh.ok("restore", "c1", checkpoint_dir=ck, episode_ids=[{"rollout_id": "r1"}, {"rollout_id": "r2"}])
    await fresh.ok("resume", "c1")
    await fresh.ok("prepare", "c2")
    status, _ = await fresh.call("commit", "c2", seconds=0.2, checkpoint_dir=str(tmp_path / "ck2"),
                                 episode_ids=[{"rollout_id": "r1", "attempt": 1}])
    assert status == 409  # the cleanup of r2-a1 outlives the commit
    status, body = await fresh.call("resume", "c2", seconds=0.2)
    assert (status, error_code(body)) == (409, "deadline_exceeded")
    assert await fresh.phase() == "prepared"
    env.gate.set()
    assert (await fresh.ok("resume", "c2"))["idempotent"] is False
    assert [e.capture_key for e in env.restored_pending()] == ["r1-a1"]


async def test_a_body_over_the_size_limit_is_a_typed_413(make_server: Factory) -> None:
    server = await make_server()
    huge = {"checkpoint_id": "c1", "deadline_ts": 4e9,
            "episode_ids": [{"rollout_id": f"rollout-{i:07d}"} for i in range(40_000)]}
    status, body = await server.post("retire", huge)
    assert (status, error_code(body)) == (413, "request_too_large")


async def test_a_typed_error_from_a_retire_hook_stays_typed_and_the_other_stops_still_run(
        make_server: Factory) -> None:
    stopped: list[str] = []

    class Refusing(EnvironmentParticipant):
        """Injected fault: retiring one rollout fails with a typed error."""

        async def retire(self, episode: EpisodeId) -> None:
            if episode.rollout_id == "bad":
                raise ProtocolError(ErrorCode.INVALID_PHASE, "cannot stop 'bad' now")
            await asyncio.sleep(0.05)
            stopped.append(episode.rollout_id)
    server = await make_server(Refusing("env-0"))
    status, body = await server.call("retire", "x", episode_ids=[{"rollout_id": "bad"}, {"rollout_id": "good"}])
    assert (status, error_code(body)) == (409, "invalid_phase") and stopped == ["good"]


def test_a_participant_must_implement_every_abstract_hook_and_name_a_known_kind() -> None:
    from workers.participant.base import Participant

    class Incomplete(Participant):
        kind = "environment"

        def ready(self) -> bool:
            return True
    with pytest.raises(TypeError, match="abstract"):
        Incomplete("x")  # type: ignore[abstract]

    class Unknown(EnvironmentParticipant):
        kind = "judge"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="kind must be one of"):
        Unknown("x")
