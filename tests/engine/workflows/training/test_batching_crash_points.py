"""Crash points of the batch machine: the orchestrator SIGKILLed right after every commit of a
``training_batches`` row (and of a rollout's ``finished -> finished``, a batch taking it) that a run
passes through, enumerated from the machines, not picked by hand; then restarted. Both backends.

Each run is ``python -m tests.support.batching_worker`` (forked from the zygote) on a fresh journal
and working directory: the four reference participants and one reference engine are real processes
that live through every run; the reference trainer runs in the orchestrator's process (``uni``), so it
dies with it. A run submits one evaluation rollout (excluded by the batching labels: the ``open ->
open`` commit), then four training rollouts, which become two jobs of two (``max_staleness`` 1).
An uncrashed run tells which hooks a run passes and how often; every one is then crashed at, at each
of its passings (``NAME@N``).

After every run: every rollout was taken by exactly one batch (``batch_id``), the four training ones
each as a member of exactly one submitted batch and trained by exactly one job, the evaluation one
excluded with its reason; no member is staler than the bound against its job's base version; both
jobs ``COMPLETE``, the trainer's step record at step 2 (no batch trained twice) and each job's
checkpoint at its step; the last checkpoint's and the served weights' tensors equal the uncrashed
run's bit for bit; the engine serves the committed head, and in its ``/_test/history`` since the run
started generation continued only on versions the journal had committed before (the training crash
suite's gate check); two batches ``trained`` and one ``open``; every rollout forgotten;
``audit.verify`` clean. The engine is put back on its initial weights before each run.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.runtime.crash import ENV, hook_names
from engine.workflows.training.samples import staleness
from journal import Journal, audit, machines, models
from tests.engine.runtime.test_crash_recovery import new_journal_url
from tests.engine.workflows.training.test_crash_points import gate_problems, history, served, tensors_digest
from tests.support.batching_worker import MAX_STALENESS, tasks
from tests.support.reference_procs import KINDS, Procs, Stack, start_stack
from tests.support.workflows import procs  # noqa: F401 - fixture
from tests.support.zygote import shared
from tests.workers.inference.engines import EngineProc
from workers.policy import load_weights
from workers.trainer.checkpoint import read_checkpoint
from workers.trainer.steps import read_step_record

pytestmark = pytest.mark.slow

#: Besides the batch machine's own: a rollout taken by a batch.
TAKEN = "rollouts:finished->finished"


async def run_worker(url: str, workdir: Path, tag: str, initial: Path, engine: EngineProc, stack: Stack,
                     crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if crash_at is not None:
        env[ENV] = crash_at
    named = [f"{kind}-0={stack.url(kind)}" for kind in KINDS]
    code, _, err = await shared().communicate(
        "tests.support.batching_worker", [url, str(workdir), tag, str(initial), engine.url, "--", *named],
        env=env, timeout=300)
    if code not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {code} (crash at {crash_at}):\n{err.decode()[-3000:]}")
    return code


@dataclass
class Engine:
    """The reference engine that lives through the runs, and where this run's history starts."""

    proc: EngineProc
    initial: Path
    offset: int = 0

    async def reset(self, http: aiohttp.ClientSession) -> None:
        for path, body in (("/update_weights_from_disk", {"model_path": str(self.initial),
                                                         "weight_version": "initial"}),
                           ("/continue_generation", {})):
            async with http.post(self.proc.url + path, json=body) as resp:
                assert resp.status == 200, (path, await resp.text())
        self.offset = len(await history(http, self.proc.url))


