"""Commit-gated publication driven step by step (no orchestrator): the training controller's
reconcile is called directly on a journal Context, so each test stops exactly at the state it
needs. Real parts: a torch trainer (uni executor), two reference inference engines (processes
on loopback), the journal on both backends. Faults come from the engines' own test-only route.

Regression tests for the review of issue 6's publication:

- a rejected candidate's runtime load id is never allocated again (it used to be, and the next
  job's publication failed on the duplicate id with every engine left paused);
- a rejection the controller cannot finish is recorded in the journal (REJECTING had no self-edge);
- a rejected step does not stay in the trainer, so the next job does not carry it;
- HEAD_COMMITTED resumes generation only once every engine serves the committed version;
- a failed pause at CHECKPOINT is recorded and leaves the job CHECKPOINT, retried from there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.runtime.clock import SystemClock
from engine.runtime.committer import GroupCommitter
from engine.workflows.training.publication import PublicationSettings
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.runtime.reconciler import Context
from engine.workflows.training import submit_job
from journal import Fence, Journal, audit, lease, models
from tests.workers.inference.engines import EngineProc
from tests.support.training import payload
from workers.executor import Executor
from workers.inference import SGLangConfig, SGLangEngine
from workers.trainer.worker import Trainer

pytestmark = pytest.mark.slow

KIND = "training_jobs"


class Rig:
    def __init__(self, journal: Journal, fence: Fence, executor: Executor, engines: list[SGLangEngine],
                 procs: list[EngineProc], tmp_path: Path) -> None:
        self.journal, self.executor, self.engines, self.procs = journal, executor, engines, procs
        self.controller = TrainingController(
            executor, TrainingSettings(str(tmp_path / "checkpoints"), retry_after_s=0),
            (engines, PublicationSettings("dep", str(tmp_path / "weights"), retry_after_s=0)))
        journal.add_commit_listener(self.controller.on_commit)
        self.committer = GroupCommitter(journal, lambda: fence)
        self.ctx = Context(journal, self.committer, SystemClock())

    async def submit(self, salt: int) -> str:
        async with self.journal.write() as tx:
            return (await submit_job(tx, "dep", payload(salt))).job_id

    async def row(self, job_id: str) -> dict[str, Any]:
        t = models.training_jobs
        async with self.journal.read() as conn:
            return dict((await conn.execute(sa.select(t).where(t.c.id == job_id))).one()._mapping)

    async def drive(self, job_id: str, *until: str, steps: int = 20) -> dict[str, Any]:
        """Reconcile the job until it is in one of ``until`` (each reconcile's errors raise)."""
        for _ in range(steps):
            row = await self.row(job_id)
            if row["state"] in until:
                return row
            await self.controller.reconcile(self.ctx, job_id)
        raise AssertionError(f"job is {row['state']} ({row['detail']}), not {until}")

    async def reject(self, job_id: str) -> None:
        row = await self.row(job_id)
        async with self.journal.write() as tx:
            await tx.transition(KIND, job_id, from_state=row["state"], version=row["version"], to_state="REJECTING",
                                reason="rejected by an operator")

    async def versions(self) -> dict[str, tuple[str, str | None]]:
        t = models.weight_versions
        async with self.journal.read() as conn:
            return {r.id: (r.state, r.job_id) for r in (await conn.execute(sa.select(t))).all()}

    async def served(self) -> list[str | None]:
        return [await e.weight_version() for e in self.engines]

    async def paused(self) -> list[bool]:
        return [bool((await e.server_info())["internal_states"][0]["paused"]) for e in self.engines]

    async def fail_next(self, engine: int, path: str) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.procs[engine].url}/_test/fail_next",
                                 json={"path": path, "mode": "error"}) as resp:
                assert resp.status == 200

    def trainer(self, method: str, *args: Any) -> Any:
        return self.executor.rpc(0, method, args)


@pytest.fixture
async def rig(journal: Journal, executor: Executor, engine_procs: list[EngineProc],
              tmp_path: Path) -> AsyncIterator[Rig]:
    engines = [SGLangEngine(SGLangConfig(p.url, timeout=10, weight_update_timeout=30)) for p in engine_procs]
    held = await lease.acquire(journal, "orchestrator", "test-rig", 600)  # the writes are fenced, as a leader's are
    assert held is not None
    r = Rig(journal, held.fence(), executor, engines, engine_procs, tmp_path)
    try:
        yield r
    finally:
        journal.remove_commit_listener(r.controller.on_commit)
        await r.committer.close()
        for e in engines:
            await e.close()


