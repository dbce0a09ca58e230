"""Crash points of the checkpoint, restore, retire and forget workflows: SIGKILL the orchestrator right
after every named commit of the workflow's rows that a run passes through (enumerated from the
machines, not picked by hand), restart it, and check the run ends as an uncrashed one does.

- checkpoint (after a retire of a third episode that finished before it started): done and
  published, every participant idle, every live episode finishing with every step completed exactly
  once; the scope holds the live episodes and not the retired one, and the journal alone shows no
  commit including an attempt retired before it (docs/audit.md's query); afterwards every published
  checkpoint (the uncrashed run's and every crashed one's) restores into fresh participants;
- restore (into fresh participants, of a checkpoint published by an uncrashed run): done, and every
  continued episode finishes from its checkpointed boundary — no step run again or lost;
- a failed restore (the model refuses its manifest): failed with that refusal, every participant
  idle, the scoped rollouts started over as attempt 2;
- retire: done, the retired attempt refused (``stale_attempt``) everywhere; forget: done, accepted again.

And a publish restarted past the commit deadline renews every member's lease first.

The reference participants are real processes that live through every orchestrator crash (a restore
needs fresh ones, started per run); each run uses a fresh journal.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.checkpoint.restore import resolve_checkpoint, start_restore
from engine.runtime.crash import ENV, hook_names
from engine.demos.checkpoint import all_steps, checkpointed_steps
from engine.runtime.service import Orchestrator
from journal import Journal, StateMachine, audit, machines, models
from tests.engine.runtime.test_crash_recovery import new_journal_url
from tests.support.checkpoints import corrupt_manifest
from tests.support.reference_procs import ParticipantClient, Procs, Stack, start_stack
from tests.support.workflows import audit_rows, rpc_calls, settings, wait_healthy, wait_terminal
from tests.support.zygote import shared
from workers.participant.storage import participant_dir
from workers.protocol import EpisodeId

KINDS = ("environment", "model", "agent", "resources")
#: The checkpoint runs' live episodes (about 3 s): still running when the checkpoint prepares, even
#: after a crash before the prepare and the worker's restart, so every scope holds them.
LIVE_TURNS = 16
pytestmark = pytest.mark.slow


async def run_worker(journal_url: str, stack: Stack, workflow: str, args: list[str], crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if crash_at is not None:
        env[ENV] = crash_at
    named = [f"{kind}-0={stack.url(kind)}" for kind in KINDS]
    code, _, err = await shared().communicate(
        "tests.support.workflow_worker", [journal_url, workflow, *args, "--", *named], env=env, timeout=120)
    if code not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {code}:\n{err.decode()[-3000:]}")
    return code


async def crashed_then_recovered(journal_url: str, stack: Stack, workflow: str, args: list[str],
                                 crash_at: str | None) -> list[int]:
    codes = [await run_worker(journal_url, stack, workflow, args, crash_at)]
    if codes[-1] != 0:
        codes.append(await run_worker(journal_url, stack, workflow, args, None))
    return codes


async def edges_of(journal_url: str, kinds: list[str], table: sa.Table, entity_id: str) -> tuple[set[str], Any]:
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            e = models.events
            edges = {f"{k}:created:{b}" if a is None else f"{k}:{a}->{b}" for k, a, b in (await conn.execute(
                sa.select(e.c.entity_kind, e.c.from_state, e.c.to_state).where(e.c.entity_kind.in_(kinds)))).all()}
            row = (await conn.execute(sa.select(table).where(table.c.id == entity_id))).one()
        assert await audit.verify(journal) == []
        return edges, row
    finally:
        await journal.dispose()


def targets(reached: set[str], machine_list: list[StateMachine]) -> list[str]:
    every = hook_names(machine_list)
    return [h for h in every if h in reached]


async def run_and_check(backend: str, request: pytest.FixtureRequest, path: Path, stack: Stack,
                        workflow: str, args: list[str], crash_at: str | None, kinds: list[str], table: sa.Table
                        ) -> tuple[set[str], Any, list[int]]:
    url = await new_journal_url(backend, request, path)
    codes = await crashed_then_recovered(url, stack, workflow, args, crash_at)
    edges, row = await edges_of(url, kinds, table, args[0])
    return edges, row, codes


# -- checkpoint -------------------------------------------------------------------------------------

async def checkpoint_run(backend: str, request: pytest.FixtureRequest, tmp_path: Path, stack: Stack,
                         controller: ParticipantClient, tag: str, crash_at: str | None) -> tuple[set[str], list[int]]:
    """Checkpoint ``ck-<tag>`` of two live episodes, after a retire of a third (``<tag>-x``) finished.

    The worker retires ``<tag>-x`` (attempt 0) as ``pre-ck-<tag>`` and starts the checkpoint once that
    retirement is done; the live episodes start once the retire has reached the environment (the
    retired run answers ``stale_attempt``), so they are still running when the checkpoint prepares.
    """
    env = stack.url("environment")
    before = {kind: (await controller.status(stack.url(kind)))["executions"] for kind in KINDS}
    # Long enough (200 steps of 0.1 s) to be still running when the worker retires it.
    retired = asyncio.create_task(controller.post(env, "/run", {"rollout_id": f"{tag}-x",
                                                                "task": {"prompt": f"{tag} x", "turns": 100}}))
    directory = tmp_path / f"ck-{tag}"
    url = await new_journal_url(backend, request, tmp_path / f"{tag}.db")
    worker = asyncio.create_task(crashed_then_recovered(url, stack, "checkpoint",
                                                        [f"ck-{tag}", str(directory), f"{tag}-x",
                                                         f"rollouts={tag}-r0,{tag}-r1"], crash_at))
    await asyncio.wait({retired, worker}, return_when=asyncio.FIRST_COMPLETED)
    if not retired.done():
        worker.result()  # a worker that failed says why
        await asyncio.wait({retired}, timeout=10)  # else the retire's reply may still be on its way
        if not retired.done():
            retired.cancel()
            raise AssertionError(f"{tag}-x still running after its retirement and the checkpoint ({crash_at})")
    code, reply = await retired
    assert code == 409 and reply["error"]["code"] == "stale_attempt", (crash_at, code, reply)
    runs = [asyncio.create_task(controller.run(env, f"{tag}-r{i}", {"prompt": f"{tag} {i}", "turns": LIVE_TURNS}))
            for i in range(2)]
    codes = await worker
    edges, row = await edges_of(url, ["checkpoints", "checkpoint_members"], models.checkpoints, f"ck-{tag}")
    results = await asyncio.gather(*runs)
    assert row.state == "done", (crash_at, row.state, row.detail)
    assert (directory / "LATEST").read_text().strip() == f"ck-{tag}"
    published = json.loads((directory / f"ck-{tag}" / "checkpoint.json").read_text())
    assert set(published["members"]) == {f"{k}-0" for k in KINDS}
    assert published["scope"] == row.scope
    # No commit includes an attempt retired before it: not the retired episode, by the journal alone.
    assert f"{tag}-x" not in row.scope and row.scope == [f"{tag}-r0", f"{tag}-r1"], (crash_at, row.scope)
    journal = Journal.open(url)
    try:
        retirement = await journal_row(journal, models.retirements, f"pre-ck-{tag}")
        assert retirement.state == "done" and retirement.episode_ids == [{"rollout_id": f"{tag}-x", "attempt": 0}]
        assert await audit_rows(journal, "commits-including-retired-attempts") == [], crash_at
    finally:
        await journal.dispose()
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle", (crash_at, kind, status)
        for key, steps in status["executions"].items():
            if key.startswith(f"{tag}-"):
                assert key not in before[kind] and all(n == 1 for n in steps.values()), (crash_at, kind, key, steps)
    assert sorted(r["rollout_id"] for r in results) == [f"{tag}-r0", f"{tag}-r1"]
    assert all(len(r["actions"]) == LIVE_TURNS for r in results)
    return edges, codes


async def journal_row(journal: Journal, table: sa.Table, entity_id: str) -> Any:
    async with journal.read() as conn:
        return (await conn.execute(sa.select(table).where(table.c.id == entity_id))).one()


async def restore_every_checkpoint(backend: str, request: pytest.FixtureRequest, procs: Procs, tmp_path: Path,
                                   tags: list[str]) -> list[int]:
    """Every published ``ck-<tag>`` restored, each into fresh participants, all recorded in one
    journal: each restore ends ``done`` having restored exactly the published scope. Returns each
    scope's size.

    One stack per checkpoint: a reference participant takes a restore only while it holds nothing
    (the model refuses once it has served a call or holds restored ledgers; the agent and resources
    refuse while they hold sessions, which a restore installs), so a second restore into the same
    processes is refused. Each stack gets an in-process orchestrator on the shared journal (the
    participants' rows follow the new URLs)."""
    url = await new_journal_url(backend, request, tmp_path / "restore-all.db")
    sizes: list[int] = []
    for tag in tags:
        directory = str(tmp_path / f"ck-{tag}")
        checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, directory, f"ck-{tag}")
        published = json.loads((tmp_path / f"ck-{tag}" / f"ck-{tag}" / "checkpoint.json").read_text())
        assert checkpoint_id == f"ck-{tag}" and scope == published["scope"]
        fresh = await start_stack(procs, {k: tmp_path / "restore-all" / tag / k for k in KINDS}, env_delay=0.0)
        orch = Orchestrator(settings(url, fresh, restore_timeout_s=30))
        await orch.start()
        try:
            await wait_healthy(orch, fresh)

            async def start(tx: Any) -> None:
                await start_restore(tx, f"rs-{tag}", directory, checkpoint_id, scope)
            await orch.committer.run(start)
            row = await wait_terminal(orch, models.restores, f"rs-{tag}", ("done", "failed"))
            calls = [c for c in (await rpc_calls(orch)).values()
                     if c["entity_id"] == f"rs-{tag}" and c["path"].endswith("/restore")]
        finally:
            await orch.stop()
            fresh.kill()
        assert (row["state"], row["detail"]) == ("done", None), (tag, row["state"], row["detail"])
        assert (row["checkpoint_id"], row["scope"]) == (f"ck-{tag}", sorted(published["scope"])), (tag, row)
        # Every participant restored exactly that scope, each episode as its next attempt.
        assert sorted(c["target"] for c in calls) == sorted(fresh.url(k) for k in KINDS), (tag, calls)
        want = sorted(EpisodeId.from_capture_key(k).next_attempt().capture_key for k in published["scope"])
        for call in calls:
            assert call["state"] == "succeeded" and call["result"]["restored"] == want, (tag, call)
            assert call["result"]["source_checkpoint_id"] == f"ck-{tag}", (tag, call)
        sizes.append(len(scope))
    return sizes


