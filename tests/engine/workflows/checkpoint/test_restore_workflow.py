"""The restore workflow through the whole orchestrator, against the four reference participants as
real processes, on both journal backends: a checkpoint taken mid-episode, a SIGKILL of every server
and a restore into fresh ones on new ports continue every episode exactly once (the orchestrator sends
attempt 1 of each to the environment that restored it); a restore refused by
one participant rolls back everywhere and reports the restore error."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine.workflows.checkpoint.restore import (CheckpointNotFound, RestoreController, RestoreSettings, resolve_checkpoint, start_restore)
from engine.runtime.service import Orchestrator
from engine.workflows.checkpoint.rollouts import RolloutController, RolloutSettings
from journal import models
from tests.support.checkpoints import corrupt_manifest
from tests.support.reference_procs import KINDS, ParticipantClient, Procs, Stack, start_stack
from tests.support.workflows import (
    rpc_calls,
    add_rollouts,
    by_rollout,
    closed_executions,
    events,
    run_checkpoint,
    settings,
    state_dirs,
    steps_of,
    table,
    wait_healthy,
    wait_terminal,
)
from workers.participant.storage import participant_dir

pytestmark = pytest.mark.slow

TURNS = 3
TASKS = {f"r{i}": {"prompt": f"restore task {i}", "turns": TURNS} for i in range(3)}


def orchestrator(journal_url: str, stack: Stack, max_in_flight: int | None = None) -> Orchestrator:
    """An orchestrator on ``stack``; with ``max_in_flight``, its rollout controller holds dispatch
    to that bound (0: none; a real controller, configured so)."""
    held = [] if max_in_flight is None else [RolloutController(RolloutSettings(max_in_flight=max_in_flight))]
    return Orchestrator(settings(journal_url, stack, prepare_timeout_s=10), controllers=[
        RestoreController(RestoreSettings(restore_timeout_s=20, resume_timeout_s=10)), *held])


async def start_episodes(c: ParticipantClient, stack: Stack) -> list[asyncio.Task[Any]]:
    """Every task started as attempt 0, staggered, and mid-way when this returns."""
    env = stack.url("environment")

    async def staggered(i: int, rid: str) -> dict[str, Any]:
        await asyncio.sleep(0.12 * i)
        return await c.run(env, rid, TASKS[rid])
    runs = [asyncio.create_task(staggered(i, rid)) for i, rid in enumerate(TASKS)]

    async def all_live() -> bool:
        return bool((await c.status(env))["episodes"] == len(TASKS))
    for _ in range(400):
        if await all_live():
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.35)  # the first ones are into their second turn, the last still in its first
    return runs


async def checkpoint_then_crash(journal_url: str, c: ParticipantClient, stack: Stack, directory: Path
                                ) -> dict[str, dict[str, dict[str, int]]]:
    """Checkpoint ``ck-1`` mid-episode through an orchestrator, then SIGKILL every server.
    Returns the executions the checkpoint holds (see ``closed_executions``)."""
    runs = await start_episodes(c, stack)
    orch = orchestrator(journal_url, stack)
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        await add_rollouts(orch, TASKS)
        held = asyncio.create_task(closed_executions(c, stack, "ck-1"))
        row = await run_checkpoint(orch, stack, "ck-1", directory)
        old = await held
    finally:
        await orch.stop()
    assert row["state"] == "done", row
    stack.kill()
    await asyncio.gather(*runs, return_exceptions=True)
    return old


async def restore(journal_url: str, stack: Stack, directory: Path, restore_id: str, *,
                  max_in_flight: int | None = None) -> tuple[dict[str, Any], Orchestrator]:
    """Restore ``LATEST`` into ``stack`` through a second orchestrator on the same journal (its
    rollout controller bounded to ``max_in_flight`` when given)."""
    checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, str(directory))
    assert checkpoint_id == "ck-1" and sorted(scope) == sorted(TASKS), scope
    orch = orchestrator(journal_url, stack, max_in_flight)
    await orch.start()
    await wait_healthy(orch, stack)  # discovery re-synced the new URLs

    async def start(tx: Any) -> None:
        await start_restore(tx, restore_id, str(directory), checkpoint_id, scope)
    await orch.committer.run(start)
    return await wait_terminal(orch, models.restores, restore_id, ("done", "failed")), orch


async def test_a_restore_after_sigkill_continues_every_episode_exactly_once(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    clean = await start_stack(procs, state_dirs(tmp_path / "clean"))
    expected = dict(zip(TASKS, await asyncio.gather(
        *(c.run(clean.url("environment"), rid, task) for rid, task in TASKS.items()))))
    clean.kill()

    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.2, model_delay=0.05)
    old = await checkpoint_then_crash(journal_url, c, stack, tmp_path / "ckpts")
    assert any("verify" not in steps for steps in old["environment"].values()), "checkpointed mid-episode"

    fresh = await start_stack(procs, dirs)
    assert not {stack.url(k) for k in KINDS} & {fresh.url(k) for k in KINDS}, "new ports"
    row, orch = await restore(journal_url, fresh, tmp_path / "ckpts", "restore-1")
    try:
        trail = [e["to_state"] for e in await events(orch, "restores", "restore-1")]
        # The orchestrator dispatches attempt 1 of each to the environment that restored it; each
        # continues from its boundary, finishes and is forgotten.
        for rid in TASKS:
            await wait_terminal(orch, models.rollouts, rid, ("forgotten",))
        rollouts = await table(orch, models.rollouts)
        histories = {rid: [(e["from_state"], e["to_state"]) for e in await events(orch, "rollouts", rid)]
                     for rid in TASKS}
        calls = [r for r in (await rpc_calls(orch)).values() if r["entity_kind"] == "restores"]
        runs = [r for r in (await rpc_calls(orch)).values() if r["path"] == "/run"]
    finally:
        await orch.stop()
    assert row["state"] == "done" and row["detail"] is None, row
    assert trail == ["restoring", "resuming", "done"]
    assert set(row["timings"]) == {"restoring", "resuming"}
    assert {(r["state"], r["attempt"], r["restored_on"], r["checkpoint_id"]) for r in rollouts.values()} == {
        ("forgotten", 1, "environment-0", "ck-1")}
    assert set(map(tuple, histories.values())) == {(
        (None, "dispatched"), ("dispatched", "pending"), ("pending", "dispatched"), ("dispatched", "finished"),
        ("finished", "forgotten"))}, histories
    # One /run each, as the attempt-qualified id of attempt 1, sent once.
    assert sorted((r["body"]["rollout_id"], r["state"], r["repeatable"]) for r in runs) == [
        (f"{rid}-a1", "succeeded", False) for rid in sorted(TASKS)]
    # One restore with the same body for everyone, then one resume each; nothing retired.
    restores = [r for r in calls if r["path"].endswith("/restore")]
    # Encoded once: every restore call references the same stored body, so each sent the same bytes.
    assert len(restores) == 4 and len({r["body_id"] for r in restores}) == 1 and restores[0]["body_id"]
    assert all(r["body"] == restores[0]["body"] for r in restores)
    assert restores[0]["body"]["checkpoint_dir"] == str(tmp_path / "ckpts" / "ck-1")
    assert sorted(r["path"].rsplit("/", 1)[1] for r in calls) == ["restore"] * 4 + ["resume"] * 4
    for kind in KINDS:
        status = await c.status(fresh.url(kind))
        assert (status["phase"], status["checkpoint_id"]) == ("idle", None)
        # The restore's marks of the replaced attempts 0 were lifted by the forget once they finished.
        assert status["retired_rollouts"] == 0, (kind, status)

    for result in (r["result"] for r in rollouts.values()):
        want = expected[result["rollout_id"]]
        assert result["attempt"] == 1
        assert (result["actions"], result["checks"], result["reward"]) == (
            want["actions"], want["checks"], want["reward"])
    new = {kind: (await c.status(fresh.url(kind)))["executions"] for kind in KINDS}
    for kind in KINDS:
        assert by_rollout(old[kind], new[kind]) == {
            rid: Counter(dict.fromkeys(steps_of(kind, TURNS), 1)) for rid in TASKS}, (kind, old[kind], new[kind])
        assert all(key.endswith("-a1") for key in new[kind]), new[kind]


async def test_a_checkpoint_right_after_a_restore_keeps_every_restored_episode_on_every_participant(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """Restored, and checkpointed again before any replacement was sent: the scope names each restored
    episode by its replacement attempt and every participant, the environment included, commits it
    and keeps its restored state; the replacements then continue from their boundaries."""
    c = controller
    clean = await start_stack(procs, state_dirs(tmp_path / "clean"))
    expected = dict(zip(TASKS, await asyncio.gather(
        *(c.run(clean.url("environment"), rid, task) for rid, task in TASKS.items()))))
    clean.kill()
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.2, model_delay=0.05)
    old = await checkpoint_then_crash(journal_url, c, stack, tmp_path / "ckpts")
    fresh = await start_stack(procs, dirs)
    # Dispatch held by an in-flight bound of zero (a real rollout controller, configured so): the
    # second checkpoint comes before any replacement is sent.
    held = orchestrator(journal_url, fresh, max_in_flight=0)
    checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, str(tmp_path / "ckpts"))
    await held.start()
    try:
        await wait_healthy(held, fresh)

        async def start(tx: Any) -> None:
            await start_restore(tx, "restore-1", str(tmp_path / "ckpts"), checkpoint_id, scope)
        await held.committer.run(start)
        assert (await wait_terminal(held, models.restores, "restore-1", ("done", "failed")))["state"] == "done"
        second = await run_checkpoint(held, fresh, "ck-2", tmp_path / "ckpts")
        members = {m["kind"]: m for m in (await table(held, models.checkpoint_members)).values()
                   if m["checkpoint_id"] == "ck-2"}
        waiting = {(r["state"], r["attempt"], r["restored_on"]) for r in (await table(held, models.rollouts)).values()}
    finally:
        await held.stop()
    replacements = sorted(f"{rid}-a1" for rid in TASKS)
    assert second["state"] == "done", second
    assert waiting == {("pending", 1, "environment-0")}, waiting
    published = json.loads((tmp_path / "ckpts" / "ck-2" / "checkpoint.json").read_text())
    assert published["committed_scope"] == published["scope"] == replacements, published["scope"]
    assert published["rollouts"]["continued"] == [{"rollout_id": rid, "attempt": 1} for rid in sorted(TASKS)]
    # The environment exported its restored episodes and, being in scope, kept them.
    assert members["environment"]["episode_ids"] == replacements, members["environment"]
    env = await c.status(fresh.url("environment"))
    assert env["restored_pending"] == len(TASKS), env

    # Dispatch free again: each replacement continues from its boundary and ends as an uncrashed run.
    orch = orchestrator(journal_url, fresh)
    await orch.start()
    try:
        for rid in TASKS:
            await wait_terminal(orch, models.rollouts, rid, ("forgotten",))
        rollouts = await table(orch, models.rollouts)
    finally:
        await orch.stop()
    for row in rollouts.values():
        want = expected[row["id"]]
        assert (row["attempt"], row["result"]["actions"], row["result"]["checks"], row["result"]["reward"]) == (
            1, want["actions"], want["checks"], want["reward"]), row
    new = {kind: (await c.status(fresh.url(kind)))["executions"] for kind in KINDS}
    for kind in KINDS:
        assert by_rollout(old[kind], new[kind]) == {
            rid: Counter(dict.fromkeys(steps_of(kind, TURNS), 1)) for rid in TASKS}, (kind, old[kind], new[kind])
        assert (await c.status(fresh.url(kind)))["retired_rollouts"] == 0, kind


async def test_a_restore_refused_by_one_participant_rolls_back_everywhere(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.2, model_delay=0.05)
    await checkpoint_then_crash(journal_url, c, stack, tmp_path / "ckpts")
    model_files = participant_dir(tmp_path / "ckpts" / "ck-1", "model", "model-0")
    corrupt_manifest(model_files, {}, "not json")

    fresh = await start_stack(procs, dirs)
    # Dispatch held (an in-flight bound of zero) until the rollback has been looked at.
    row, orch = await restore(journal_url, fresh, tmp_path / "ckpts", "restore-2", max_in_flight=0)
    try:
        trail = [e["to_state"] for e in await events(orch, "restores", "restore-2")]
        rollouts = await table(orch, models.rollouts)
        calls = [r for r in (await rpc_calls(orch)).values() if r["entity_kind"] == "restores"]
    finally:
        await orch.stop()
    assert row["state"] == "failed", row
    assert trail == ["restoring", "rolling_back", "failed"]
    assert row["detail"].startswith("restore failed on 1 participant(s): model-0: HTTP 422 invalid_checkpoint_state")
    assert "cleanup" not in row["detail"], row["detail"]
    assert set(row["timings"]) == {"restoring", "rolling_back"}
    # Attempt 1 is retired everywhere: each rollout starts over from its input as attempt 2, anywhere.
    assert {(r["state"], r["attempt"], r["restored_on"]) for r in rollouts.values()} == {("pending", 2, None)}
    assert all("failed: started over from its input as attempt 2" in r["detail"] for r in rollouts.values())

    # The replacement attempts were retired callers first, then everyone resumed (reverse stages).
    kind_of = {fresh.url(k): k for k in KINDS}
    retires = sorted((r for r in calls if r["path"].endswith("/retire")), key=lambda r: r["created_at"])
    assert [kind_of[r["target"]] for r in retires][:2] == ["environment", "agent"]
    assert {kind_of[r["target"]] for r in retires[2:]} == {"model", "resources"}
    assert all(r["state"] == "succeeded" for r in calls if not r["path"].endswith("/restore"))
    assert retires[0]["body"]["episode_ids"] == [{"rollout_id": rid, "attempt": 1} for rid in sorted(TASKS)]
    resumes = sorted((r for r in calls if r["path"].endswith("/resume")), key=lambda r: r["created_at"])
    assert [kind_of[r["target"]] for r in resumes] == ["resources", "agent", "model", "environment"]
    assert max(r["updated_at"] for r in retires) <= min(r["created_at"] for r in resumes)

    for kind in KINDS:
        status = await c.status(fresh.url(kind))
        assert (status["phase"], status["checkpoint_id"]) == ("idle", None), (kind, status)
        assert status["retired_rollouts"] == len(TASKS), (kind, status)
        assert status.get("restored_pending", 0) == 0
    # Nothing live anywhere: the replacement attempts are refused, and admission is open again.
    for rid, task in TASKS.items():
        status_code, reply = await c.post(fresh.url("environment"), "/run",
                                          {"rollout_id": rid, "attempt": 1, "task": task})
        assert (status_code, reply["error"]["code"]) == (409, "stale_attempt"), reply
    fresh_run = await c.run(fresh.url("environment"), "after", {"prompt": "after the rollback", "turns": 1})
    assert fresh_run["attempt"] == 0 and len(fresh_run["actions"]) == 1

    # Dispatch free: attempt 2 of each runs from its input, finishes once and is forgotten.
    orch = orchestrator(journal_url, fresh)
    await orch.start()
    try:
        for rid in TASKS:
            await wait_terminal(orch, models.rollouts, rid, ("forgotten",))
        rollouts = await table(orch, models.rollouts)
    finally:
        await orch.stop()
    assert all(r["result"]["attempt"] == 2 and len(r["result"]["actions"]) == TURNS for r in rollouts.values())
    ran = (await c.status(fresh.url("environment")))["executions"]
    assert all(ran[f"{rid}-a2"] == dict.fromkeys(steps_of("environment", TURNS), 1) for rid in TASKS), ran
    for kind in KINDS:
        assert (await c.status(fresh.url(kind)))["retired_rollouts"] == 0, kind


def test_resolve_checkpoint_names_the_path_of_what_is_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="LATEST"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "LATEST").write_text("ck-9\n")
    with pytest.raises(CheckpointNotFound, match=r"ck-9/checkpoint\.json.*never published") as missing:
        resolve_checkpoint(str(tmp_path))
    assert isinstance(missing.value, ValueError) and missing.value.path == tmp_path / "ck-9" / "checkpoint.json"
    (tmp_path / "ck-9").mkdir()
    (tmp_path / "ck-9" / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointNotFound, match="not JSON"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "ck-9" / "checkpoint.json").write_text(json.dumps({"checkpoint_id": "ck-9", "scope": "r1"}))
    with pytest.raises(CheckpointNotFound, match="scope"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "ck-9" / "checkpoint.json").write_text(json.dumps({"checkpoint_id": "ck-9", "scope": ["r1-a2", "r2"]}))
    assert resolve_checkpoint(str(tmp_path)) == ("ck-9", ["r1-a2", "r2"])
    with pytest.raises(CheckpointNotFound, match="not a valid checkpoint id"):
        resolve_checkpoint(str(tmp_path), "../ck-9")
