"""Commit-gated publication (engine/workflows/training/publication.py) on both journal backends: a real
torch trainer (uni executor) and two real reference inference engines (processes on loopback),
driven by a whole orchestrator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.workflows.training.publication import PublicationSettings
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.runtime.service import Orchestrator
from journal import audit, models
from tests.workers.inference.engines import EngineProc
from tests.support.training import job_row, payload, submit, until_state, versions
from workers.executor import Executor
from workers.inference import SGLangConfig, SGLangEngine

pytestmark = pytest.mark.slow


@pytest.fixture
async def orch(journal_url: str, executor: Executor, engine_procs: list[EngineProc],
               tmp_path: Path) -> AsyncIterator[Orchestrator]:
    engines = [SGLangEngine(SGLangConfig(p.url, timeout=10, weight_update_timeout=30)) for p in engine_procs]
    controller = TrainingController(
        executor, TrainingSettings(str(tmp_path / "checkpoints"), retry_after_s=0.2),
        (engines, PublicationSettings("dep", str(tmp_path / "weights"), retry_after_s=0.3)))
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 1}, "logging": {"level": "WARNING"}})
    o = Orchestrator(settings, controllers=[controller], unbuilt=["discovery"])
    await o.start()
    try:
        for _ in range(200):
            if o.is_leader and o.working():
                break
            await asyncio.sleep(0.05)
        yield o
    finally:
        await o.stop()
        for e in engines:
            await e.close()


async def served(http: aiohttp.ClientSession, procs: list[EngineProc]) -> list[str]:
    out = []
    for p in procs:
        async with http.get(f"{p.url}/get_weight_version") as resp:
            out.append((await resp.json())["weight_version"])
    return out


async def generate(http: aiohttp.ClientSession, proc: EngineProc) -> dict[str, Any]:
    async with http.post(f"{proc.url}/generate", json={"text": "ab c", "sampling_params": {"max_new_tokens": 4}},
                         timeout=aiohttp.ClientTimeout(total=20)) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


async def test_a_trained_job_is_published_behind_the_commit_gate(orch: Orchestrator, engine_procs: list[EngineProc],
                                                                   executor: Executor) -> None:
    first = await submit(orch.journal, payload(1))
    row = await until_state(orch.journal, first, "COMPLETE")
    target = row["runtime_load_id"]
    incarnation, _, sequence = target.rpartition(":")
    assert sequence == "1" and row["commit_acknowledged"] is True and row["target_load_id"] == target
    assert await versions(orch.journal) == {f"{incarnation}:0": ("committed", None), target: ("committed", first)}
    async with aiohttp.ClientSession() as http:
        assert await served(http, engine_procs) == [target, target]
        # Generation runs again, on the committed version; the weights are the trained ones.
        assert (await generate(http, engine_procs[0]))["meta_info"]["weight_version"] == target
    assert executor.rpc(0, "health")["step"] == 1
    e = models.events
    async with orch.journal.read() as conn:
        trail = [(r.from_state, r.to_state) for r in (await conn.execute(
            sa.select(e.c.from_state, e.c.to_state).where(e.c.entity_id == first).order_by(e.c.seq))).all()]
    # The pause intent is its own commit, before any engine is paused.
    assert trail == [(None, "RUNNING"), ("RUNNING", "CHECKPOINT"), ("CHECKPOINT", "CHECKPOINT"),
                     ("CHECKPOINT", "UPDATING_WEIGHTS"),
                     ("UPDATING_WEIGHTS", "READY_TO_COMMIT"), ("READY_TO_COMMIT", "HEAD_COMMITTED"),
                     ("HEAD_COMMITTED", "COMPLETE")]
    # The next job publishes the next version of the same incarnation.
    second = await submit(orch.journal, payload(2))
    row = await until_state(orch.journal, second, "COMPLETE")
    assert row["runtime_load_id"] == f"{incarnation}:2"
    assert executor.rpc(0, "health")["step"] == 2
    assert await audit.verify(orch.journal) == []


async def test_a_failed_transfer_is_retried_in_full_with_the_same_target(orch: Orchestrator,
                                                                          engine_procs: list[EngineProc]) -> None:
    async with aiohttp.ClientSession() as http:
        # The real engine cannot be made to fail a load on demand: its test-only route does it, once.
        async with http.post(f"{engine_procs[1].url}/_test/fail_next",
                             json={"path": "/update_weights_from_disk", "mode": "error"}) as resp:
            assert resp.status == 200
        job_id = await submit(orch.journal, payload(3))
        row = await until_state(orch.journal, job_id, "COMPLETE")
        assert row["publish_attempts"] == 2 and row["detail"] is None
        assert await served(http, engine_procs) == [row["runtime_load_id"]] * 2
    e = models.events
    async with orch.journal.read() as conn:
        retries = (await conn.execute(sa.select(sa.func.count()).select_from(e).where(
            e.c.entity_id == job_id, e.c.from_state == "UPDATING_WEIGHTS", e.c.to_state == "UPDATING_WEIGHTS"))).scalar()
    assert retries == 1
    assert list((await versions(orch.journal)).values()).count(("committed", job_id)) == 1


async def test_a_rejected_candidate_puts_the_committed_head_back(orch: Orchestrator,
                                                                  engine_procs: list[EngineProc]) -> None:
    first = await submit(orch.journal, payload(4))
    head = (await until_state(orch.journal, first, "COMPLETE"))["runtime_load_id"]
    controller = orch.reconciler.controllers["training_jobs"]
    assert isinstance(controller, TrainingController) and controller.publisher is not None
    controller.publisher.settings = PublicationSettings("dep", controller.publisher.settings.weights_dir,
                                                        retry_after_s=60)
    async with aiohttp.ClientSession() as http:
        # Engine 1 refuses the candidate; engine 0 already loaded it (and is paused).
        async with http.post(f"{engine_procs[1].url}/_test/fail_next",
                             json={"path": "/update_weights_from_disk", "mode": "error"}) as resp:
            assert resp.status == 200
        second = await submit(orch.journal, payload(5))
        for _ in range(600):
            row = await job_row(orch.journal, second)
            if row["state"] == "UPDATING_WEIGHTS" and row["publish_attempts"] == 2:
                break
            await asyncio.sleep(0.05)
        candidate = row["target_load_id"]
        assert await served(http, engine_procs) == [candidate, head]
        # An operator rejects it.
        async with orch.journal.write() as tx:
            await tx.transition("training_jobs", second, from_state=row["state"], version=row["version"],
                                to_state="REJECTING", reason="rejected by an operator")
        await until_state(orch.journal, second, "REJECTED")
        assert await served(http, engine_procs) == [head, head]
        assert (await generate(http, engine_procs[0]))["meta_info"]["weight_version"] == head
    assert (await versions(orch.journal))[candidate] == ("rejected", second)
    assert await audit.verify(orch.journal) == []