async def test_every_checkpoint_crash_point_recovers(backend: str, request: pytest.FixtureRequest, procs: Procs,
                                                      controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=0.1)
    reached, codes = await checkpoint_run(backend, request, tmp_path, stack, controller, "clean", None)
    assert codes == [0]
    points = targets(reached, [machines.CHECKPOINTS, machines.CHECKPOINT_MEMBERS])
    assert {"checkpoints:committed->published", "checkpoints:resuming->done",
            "checkpoint_members:committed->resuming"} <= set(points) and len(points) >= 15, points
    tags = ["clean"]
    for n, point in enumerate(points):
        _, codes = await checkpoint_run(backend, request, tmp_path, stack, controller, f"t{n}", point)
        assert codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({codes})"
        tags.append(f"t{n}")
    # Every published checkpoint restores (each one holds both live episodes: checked per run).
    assert await restore_every_checkpoint(backend, request, procs, tmp_path, tags) == [2] * len(tags)


async def test_a_publish_after_the_commit_deadline_renews_every_lease_first(
        backend: str, request: pytest.FixtureRequest, procs: Procs, controller: ParticipantClient,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed right after the checkpoint was committed everywhere, the orchestrator is restarted past
    the commit deadline, which the members' leases count from (deadline + 10 s of grace here): before
    it publishes it renews every member's lease to the publish's own bound, then publishes and
    resumes them."""
    # Every prepare deadline falls before the commit deadline, so the leases count from the latter.
    monkeypatch.setenv("TIDELOG_WORKER_PREPARE_TIMEOUT_S", "2")
    monkeypatch.setenv("TIDELOG_WORKER_COMMIT_TIMEOUT_S", "2")
    grace = ("--lease-grace-seconds", "10")
    model, resources = await asyncio.gather(procs.astart("model", tmp_path / "m", *grace),
                                            procs.astart("resources", tmp_path / "r", *grace))
    agent = await procs.astart("agent", tmp_path / "a", "--model", model.url, *grace)
    env = await procs.astart("environment", tmp_path / "e", "--agent", agent.url, "--resources", resources.url,
                             *grace)
    stack = Stack({"environment": env, "model": model, "agent": agent, "resources": resources})
    url = await new_journal_url(backend, request, tmp_path / "late.db")
    args = ["ck-late", str(tmp_path / "ckpts")]
    first = await run_worker(url, stack, "checkpoint", args, "checkpoints:committing->committed")
    journal = Journal.open(url)
    try:
        committed = await journal_row(journal, models.checkpoints, "ck-late")
        leases = {k: (await controller.status(stack.url(k)))["lease_expires_at"] for k in KINDS}
        wait = float(committed.deadline_ts) - time.time() + 0.5
        await asyncio.sleep(max(wait, 0.0))  # the commit deadline has passed; the leases hold
        second = await run_worker(url, stack, "checkpoint", args, None)
        done = await journal_row(journal, models.checkpoints, "ck-late")
        async with journal.read() as conn:
            t = models.rpc_calls
            renews = [dict(r._mapping) for r in (await conn.execute(sa.select(t).where(
                t.c.entity_id == "ck-late", t.c.path.like("%/renew")))).all()]
    finally:
        await journal.dispose()
    assert (first, second) == (-signal.SIGKILL, 0)
    assert committed.state == "committed" and done.state == "done", (committed.state, done.state, done.detail)
    deadline = float(committed.deadline_ts)
    assert all(lease == pytest.approx(deadline + 10, abs=0.01) for lease in leases.values()), (deadline, leases)
    assert sorted(c["target"] for c in renews) == sorted(stack.url(k) for k in KINDS), renews
    assert all(c["state"] == "succeeded" and c["result"]["lease_expires_at"] > deadline + 10 for c in renews), renews
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == "ck-late"
    for kind in KINDS:
        assert (await controller.status(stack.url(kind)))["phase"] == "idle", kind


# -- restore ----------------------------------------------------------------------------------------

async def test_every_restore_crash_point_recovers(backend: str, request: pytest.FixtureRequest, procs: Procs,
                                                   controller: ParticipantClient, tmp_path: Path) -> None:
    # One uncrashed checkpoint of episodes mid-way; its source processes are then SIGKILLed.
    source = await start_stack(procs, {k: tmp_path / "source" / k for k in KINDS}, env_delay=0.2)
    # Long enough to be mid-way when the worker (a fresh process) prepares.
    tasks = {f"r{i}": {"prompt": f"p{i}", "turns": LIVE_TURNS} for i in range(2)}
    runs = [asyncio.create_task(controller.post(source.url("environment"), "/run", {"rollout_id": r, "task": t}))
            for r, t in tasks.items()]
    await asyncio.sleep(0.5)
    directory = tmp_path / "ckpts"
    _, row, codes = await run_and_check(backend, request, tmp_path / "source.db", source, "checkpoint",
                                        ["ck-src", str(directory), f"rollouts={','.join(tasks)}"], None,
                                        ["checkpoints"], models.checkpoints)
    assert codes == [0] and row.state == "done" and sorted(row.scope) == sorted(tasks), row.scope
    source.kill()
    for run in runs:
        run.cancel()
    done_before = checkpointed_steps(directory / "ck-src")
    continued = [EpisodeId.from_capture_key(k) for k in row.scope]

    async def restore_run(tag: str, crash_at: str | None) -> tuple[set[str], list[int]]:
        fresh = await start_stack(procs, {k: tmp_path / tag / k for k in KINDS}, env_delay=0.0)
        try:
            edges, row, codes = await run_and_check(backend, request, tmp_path / f"{tag}.db", fresh, "restore",
                                                    [f"rs-{tag}", str(directory), "ck-src"], crash_at,
                                                    ["restores"], models.restores)
            assert row.state == "done", (crash_at, row.state, row.detail)
            for episode in continued:  # each continues from its boundary: no step again, none lost
                nxt = episode.next_attempt()
                await controller.run(fresh.url("environment"), nxt.rollout_id, tasks[nxt.rollout_id], nxt.attempt)
            ran = (await controller.status(fresh.url("environment")))["executions"]
            for episode in continued:
                steps = ran.get(episode.next_attempt().capture_key, {})
                before = done_before.get(episode.rollout_id, set())
                assert not set(steps) & before and all(n == 1 for n in steps.values()), (crash_at, steps)
                assert set(steps) | before == all_steps(LIVE_TURNS), (crash_at, steps, before)
            return edges, codes
        finally:
            fresh.kill()

    reached, codes = await restore_run("clean", None)
    assert codes == [0]
    points = targets(reached, [machines.RESTORES])
    assert {"restores:created:restoring", "restores:restoring->resuming", "restores:resuming->done"} <= set(points)
    for n, point in enumerate(points):
        _, codes = await restore_run(f"t{n}", point)
        assert codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({codes})"


async def test_every_failed_restore_crash_point_recovers(backend: str, request: pytest.FixtureRequest,
                                                         procs: Procs, controller: ParticipantClient,
                                                         tmp_path: Path) -> None:
    """A restore the model refuses (its manifest corrupted) rolls back everywhere; the write that
    ends it starts the scoped rollouts over as attempt 2. Killed right after each commit of that
    run (enumerated from the restore machine, and the rollouts' move in the same write), restarted,
    it ends the same: failed with the model's refusal, every participant idle, the rollouts at
    attempt 2 (or past it: the orchestrator runs them from their input), verify clean."""
    source = await start_stack(procs, {k: tmp_path / "source" / k for k in KINDS}, env_delay=0.2)
    tasks = {f"f{i}": {"prompt": f"f{i}", "turns": LIVE_TURNS} for i in range(2)}
    runs = [asyncio.create_task(controller.post(source.url("environment"), "/run", {"rollout_id": r, "task": t}))
            for r, t in tasks.items()]
    await asyncio.sleep(0.5)
    directory = tmp_path / "ckpts"
    recorded = f"rollouts={','.join(tasks)}"
    _, row, codes = await run_and_check(backend, request, tmp_path / "source.db", source, "checkpoint",
                                        ["ck-src", str(directory), recorded], None, ["checkpoints"],
                                        models.checkpoints)
    assert codes == [0] and sorted(row.scope) == sorted(tasks), row.scope
    source.kill()
    for run in runs:
        run.cancel()
    corrupt_manifest(participant_dir(directory / "ck-src", "model", "model-0"), {}, "not json")

    async def failed_run(tag: str, crash_at: str | None) -> tuple[set[str], list[int]]:
        fresh = await start_stack(procs, {k: tmp_path / tag / k for k in KINDS})
        try:
            url = await new_journal_url(backend, request, tmp_path / f"{tag}.db")
            codes = await crashed_then_recovered(url, fresh, "restore", [f"rs-{tag}", str(directory), "ck-src",
                                                                        recorded], crash_at)
            edges, row = await edges_of(url, ["restores", "rollouts"], models.restores, f"rs-{tag}")
            journal = Journal.open(url)
            try:
                async with journal.read() as conn:
                    attempts = dict((await conn.execute(sa.select(models.rollouts.c.id, models.rollouts.c.attempt)
                                                        )).all())
            finally:
                await journal.dispose()
            assert row.state == "failed" and "model-0: HTTP 422 invalid_checkpoint_state" in row.detail, (crash_at, row)
            assert attempts == dict.fromkeys(tasks, 2), (crash_at, attempts)
            for kind in KINDS:
                status = await controller.status(fresh.url(kind))
                assert (status["phase"], status.get("restored_pending", 0)) == ("idle", 0), (crash_at, kind, status)
            return edges, codes
        finally:
            fresh.kill()

    reached, codes = await failed_run("clean-f", None)
    assert codes == [0]
    points = targets(reached, [machines.RESTORES]) + [p for p in ("rollouts:dispatched->pending",) if p in reached]
    assert {"restores:restoring->rolling_back", "restores:rolling_back->failed",
            "rollouts:dispatched->pending"} <= set(points), points
    for n, point in enumerate(points):
        _, codes = await failed_run(f"f{n}", point)
        assert codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({codes})"


# -- retire and forget ------------------------------------------------------------------------------

async def test_every_retire_and_forget_crash_point_recovers(backend: str, request: pytest.FixtureRequest,
                                                            procs: Procs, controller: ParticipantClient,
                                                            tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=0.1)
    env = stack.url("environment")

    async def retire_then_forget(tag: str, op: str, crash_at: str | None) -> tuple[set[str], list[int]]:
        rollout = f"{tag}-{op}"
        # Long enough (60 steps of 0.1 s) to be still running when the worker retires it.
        run = asyncio.create_task(controller.post(env, "/run", {"rollout_id": rollout,
                                                                "task": {"prompt": "p", "turns": 30}}))
        await asyncio.sleep(0.2)
        crash = {op: crash_at}
        edges, row, codes = await run_and_check(backend, request, tmp_path / f"{tag}-{op}.db", stack, "retire",
                                                [f"rt-{tag}-{op}", rollout, "0"], crash.get("retire"),
                                                ["retirements"], models.retirements)
        assert row.state == "done", (crash_at, row.state, row.detail)
        status, reply = await run
        assert status == 409 and reply["error"]["code"] == "stale_attempt"
        refused, reply = await controller.post(env, "/run", {"rollout_id": rollout, "task": {"prompt": "p", "turns": 1}})
        assert refused == 409 and reply["error"]["code"] == "stale_attempt"
        edges2, row, codes2 = await run_and_check(backend, request, tmp_path / f"{tag}-{op}-f.db", stack, "forget",
                                                  [f"fg-{tag}-{op}", rollout], crash.get("forget"),
                                                  ["retirements"], models.retirements)
        assert row.state == "done", (crash_at, row.state, row.detail)
        accepted, reply = await controller.post(env, "/run", {"rollout_id": rollout, "task": {"prompt": "p", "turns": 1}})
        assert accepted == 200, reply
        return edges | edges2, codes if op == "retire" else codes2

    reached, codes = await retire_then_forget("clean", "retire", None)
    assert codes == [0]
    points = targets(reached, [machines.RETIREMENTS])
    assert {"retirements:created:queued", "retirements:queued->running", "retirements:running->done"} <= set(points)
    for n, point in enumerate(points):
        for op in ("retire", "forget"):
            _, codes = await retire_then_forget(f"t{n}", op, point)
            assert codes == [-signal.SIGKILL, 0], f"{op} at {point}: the hook did not fire ({codes})"
