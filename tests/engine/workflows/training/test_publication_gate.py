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
- a failed pause at CHECKPOINT is recorded and leaves the job CHECKPOINT, retried from there;
- the pause intent is durable before the first pause call, so after a partial pause failure the
  engine gate fences a replacement engine (pauses it) before the publisher's retry reaches it.
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
from engine.workflows.training.engine_gate import EngineGateController, GateSettings, sync_engines
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

    def replace_engine(self, index: int, initial: Path, log: Path) -> None:
        """SIGKILL engine ``index`` and start a fresh one on its address, on the initial weights (unpaused)."""
        port = self.procs[index].url.rsplit(":", 1)[1]
        self.procs[index].kill()
        self.procs[index] = EngineProc(["--port", port, "--model-dir", str(initial), "--enable-test-faults"],
                                       log).start()

    def gate(self) -> EngineGateController:
        """The engine gate over the rig's engines, sharing the publisher's lock as the orchestrator's does."""
        assert self.controller.publisher is not None
        return EngineGateController({f"dep/e{i}": engine for i, engine in enumerate(self.engines)},
                                    GateSettings("dep", retry_after_s=0), self.controller.publisher.lock)

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


async def test_a_partial_pause_failure_fences_a_replacement_engine_before_the_retry(
        rig: Rig, initial_dir: Path, tmp_path: Path) -> None:
    await rig.fail_next(1, "/pause_generation")
    job_id = await rig.submit(1)
    await rig.drive(job_id, "CHECKPOINT")
    await rig.controller.reconcile(rig.ctx, job_id)
    row = await rig.row(job_id)
    assert row["state"] == "CHECKPOINT" and "pausing the engines failed" in row["detail"], row
    assert row["pause_intent_at"] is not None and await rig.paused() == [True, False]
    # The intent was written before the pause calls (its event comes before the failure's).
    e = models.events
    async with rig.journal.read() as conn:
        said = [r.reason for r in (await conn.execute(sa.select(e.c.reason).where(
            e.c.entity_id == job_id, e.c.to_state == "CHECKPOINT").order_by(e.c.seq))).all()]
    assert said[-2:] == ["pause intent recorded: pausing every engine", row["detail"][:200]], said
    # Engine 1 dies and a replacement starts on its address, generating on its start-up weights.
    rig.replace_engine(1, initial_dir, tmp_path / "engine-1b.log")
    assert await rig.paused() == [True, False]
    # The engine gate's look (before the publisher's retry) pauses it: the barrier holds.
    gate = rig.gate()
    async with rig.journal.write() as tx:
        await sync_engines(tx, "dep", {f"e{i}": p.url for i, p in enumerate(rig.procs)})
    for i in range(2):
        await gate.reconcile(rig.ctx, f"dep/e{i}")
    assert await rig.paused() == [True, True]
    t = models.engines
    async with rig.journal.read() as conn:
        engines = {r.id: r for r in (await conn.execute(sa.select(t))).all()}
    assert {i: (r.state, r.paused) for i, r in engines.items()} == {"dep/e0": ("paused", True),
                                                                    "dep/e1": ("paused", True)}
    assert "pause intent recorded" in engines["dep/e1"].detail, engines["dep/e1"].detail
    # The retry then gets past the barrier and publishes on both; generation continues on the head.
    row = await rig.drive(job_id, "COMPLETE")
    assert await rig.served() == [row["runtime_load_id"]] * 2 and await rig.paused() == [False, False]
    assert await audit.verify(rig.journal) == []


async def test_a_replacement_off_the_head_is_paused_while_the_publisher_acts(rig: Rig, initial_dir: Path,
                                                                            tmp_path: Path) -> None:
    """HEAD_COMMITTED: the publisher resumes the engines on the head; a replacement started meanwhile on
    its start-up weights is paused by the gate's look rather than left generating off the head."""
    job_id = await rig.submit(1)
    head = (await rig.drive(job_id, "COMPLETE"))["runtime_load_id"]
    job2 = await rig.submit(2)
    await rig.drive(job2, "HEAD_COMMITTED")
    rig.replace_engine(1, initial_dir, tmp_path / "engine-1b.log")
    gate = rig.gate()
    async with rig.journal.write() as tx:  # an election: every row unverified until looked at
        await sync_engines(tx, "dep", {f"e{i}": p.url for i, p in enumerate(rig.procs)})
    await gate.reconcile(rig.ctx, "dep/e1")
    assert (await rig.paused())[1] is True and (await rig.served())[1] == "initial"
    assert head != (await rig.row(job2))["runtime_load_id"]
    row = await rig.drive(job2, "COMPLETE")
    assert await rig.served() == [row["runtime_load_id"]] * 2 and await rig.paused() == [False, False]
    assert await audit.verify(rig.journal) == []
