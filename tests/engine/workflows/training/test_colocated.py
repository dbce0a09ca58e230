"""Colocated training through the whole orchestrator, on both journal backends, with real reference
engines and a real torch trainer: before each step every engine is paused and its memory released,
and publication takes it back; an engine whose memory-region call fails is ``uncertain``, is never
used again, and is replaced (by the stack that runs it, or by an operator when nothing does).

The engines' own test-only history (``/_test/history``) shows what each process was asked and
answered, in order; the journal shows what was acknowledged (``engines.memory``) and when, by
event sequence, relative to the job's training step."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.deployment.stack import Stack
from journal import Journal, audit, models
from tests.engine.workflows.deployment.test_engines import _ready, http_json, two_engine_stack, wait_for
from tests.support.training import edges, payload, submit, until_state
from tests.workers.inference.engines import EngineProc

pytestmark = pytest.mark.slow
ALL = "weights,kv_cache,cuda_graph"
KV = "kv_cache,cuda_graph"


def colocated(settings: Settings, *, keep_base_resident: bool) -> Settings:
    raw = settings.model_dump(by_alias=True)
    raw["training"]["colocated"] = {"enabled": True, "keep_base_resident": keep_base_resident}
    return Settings.model_validate(raw)


def fail_next(url: str, path: str) -> None:
    """Arm the engine's test-only fault: its next ``path`` answers 500 without acting."""
    req = urllib.request.Request(f"{url}/_test/fail_next", method="POST",
                                 data=json.dumps({"path": path, "mode": "error"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10):
        pass


async def engine_events(journal: Journal, engine: str) -> list[dict[str, Any]]:
    e = models.events
    async with journal.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(sa.select(e.c.seq, e.c.from_state, e.c.to_state, e.c.reason)
                                                              .where(e.c.entity_kind == "engines", e.c.entity_id == engine)
                                                              .order_by(e.c.seq))).all()]


async def trained_at(journal: Journal, job: str) -> int:
    """The event sequence of the job's training step (RUNNING -> CHECKPOINT)."""
    e = models.events
    async with journal.read() as conn:
        found: int = (await conn.execute(sa.select(e.c.seq).where(
            e.c.entity_kind == "training_jobs", e.c.entity_id == job, e.c.from_state == "RUNNING",
            e.c.to_state == "CHECKPOINT"))).scalar_one()
    return found


async def engine_row(journal: Journal, engine: str) -> dict[str, Any]:
    async with journal.read() as conn:
        return dict((await conn.execute(sa.select(models.engines).where(models.engines.c.id == engine)))
                    .one()._mapping)


async def releases_refused(journal: Journal, job: str) -> int:
    """How many times the job's step was said to wait for a failed release (its RUNNING self-edges)."""
    e = models.events
    async with journal.read() as conn:
        return len((await conn.execute(sa.select(e.c.seq).where(
            e.c.entity_kind == "training_jobs", e.c.entity_id == job, e.c.from_state == "RUNNING",
            e.c.to_state == "RUNNING", e.c.reason.like("%releasing the engines' memory failed%")))).all())


def first(history: list[list[Any]], event: str, version: str | None = None, start: int = 0) -> int:
    """The index of the first ``event`` (on ``version``, if given) at or after ``start``."""
    found = [i for i, (e, v, _) in enumerate(history) if i >= start and e == event and version in (None, v)]
    assert found, json.dumps([event, version, start, [h[:2] for h in history]])
    return found[0]