async def check_run(url: str, workdir: Path, tag: str, crash_at: str | None, engine: Engine,
                    http: aiohttp.ClientSession) -> tuple[Counter[str], tuple[str, str]]:
    """The invariants (module docs); the hooks the run passed, with how often, and the digests of the
    last checkpoint's and the served weights' tensors."""
    journal = Journal.open(url)
    try:
        async with journal.read() as conn:
            def rows(t: sa.Table) -> Any:
                return conn.execute(sa.select(t))
            batches = {r.id: dict(r._mapping) for r in (await rows(models.training_batches)).all()}
            rollouts = {r.id: dict(r._mapping) for r in (await rows(models.rollouts)).all()}
            jobs = {r.id: dict(r._mapping) for r in (await rows(models.training_jobs)).all()}
            versions = {r.id: dict(r._mapping) for r in (await rows(models.weight_versions)).all()}
            e = models.events
            events = (await conn.execute(sa.select(e.c.entity_kind, e.c.from_state, e.c.to_state).where(
                e.c.entity_kind.in_(["training_batches", "rollouts"])).order_by(e.c.seq))).all()
            committed_at = dict((await conn.execute(sa.select(e.c.entity_id, e.c.ts).where(
                e.c.entity_kind == "weight_versions", e.c.to_state == "committed"))).all())
        assert await audit.verify(journal) == [], crash_at
    finally:
        await journal.dispose()
    evaluation, train = tasks(tag)
    assert set(rollouts) == set(evaluation) | set(train), crash_at
    assert all(r["state"] == "forgotten" and r["batch_id"] in batches for r in rollouts.values()), (crash_at, rollouts)
    submitted = [b for b in batches.values() if b["job_id"] is not None]
    assert sorted(b["state"] for b in batches.values()) == ["open", "trained", "trained"], (crash_at, batches)
    members = [rid for b in submitted for rid in b["rollout_ids"]]
    assert sorted(members) == sorted(train), (crash_at, members)  # each training rollout in exactly one batch
    excluded = {rid: why for b in batches.values() for rid, why in (b["excluded"] or {}).items()}
    assert list(excluded) == list(evaluation) and "label 'split' is 'eval'" in excluded[f"{tag}-eval"], crash_at
    for rid, r in rollouts.items():
        holder = batches[r["batch_id"]]
        assert rid in (holder["rollout_ids"] or []) or rid in (holder["excluded"] or {}), (crash_at, rid, holder)
    assert sorted(j["state"] for j in jobs.values()) == ["COMPLETE", "COMPLETE"], (crash_at, jobs)
    assert {b["job_id"] for b in submitted} == set(jobs), crash_at
    for b in submitted:
        job = jobs[b["job_id"]]
        samples = job["payload"]["rollouts"]
        assert [s["rollout_id"] for s in samples] == b["rollout_ids"], crash_at
        for s in samples:
            lag, why = staleness(job["base_version"], rollouts[s["rollout_id"]]["weight_version"])
            assert why is None and lag is not None and 0 <= lag <= MAX_STALENESS, (crash_at, s, job["base_version"])
    record = read_step_record(workdir / "trainer")
    assert record is not None and record.step == 2, (crash_at, record)  # no batch trained twice
    ordered = sorted(submitted, key=lambda b: b["number"])
    assert [b["rollout_ids"] for b in ordered] == [sorted(train)[:2], sorted(train)[2:]], crash_at
    for step, b in enumerate(ordered, start=1):
        info, _ = read_checkpoint(jobs[b["job_id"]]["checkpoint_path"])
        assert (info.job_id, info.step) == (b["job_id"], step), (crash_at, info)
    _, last_state = read_checkpoint(jobs[ordered[-1]["job_id"]]["checkpoint_path"])
    head = jobs[ordered[-1]["job_id"]]["runtime_load_id"]
    assert versions[head]["state"] == "committed" and await served(http, engine.proc.url) == head, crash_at
    head_weights, _ = load_weights(versions[head]["weights_path"])
    seen = (await history(http, engine.proc.url))[engine.offset:]
    problems = gate_problems(seen, committed_at, True)
    assert not problems, (crash_at, problems, seen)
    edges = Counter(f"{k}:created:{b}" if a is None else f"{k}:{a}->{b}" for k, a, b in events)
    return edges, (tensors_digest(last_state["model"]), tensors_digest(head_weights))


async def test_every_batch_crash_point_recovers(backend: str, request: pytest.FixtureRequest, procs: Procs,  # noqa: F811
                                                tmp_path: Path) -> None:
    from workers.policy import Policy, save_weights
    initial = tmp_path / "initial"
    save_weights(Policy(seed=0), initial, "initial")
    proc = EngineProc(["--port", "0", "--model-dir", str(initial), "--enable-test-faults"],
                      tmp_path / "engine.log").start()
    engine = Engine(proc, initial)
    try:
        stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
        async with aiohttp.ClientSession() as http:
            async def run(tag: str, crash_at: str | None) -> tuple[Counter[str], tuple[str, str]]:
                url = await new_journal_url(backend, request, tmp_path / f"{tag}.db")
                workdir = tmp_path / tag
                await engine.reset(http)
                codes = [await run_worker(url, workdir, tag, initial, proc, stack, crash_at)]
                if crash_at is not None:
                    assert codes == [-signal.SIGKILL], f"the hook {crash_at} did not fire ({codes})"
                    codes.append(await run_worker(url, workdir, tag, initial, proc, stack, None))
                assert codes[-1] == 0, (crash_at, codes)
                return await check_run(url, workdir, tag, crash_at, engine, http)

            passed, clean = await run("clean", None)
            points = [h for h in hook_names([machines.TRAINING_BATCHES]) + [TAKEN] if passed[h]]
            assert {"training_batches:created:open", "training_batches:open->open",
                    "training_batches:open->submitted", "training_batches:submitted->trained", TAKEN} <= set(points), passed
            todo = [h if k == 1 else f"{h}@{k}" for h in points for k in range(1, passed[h] + 1)]
            for i, point in enumerate(todo):
                _, digests = await run(f"c{i}", point)
                assert digests == clean, (point, "the weights differ from the uncrashed run's")
            print(f"{len(todo)} batch crash points on {backend}: {todo}")
    finally:
        proc.kill()
