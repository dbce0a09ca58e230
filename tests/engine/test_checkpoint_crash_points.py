"""Crash points of the checkpoint workflow: SIGKILL the orchestrator right after every named commit
of ``checkpoints`` and ``checkpoint_members`` that a checkpoint passes through (enumerated from the
machines, not picked by hand), restart it, and check that the run ends as an uncrashed one does:
the checkpoint done and published, every participant idle, and every episode finishing with every
step completed exactly once.

The four reference participants are real processes that live through every orchestrator crash;
each run uses a fresh journal, a fresh checkpoint directory and new episodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from engine.crash import ENV, hook_names
from journal import Journal, audit, machines, models
from tests.engine.test_crash_recovery import new_journal_url
from tests.support.reference_procs import Controller, Procs, Stack, start_stack

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("environment", "model", "agent", "resources")
pytestmark = pytest.mark.slow




async def run_worker(journal_url: str, directory: Path, checkpoint_id: str, stack: Stack,
                     crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if crash_at is not None:
        env[ENV] = crash_at
    named = [f"{kind}-0={stack.url(kind)}" for kind in KINDS]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.checkpoint_worker", journal_url, str(directory), checkpoint_id, *named,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {proc.returncode}:\n{err.decode()[-3000:]}")
    return proc.returncode if proc.returncode is not None else -1


async def one_run(journal_url: str, directory: Path, stack: Stack, controller: Controller, tag: str,
                  crash_at: str | None) -> tuple[set[str], list[int]]:
    env = stack.url("environment")
    before = {kind: (await controller.status(stack.url(kind)))["executions"] for kind in KINDS}
    runs = [asyncio.create_task(controller.run(env, f"{tag}-r{i}", {"prompt": f"{tag} {i}", "turns": 3}))
            for i in range(2)]
    await asyncio.sleep(0.3)  # mid-episode
    codes = [await run_worker(journal_url, directory, f"ck-{tag}", stack, crash_at)]
    if codes[-1] != 0:
        codes.append(await run_worker(journal_url, directory, f"ck-{tag}", stack, None))
    results = await asyncio.gather(*runs)
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            row = (await conn.execute(sa.select(models.checkpoints).where(models.checkpoints.c.id == f"ck-{tag}"))).one()
            members = (await conn.execute(sa.select(models.checkpoint_members))).all()
            e = models.events
            edges = {f"{k}:created:{b}" if a is None else f"{k}:{a}->{b}" for k, a, b in (await conn.execute(
                sa.select(e.c.entity_kind, e.c.from_state, e.c.to_state)
                .where(e.c.entity_kind.in_(["checkpoints", "checkpoint_members"])))).all()}
        assert await audit.verify(journal) == []
    finally:
        await journal.dispose()
    # The same outcome as an uncrashed run.
    assert row.state == "done", (crash_at, row.state, row.detail)
    assert (directory / "LATEST").read_text().strip() == f"ck-{tag}"
    published = json.loads((directory / f"ck-{tag}" / "checkpoint.json").read_text())
    assert set(published["members"]) == {f"{k}-0" for k in KINDS}
    assert all(m.state == "resumed" for m in members)
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle", (crash_at, kind, status)
        # Every step of the run's episodes completed exactly once, crash or not.
        for key, steps in status["executions"].items():
            if key.startswith(f"{tag}-"):
                assert key not in before[kind] and all(n == 1 for n in steps.values()), (crash_at, kind, key, steps)
    assert all(len(r["actions"]) == 3 for r in results)
    return edges, codes


async def test_every_checkpoint_crash_point_recovers(backend: str, request: pytest.FixtureRequest, procs: Procs,
                                                      controller: Controller, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=0.1)
    clean_url = await new_journal_url(backend, request, tmp_path / "clean.db")
    reached, codes = await one_run(clean_url, tmp_path / "ck-clean", stack, controller, "clean", None)
    assert codes == [0]
    every_hook = hook_names([machines.CHECKPOINTS, machines.CHECKPOINT_MEMBERS])
    targets = [h for h in every_hook if h in reached]
    # The happy path: every checkpoint edge from created to done, and every member's.
    assert {"checkpoints:committed->published", "checkpoints:resuming->done",
            "checkpoint_members:committed->resuming"} <= set(targets), sorted(reached)
    unreached = sorted(set(every_hook) - reached)
    assert all(any(w in h for w in ("abort", "failed", "not_ready")) or "pending->resuming" in h
               or "preparing->resuming" in h or "prepared->resuming" in h or "committing->resuming" in h
               for h in unreached), unreached
    assert len(targets) >= 15, targets
    for n, point in enumerate(targets):
        url = await new_journal_url(backend, request, tmp_path / f"run-{n}.db")
        _, codes = await one_run(url, tmp_path / f"ck-{n}", stack, controller, f"t{n}", point)
        assert codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({codes})"