async def test_memory_is_released_before_each_step_and_taken_back_by_publication(journal_url: str,
                                                                                 tmp_path: Path) -> None:
    ports, settings = two_engine_stack(journal_url, tmp_path)
    orch = Orchestrator(colocated(settings, keep_base_resident=False), unbuilt=["discovery"])
    await orch.start()
    try:
        await wait_for(lambda: _ready(orch), "the deployment ready")
        job = await submit(orch.journal, payload(1))
        row = await until_state(orch.journal, job, "COMPLETE", "REJECTED", "FAILED")
        assert row["state"] == "COMPLETE", row
        head = row["runtime_load_id"]
        step = await trained_at(orch.journal, job)
        for name, port in ports.items():
            history = http_json(f"http://127.0.0.1:{port}/_test/history")["history"]
            released = first(history, f"release {ALL}")
            # Paused first, then everything released; publication: the weights back, the target
            # loaded, the KV cache and graphs back, and only then generation, on the new head.
            assert "pause" in [e for e, _, _ in history[:released]], (name, history)
            weights = first(history, "resume weights", start=released)
            loaded = first(history, "load", head, start=weights)
            kv = first(history, f"resume {KV}", start=loaded)
            assert first(history, "continue", start=released) > kv, (name, history)
            continued = [v for event, v, _ in history[released:] if event == "continue"]
            assert continued and set(continued) == {head}, (name, history)
            # The journal recorded the release, acknowledged, before the step was trained.
            said = await engine_events(orch.journal, f"dep/{name}")
            released_at = [e["seq"] for e in said if e["reason"] == f"job {job[:12]} RUNNING: held paused for its "
                           f"colocated training step; released: cuda_graph, kv_cache, weights"]
            assert released_at and released_at[0] < step, (name, said, step)
            final = await engine_row(orch.journal, f"dep/{name}")
            assert final["state"] == "serving" and final["memory"] == dict.fromkeys(
                ("cuda_graph", "kv_cache", "weights"), "resident"), final
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()


async def test_an_engine_whose_release_failed_is_uncertain_and_its_service_replaced(journal_url: str,
                                                                                    tmp_path: Path) -> None:
    """keep_base_resident: only the KV cache and graphs are released. e1's release fails (500,
    nothing done): its row is uncertain, the stack kills its service and rebuilds, the new process
    gets a fresh adapter and the gate before any work, and the job is trained once, then published."""
    ports, settings = two_engine_stack(journal_url, tmp_path)
    orch = Orchestrator(colocated(settings, keep_base_resident=True), unbuilt=["discovery"])
    await orch.start()
    try:
        await wait_for(lambda: _ready(orch), "the deployment ready")
        stack: Stack = orch.handle("deployment")
        victim = stack.procs["e1"].pid
        fail_next(f"http://127.0.0.1:{ports['e1']}", "/release_memory_occupation")
        job = await submit(orch.journal, payload(1))
        row = await until_state(orch.journal, job, "COMPLETE", "REJECTED", "FAILED", timeout=180)
        assert row["state"] == "COMPLETE", row
        head = row["runtime_load_id"]
        await wait_for(lambda: _ready(orch), "the deployment ready again")
        assert stack.procs["e1"].pid != victim
        said = await engine_events(orch.journal, "dep/e1")
        went = [(e["from_state"], e["to_state"]) for e in said]
        uncertain = next(i for i, e in enumerate(said) if e["to_state"] == "uncertain")
        assert "release ['kv_cache', 'cuda_graph'] failed" in said[uncertain]["reason"], said
        # Replaced before it was looked at again: its relaunch made it unverified, then gated.
        assert went[uncertain + 1] == ("uncertain", "unverified"), went
        assert "its service e1 was launched" in said[uncertain + 1]["reason"], said
        async with orch.journal.read() as conn:
            s = models.services
            e1 = (await conn.execute(sa.select(s.c.restarts).where(s.c.id == "e1"))).scalar_one()
            e = models.events
            why = (await conn.execute(sa.select(e.c.reason).where(
                e.c.entity_kind == "services", e.c.entity_id == "e1", e.c.to_state == "failed"))).scalars().all()
        # Replaced once, for its uncertainty. (A loaded machine may add an "owner gone" failure: a
        # lease lost and taken again hands the stack to the next term, which relaunches it.)
        assert sum("dep/e1 is uncertain" in w for w in why) == 1, (e1, why)
        # Trained once, only after every engine released: the failed release held the step.
        assert [t for t in await edges(orch.journal, job) if t[1] in ("CHECKPOINT", "AMBIGUOUS") and t[0] != t[1]] == [
            ("RUNNING", "CHECKPOINT")]
        e = models.events
        async with orch.journal.read() as conn:
            held = (await conn.execute(sa.select(e.c.reason).where(
                e.c.entity_kind == "training_jobs", e.c.entity_id == job, e.c.from_state == "RUNNING",
                e.c.to_state == "RUNNING"))).scalars().all()
        assert any("releasing the engines' memory failed" in r for r in held), held
        for name, port in ports.items():
            # New processes (the whole stack was rebuilt): gated (paused) before anything else,
            # the KV cache and graphs released for the step, and generation only on the head.
            history = http_json(f"http://127.0.0.1:{port}/_test/history")["history"]
            events = [event for event, _, _ in history]
            assert events[0] == "pause" and f"release {KV}" in events and f"release {ALL}" not in events, history
            assert "resume weights" not in events, history  # kept resident: nothing to resume
            continued = [v for event, v, _ in history if event == "continue"]
            assert continued and set(continued) == {head}, (name, history)
        final = await engine_row(orch.journal, "dep/e1")
        assert final["state"] == "serving" and set(final["memory"].values()) == {"resident"}, final
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()


