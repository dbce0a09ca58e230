"""Rollouts through a crash of everything, on both journal backends, with real processes: rollouts
submitted to a running ``tidelog serve`` are dispatched by it; a checkpoint is taken through its API
while they are mid-episode; then the orchestrator and every participant are SIGKILLed at once. Fresh
participants start on the same state directories, the restore of the published checkpoint is
requested, and a fresh orchestrator restores them and sends each rollout's attempt 1 (``<id>-a1``)
to the environment that restored it, where it continues from its boundary. Every step of every
rollout completed exactly once in the lineage that finished (what the checkpoint kept plus what ran
after the restore), attempt 0's ``/run`` was never sent again, and once every rollout is done and
forgotten no participant holds a retire mark. With resources that save nothing every rollout is a
restart: none is continued, and each runs again from its input as attempt 1 after its lost attempt
was retired everywhere."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.checkpoint.restore import resolve_checkpoint, start_restore
from journal import Journal, audit, models
from tests.engine.workflows.checkpoint.test_api_checkpoints import call
from tests.engine.workflows.checkpoint.test_rollout_dispatch import config, rollouts, run_calls, serve, settled
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, start_stack
from engine.demos.ports import free_port
from tests.support.workflows import (audit_rows, by_rollout, closed_executions, controller, procs,  # noqa: F401
                                     state_dirs, steps_of, until)

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TURNS = 5
TASKS = {f"e{i}": {"prompt": f"crash task {i}", "turns": TURNS} for i in range(5)}


async def test_rollouts_mid_episode_survive_a_crash_of_everything_and_finish_once(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.25, model_delay=0.05)
    ckpts = tmp_path / "ckpts"
    port = free_port()
    cfg = config(journal_url, stack)
    cfg["api"] = {"host": "127.0.0.1", "port": port}
    cfg["checkpoint"] = {**cfg["checkpoint"], "directory": str(ckpts), "prepare_timeout_s": 10}
    base = f"http://127.0.0.1:{port}"
    first = serve(cfg, tmp_path)
    journal = Journal.open(journal_url)
    try:
        async def leading() -> bool:
            try:
                status, body = await call("GET", f"{base}/readyz")
            except OSError:
                return False
            return status == 200 and bool(body.get("leader"))
        await until(leading, 60)

        async def healthy() -> bool:
            status, body = await call("GET", f"{base}/v1/participants")
            return status == 200 and sum(p["health"] == "healthy" for p in body["participants"]) == 4
        await until(healthy, 60)
        status, body = await call("POST", f"{base}/v1/rollouts", headers=AUTH, json={"tasks": [
            {"rollout_id": rid, "input": task} for rid, task in TASKS.items()]})
        assert status == 201, body

        async def mid_episode() -> bool:
            return (await c.status(stack.url("environment")))["episodes"] == len(TASKS)
        await until(mid_episode, 60)
        await asyncio.sleep(0.4)
        held = asyncio.create_task(closed_executions(c, stack, "ck-1"))
        status, body = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={"checkpoint_id": "ck-1"})
        assert status == 202, body
        old = await held

        async def published() -> bool:
            _, row = await call("GET", f"{base}/v1/checkpoints/ck-1")
            return row.get("state") == "done"
        await until(published, 60)
        # Everything dies at once, mid-episode (the checkpoint resumed them).
        first.send_signal(signal.SIGKILL)
        stack.kill()
        first.wait()
        before = await rollouts(journal)
        checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, str(ckpts))
        assert checkpoint_id == "ck-1" and sorted(scope) == sorted(TASKS), scope
        # The restore is requested before the fresh orchestrator leads, as an operator's recovery does.
        async with journal.write() as tx:
            await start_restore(tx, "restore-1", str(ckpts), checkpoint_id, scope)
    finally:
        if first.poll() is None:
            first.kill()
        await journal.dispose()
    assert any("verify" not in steps for steps in old["environment"].values()), "checkpointed mid-episode"
    assert {(r["state"], r["attempt"]) for r in before.values()} == {("dispatched", 0)}, before

    fresh = await start_stack(procs, dirs)
    orch = Orchestrator(Settings.model_validate({**config(journal_url, fresh), "checkpoint": cfg["checkpoint"]}))
    await orch.start()
    try:
        rows = await settled(orch.journal, list(TASKS))
        async with orch.journal.read() as conn:
            restored = (await conn.execute(sa.select(models.restores.c.state))).scalars().all()
            trail = await audit.query_events(conn, audit.EventFilter(entity_kind="rollouts", limit=audit.MAX_PAGE))
        calls = await run_calls(orch.journal)
        marks = {k: (await c.status(fresh.url(k)))["retired_rollouts"] for k in KINDS}
        new = {k: (await c.status(fresh.url(k)))["executions"] for k in KINDS}
        assert await audit.verify(orch.journal) == []
        assert await audit_rows(orch.journal, "rollouts-not-done-once") == []
    finally:
        await orch.stop()
    assert restored == ["done"]
    assert {k: (r["state"], r["attempt"], r["restored_on"]) for k, r in rows.items()} == {
        k: ("forgotten", 1, "environment-0") for k in TASKS}
    # Attempt 0's /run was in flight when the orchestrator died: never sent again. Attempt 1's went once.
    assert Counter((call["body"]["rollout_id"], call["state"]) for call in calls) == Counter(
        {**{(k, "ambiguous"): 1 for k in TASKS}, **{(f"{k}-a1", "succeeded"): 1 for k in TASKS}}), calls
    for k in TASKS:
        history = [(e["from_state"], e["to_state"]) for e in trail if e["entity_id"] == k]
        # Found ambiguous after the crash; its rerun (if already requested) was overtaken by the restore,
        # which continued it as attempt 1; then dispatched once, finished, forgotten.
        assert history[:3] == [(None, "pending"), ("pending", "dispatched"), ("dispatched", "ambiguous")], history
        assert history[-4][0] in ("ambiguous", "retiring") and history[-4][1] == "pending", history
        assert history[-3:] == [("pending", "dispatched"), ("dispatched", "finished"), ("finished", "forgotten")]
    # Every step of every rollout completed exactly once in the lineage that finished.
    for kind in KINDS:
        assert by_rollout(old[kind], new[kind]) == {
            rid: Counter(dict.fromkeys(steps_of(kind, TURNS), 1)) for rid in TASKS}, (kind, old[kind], new[kind])
        assert all(key.endswith("-a1") for key in new[kind]), new[kind]
    assert marks == {k: 0 for k in KINDS}, marks
    assert all(r["result"]["attempt"] == 1 and len(r["result"]["actions"]) == TURNS for r in rows.values())


async def test_restarts_a_checkpoint_could_not_save_run_again_from_their_input_after_a_crash(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """Resources that save nothing (``restart_only``) make every rollout a restart: the checkpoint's
    scope leaves them out and its manifest lists them. After a crash of everything and a restore,
    each restart's lost attempt is retired everywhere and the rollout runs again from its input as
    the next attempt."""
    c = controller
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.25, resources_mode="restart_only")
    ckpts = tmp_path / "ckpts"
    port = free_port()
    cfg = config(journal_url, stack)
    cfg["api"] = {"host": "127.0.0.1", "port": port}
    cfg["checkpoint"] = {**cfg["checkpoint"], "directory": str(ckpts), "prepare_timeout_s": 10}
    base = f"http://127.0.0.1:{port}"
    first = serve(cfg, tmp_path)
    journal = Journal.open(journal_url)
    try:
        async def leading() -> bool:
            try:
                status, body = await call("GET", f"{base}/readyz")
            except OSError:
                return False
            return status == 200 and bool(body.get("leader"))
        await until(leading, 60)

        async def healthy() -> bool:
            status, body = await call("GET", f"{base}/v1/participants")
            return status == 200 and sum(p["health"] == "healthy" for p in body["participants"]) == 4
        await until(healthy, 60)
        status, body = await call("POST", f"{base}/v1/rollouts", headers=AUTH, json={"tasks": [
            {"rollout_id": rid, "input": task} for rid, task in TASKS.items()]})
        assert status == 201, body

        async def mid_episode() -> bool:
            return (await c.status(stack.url("environment")))["episodes"] == len(TASKS)
        await until(mid_episode, 60)
        status, body = await call("POST", f"{base}/v1/checkpoints", headers=AUTH, json={"checkpoint_id": "ck-r"})
        assert status == 202, body

        async def published() -> bool:
            _, row = await call("GET", f"{base}/v1/checkpoints/ck-r")
            return row.get("state") == "done"
        await until(published, 60)
        first.send_signal(signal.SIGKILL)
        stack.kill()
        first.wait()
        manifest = json.loads((ckpts / "ck-r" / "checkpoint.json").read_text())
        checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, str(ckpts))
        async with journal.write() as tx:
            await start_restore(tx, "restore-r", str(ckpts), checkpoint_id, scope)
    finally:
        if first.poll() is None:
            first.kill()
        await journal.dispose()
    # Nothing of them was saved: none is continued, every one is a restart.
    assert scope == [] and manifest["rollouts"]["continued"] == [], manifest
    assert manifest["restarts"] == sorted(TASKS), manifest["restarts"]

    fresh = await start_stack(procs, dirs, resources_mode="restart_only")
    orch = Orchestrator(Settings.model_validate({**config(journal_url, fresh), "checkpoint": cfg["checkpoint"]}))
    await orch.start()
    try:
        rows = await settled(orch.journal, list(TASKS))
        async with orch.journal.read() as conn:
            restored = (await conn.execute(sa.select(models.restores.c.state))).scalars().all()
            trail = await audit.query_events(conn, audit.EventFilter(entity_kind="rollouts", limit=audit.MAX_PAGE))
        calls = await run_calls(orch.journal)
        marks = {k: (await c.status(fresh.url(k)))["retired_rollouts"] for k in KINDS}
        new = (await c.status(fresh.url("environment")))["executions"]
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()
    assert restored == ["done"]
    assert {k: (r["state"], r["attempt"], r["restored_on"]) for k, r in rows.items()} == {
        k: ("forgotten", 1, None) for k in TASKS}
    for k in TASKS:
        history = [(e["from_state"], e["to_state"]) for e in trail if e["entity_id"] == k]
        # The lost attempt 0 was retired everywhere before attempt 1 was sent. (On a mismatch the
        # message carries each step's reason and the rollout's /run calls with their errors.)
        assert history == [(None, "pending"), ("pending", "dispatched"), ("dispatched", "ambiguous"),
                           ("ambiguous", "retiring"), ("retiring", "retired"), ("retired", "pending"),
                           ("pending", "dispatched"), ("dispatched", "finished"), ("finished", "forgotten")], (
            [(e["from_state"], e["to_state"], e["reason"]) for e in trail if e["entity_id"] == k],
            [(c["body"]["rollout_id"], c["state"], c["error"], c["attempts"]) for c in calls
             if c["body"]["rollout_id"].split("-a")[0] == k])
        # Attempt 1 ran from its input: every step of the episode, each once.
        assert new[f"{k}-a1"] == dict.fromkeys(steps_of("environment", TURNS), 1), new
    assert Counter((call["body"]["rollout_id"], call["state"]) for call in calls) == Counter(
        {**{(k, "ambiguous"): 1 for k in TASKS}, **{(f"{k}-a1", "succeeded"): 1 for k in TASKS}}), calls
    assert marks == {k: 0 for k in KINDS}, marks