async def test_a_rejected_candidate_is_never_reused_and_its_step_leaves_the_trainer(rig: Rig) -> None:
    first = await rig.submit(1)
    head = (await rig.drive(first, "COMPLETE"))["runtime_load_id"]
    incarnation = head.rpartition(":")[0]
    after_first = rig.trainer("weights_digest")
    second = await rig.submit(2)
    candidate = (await rig.drive(second, "READY_TO_COMMIT"))["runtime_load_id"]
    assert candidate == f"{incarnation}:2" and await rig.served() == [candidate, candidate]
    assert await rig.paused() == [True, True]  # never generating on the uncommitted candidate
    await rig.reject(second)
    await rig.drive(second, "REJECTED")
    assert await rig.served() == [head, head] and await rig.paused() == [False, False]
    # The trainer is back on the head's checkpoint: the rejected step is gone from it.
    assert rig.trainer("weights_digest") == after_first
    assert rig.trainer("health")["last_job_id"] == first
    # The next job publishes under a fresh id (the rejected one names other weights for good)...
    third = await rig.submit(3)
    row = await rig.drive(third, "COMPLETE")
    assert row["runtime_load_id"] == f"{incarnation}:3"
    assert await rig.served() == [row["runtime_load_id"]] * 2
    assert await rig.versions() == {f"{incarnation}:0": ("committed", None), head: ("committed", first),
                                    candidate: ("rejected", second), row["runtime_load_id"]: ("committed", third)}
    # ...and its weights are the first and third steps only, as a trainer that never saw the second has them.
    reference = Trainer(seed=0)
    for job_id, salt in ((first, 1), (third, 3)):
        reference.train({**payload(salt), "job_id": job_id})
    assert rig.trainer("weights_digest") == reference.weights_digest()
    assert await audit.verify(rig.journal) == []


async def test_a_rejection_that_needs_an_operator_is_recorded_and_keeps_the_engines_paused(rig: Rig) -> None:
    # The first publication: the head is the weights the engines started with, which are not on disk.
    job_id = await rig.submit(1)
    candidate = (await rig.drive(job_id, "READY_TO_COMMIT"))["runtime_load_id"]
    await rig.reject(job_id)
    row = await rig.drive(job_id, "REJECTING")
    await rig.controller.reconcile(rig.ctx, job_id)  # used to raise IllegalTransition (no REJECTING self-edge)
    row = await rig.row(job_id)
    assert row["state"] == "REJECTING" and "an operator must restart them" in row["detail"]
    assert await rig.served() == [candidate, candidate] and await rig.paused() == [True, True]
    # Looking again changes nothing and writes nothing new.
    version = row["version"]
    await rig.controller.reconcile(rig.ctx, job_id)
    assert (await rig.row(job_id))["version"] == version
    assert await audit.verify(rig.journal) == []


async def test_head_committed_resumes_only_engines_serving_the_committed_version(rig: Rig, initial_dir: Path) -> None:
    job_id = await rig.submit(1)
    target = (await rig.drive(job_id, "HEAD_COMMITTED"))["runtime_load_id"]
    # Engine 1 was restarted meanwhile: it serves the weights it starts with again.
    await rig.engines[1].update_weights_from_disk(str(initial_dir), "startup")
    # ...and its first reload fails: recorded in the journal, nothing resumed.
    await rig.fail_next(1, "/update_weights_from_disk")
    await rig.controller.reconcile(rig.ctx, job_id)
    row = await rig.row(job_id)
    assert row["state"] == "HEAD_COMMITTED" and "update_weights_from_disk" in row["detail"]
    assert await rig.paused() == [True, True] and await rig.served() == [target, "startup"]
    row = await rig.drive(job_id, "COMPLETE")
    assert row["detail"] is None
    assert await rig.served() == [target, target] and await rig.paused() == [False, False]
    assert await audit.verify(rig.journal) == []


async def test_a_failed_pause_leaves_the_job_checkpoint_and_retryable(rig: Rig) -> None:
    await rig.fail_next(1, "/pause_generation")
    job_id = await rig.submit(1)
    row = await rig.drive(job_id, "CHECKPOINT")
    await rig.controller.reconcile(rig.ctx, job_id)
    row = await rig.row(job_id)
    # Still CHECKPOINT, the failure said; nothing allocated and no weights sent (the seed: a failed
    # pause leaves CHECKPOINT retryable).
    assert row["state"] == "CHECKPOINT" and "pausing the engines failed" in row["detail"], row
    assert row["target_load_id"] is None and await rig.versions() == {}
    assert await rig.served() == ["initial", "initial"]
    row = await rig.drive(job_id, "COMPLETE")
    assert await rig.served() == [row["runtime_load_id"]] * 2 and await rig.paused() == [False, False]
    assert await audit.verify(rig.journal) == []