async def test_an_uncertain_engine_nothing_manages_is_never_used_again(journal_url: str, tmp_path: Path,
                                                                        engine_procs: list[EngineProc]) -> None:
    """Engines at URLs (no stack): the one whose release failed stays uncertain, through a new
    leader too; no call reaches it, and the step is not trained beside it."""
    urls = {f"e{i}": p.url for i, p in enumerate(engine_procs)}
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "logging": {"level": "WARNING"},
        "training": {"enabled": True, "executor": "uni", "deployment": "dep",
                     "trainer": {"state_dir": str(tmp_path / "trainer")},
                     "checkpoint_dir": str(tmp_path / "checkpoints"), "weights_dir": str(tmp_path / "weights"),
                     "initial_weights": str(tmp_path / "initial"), "retry_after_s": 0.2,
                     "publish_retry_after_s": 0.2, "colocated": {"enabled": True},
                     "engines": [{"name": n, "url": u} for n, u in urls.items()]}})
    fail_next(urls["e1"], "/release_memory_occupation")
    recorded: dict[str, Any] = {}
    refused = 0
    for life in ("first", "second"):
        orch = Orchestrator(settings, unbuilt=["discovery"])
        await orch.start()
        try:
            if life == "first":
                job = await submit(orch.journal, payload(1))

            async def uncertain() -> bool:
                async with orch.journal.read() as conn:
                    state = (await conn.execute(sa.select(models.engines.c.state).where(
                        models.engines.c.id == "dep/e1"))).scalar()  # no row before the election
                return state == "uncertain"
            await wait_for(uncertain, "e1 uncertain")

            async def held() -> bool:
                # A new refusal of the step by this life's leader (the first life's are counted).
                return await releases_refused(orch.journal, job) > refused
            await wait_for(held, "the step held by the failed release")
            refused = await releases_refused(orch.journal, job)
            seen = http_json(f"{urls['e1']}/_test/history")["history"]
            # Five tries of the step (0.2 s apart) and as many gate looks later: nothing reached it.
            await asyncio.sleep(1.0)
            row = await engine_row(orch.journal, "dep/e1")
            assert http_json(f"{urls['e1']}/_test/history")["history"] == seen, life
            assert row["state"] == "uncertain", row
            assert "release ['weights', 'kv_cache', 'cuda_graph'] failed" in row["detail"], row
            assert "never used again until it is replaced" in row["detail"], row
            if life == "second":
                # The new leader left the row as it was (no event): it knew no more of the engine.
                assert (row["version"], row["detail"]) == (recorded["version"], recorded["detail"]), (row, recorded)
            recorded = row
            assert ("RUNNING", "CHECKPOINT") not in await edges(orch.journal, job)
        finally:
            await orch.stop()


def test_colocated_training_refuses_in_place_pausing() -> None:
    with pytest.raises(ValueError, match="training.colocated.enabled needs training.pause_mode 'abort' or 'retract'"):
        Settings.model_validate({"training": {"enabled": True, "pause_mode": "in_place", "colocated": {"enabled": True},
                                              "engines": [{"name": "e0", "url": "http://127.0.0.1:9"}]}})
