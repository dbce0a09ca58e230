"""Rollouts become training jobs (``training.batching``), on both journal backends, with real parts:
the four reference participants, a reference engine, the reference trainer in process (``uni``).

The orchestrator dispatches the rollouts, groups the finished ones into batches of two and submits
each as a job, which trains, publishes and commits; the next rollouts run on the new head. With
``max_staleness: 0`` the rollouts that ran on a version the head has left are excluded (said in the
batch), and one labelled ``split: eval`` never trains.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import ConfigError, Settings, load
from engine.runtime.service import Orchestrator
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts
from engine.workflows.training.samples import BatchRules, staleness
from journal import Journal, audit, models
from tests.engine.workflows.checkpoint.test_api_checkpoints import call, served
from tests.engine.workflows.training.test_cli_training import tidelog
from tests.engine.workflows.training.test_serve_training import leading
from tests.support.reference_procs import KINDS, TOKEN, Procs, Stack, start_stack
from tests.support.workflows import audit_rows, procs, urls  # noqa: F401 - fixtures
from tests.workers.inference.engines import EngineProc
from workers.reference.samples import episode
from workers.trainer.steps import read_step_record


def batching_settings(url: str, tmp: Path, stack: Stack, engine: EngineProc, initial: Path,
                      **batching: Any) -> Settings:
    return Settings.model_validate({
        "journal": {"url": url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 1},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 2},
        "dispatcher": {"backoff_base_s": 0.1, "backoff_cap_s": 1},
        "participants": [{"name": name, "url": u} for name, u in urls(stack).items()],
        "rollouts": {"forget_retry_s": 0.5},
        "logging": {"level": "WARNING"},
        "training": {"enabled": True, "executor": "uni", "deployment": "dep",
                     "trainer": {"seed": 0, "state_dir": str(tmp / "trainer")},
                     "checkpoint_dir": str(tmp / "checkpoints"), "weights_dir": str(tmp / "weights"),
                     "initial_weights": str(initial), "retry_after_s": 0.2, "publish_retry_after_s": 0.2,
                     "engines": [{"name": "e0", "url": engine.url}],
                     "batching": {"enabled": True, "size": 2, "sample": "workers.reference.samples:episode",
                                  **batching}}})


@pytest.fixture
def initial(tmp_path: Path) -> Path:
    from workers.policy import Policy, save_weights
    path = tmp_path / "initial"
    save_weights(Policy(seed=0), path, "initial")
    return path


@pytest.fixture
def engine(tmp_path: Path, initial: Path) -> Any:
    proc = EngineProc(["--port", "0", "--model-dir", str(initial)], tmp_path / "engine.log").start()
    try:
        yield proc
    finally:
        proc.kill()


async def submit(orch: Orchestrator, tasks: dict[str, dict[str, Any]]) -> None:
    checked = [check_task({"rollout_id": rid, **task}, i) for i, (rid, task) in enumerate(tasks.items())]

    async def write(tx: Any) -> None:
        await submit_rollouts(tx, checked)
    await orch.committer.run(write)


async def table(journal: Journal, t: sa.Table) -> dict[str, dict[str, Any]]:
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(t))).all()}


async def seen(journal: Journal) -> str:
    """What the journal holds, for a time-out's message."""
    batches = await table(journal, models.training_batches)
    rows = await table(journal, models.rollouts)
    jobs = await table(journal, models.training_jobs)
    return (f"batches {[(b['id'], b['state'], b['rollout_ids'], b['excluded']) for b in batches.values()]}; "
            f"rollouts {[(r['id'], r['state'], r['batch_id'], r['weight_version']) for r in rows.values()]}; "
            f"jobs {[(j['id'][:12], j['state'], j['detail']) for j in jobs.values()]}")


async def until(journal: Journal, check: Any, what: str, timeout: float = 120.0) -> Any:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}: {await seen(journal)}")
        await asyncio.sleep(0.05)


def task(i: int, **labels: str) -> dict[str, Any]:
    out: dict[str, Any] = {"input": {"prompt": f"batch task {i}", "turns": 1}}
    return {**out, "labels": labels} if labels else out


async def test_rollouts_become_jobs_each_once_none_staler_than_the_bound(
        journal_url: str, procs: Procs, engine: EngineProc, initial: Path, tmp_path: Path) -> None:  # noqa: F811
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
    settings = batching_settings(journal_url, tmp_path, stack, engine, initial, max_staleness=0,
                                 labels={"split": "train"})
    async with served(settings) as (base, orch):
        await leading(orch)
        journal = orch.journal
        # Four training rollouts and one for evaluation, all dispatched on the initial head.
        await submit(orch, {**{f"a{i}": task(i, split="train") for i in range(4)}, "eval": task(9, split="eval")})

        async def phase_one() -> bool:
            batches = await table(journal, models.training_batches)
            rows = await table(journal, models.rollouts)
            return (sum(b["state"] == "trained" for b in batches.values()) == 1
                    and all(r["batch_id"] is not None for r in rows.values()))
        await until(journal, phase_one, "the first batch trained and every rollout taken")
        # Two more, dispatched on the head the first job published.
        await submit(orch, {f"b{i}": task(10 + i, split="train") for i in range(2)})

        async def phase_two() -> bool:
            batches = await table(journal, models.training_batches)
            rows = await table(journal, models.rollouts)
            return (sum(b["state"] == "trained" for b in batches.values()) == 2
                    and all(r["state"] == "forgotten" for r in rows.values()))
        await until(journal, phase_two, "the second batch trained and every rollout forgotten")

        # The routes and the command line show the batches.
        status, listed = await call("GET", f"{base}/v1/batches")
        assert status == 200 and [b["id"] for b in listed["batches"]] == ["dep.b2", "dep.b1", "dep.b0"], listed
        status, one = await call("GET", f"{base}/v1/batches/dep.b0")
        assert status == 200 and one["state"] == "trained" and one["job"]["state"] == "COMPLETE", one
        assert (await call("GET", f"{base}/v1/batches/dep.b9"))[0] == 404
        code, out, err = await tidelog("batches", "--url", base)
        assert code == 0 and out.splitlines()[1].split()[:4] == ["dep.b2", "open", "0", "0"], (out, err)
        code, out, err = await tidelog("batches", "dep.b1", "--url", base)
        assert code == 0 and out.startswith("batch dep.b1: trained\n") and "excluded    " in out, (out, err)

    batches = await table(journal, models.training_batches)
    rows = await table(journal, models.rollouts)
    jobs = await table(journal, models.training_jobs)
    versions = await table(journal, models.weight_versions)
    submitted = sorted((b for b in batches.values() if b["job_id"]), key=lambda b: b["number"])
    assert [b["state"] for b in submitted] == ["trained", "trained"]
    assert [b["state"] for b in batches.values() if not b["job_id"]] == ["open"]
    members = [rid for b in submitted for rid in b["rollout_ids"]]
    excluded = {rid: why for b in batches.values() for rid, why in (b["excluded"] or {}).items()}
    # Every finished rollout was taken by exactly one batch: trained once or excluded, never both.
    assert len(members) == len(set(members)) == 4 and not set(members) & set(excluded)
    assert set(members) | set(excluded) == set(rows)
    assert {r["batch_id"] for r in rows.values()} <= set(batches)
    for rid, row in rows.items():
        holder = batches[row["batch_id"]]
        assert rid in (holder["rollout_ids"] or []) or rid in (holder["excluded"] or {}), (rid, holder)
    assert "label 'split' is 'eval'" in excluded["eval"]
    # Two of the first four trained in the first batch; the other two ran on a version the head left.
    assert sorted(members) == sorted([*submitted[0]["rollout_ids"], "b0", "b1"])
    stale = sorted(set(excluded) - {"eval"})
    assert len(stale) == 2 and all(s.startswith("a") for s in stale)
    assert all(excluded[s].startswith("stale: ") and "max_staleness = 0" in excluded[s] for s in stale)
    # Each job trained on its batch's samples, in rollout-id order, none behind its base version.
    for b in submitted:
        job = jobs[b["job_id"]]
        assert job["state"] == "COMPLETE" and job["base_version"] == b["base_version"]
        samples = job["payload"]["rollouts"]
        assert [s["rollout_id"] for s in samples] == b["rollout_ids"] == sorted(b["rollout_ids"])
        for s in samples:
            assert s["weight_version"] == rows[s["rollout_id"]]["weight_version"] == b["base_version"]
            assert s["reward"] == rows[s["rollout_id"]]["result"]["reward"]
    # The second batch's rollouts ran on the version the first job published.
    first_published = jobs[submitted[0]["job_id"]]["runtime_load_id"]
    assert submitted[1]["base_version"] == first_published
    assert {rows[r]["weight_version"] for r in submitted[1]["rollout_ids"]} == {first_published}
    assert versions[first_published]["state"] == "committed"
    record = read_step_record(tmp_path / "trainer")
    assert record is not None and record.step == 2
    assert await audit.verify(journal) == []
    # A batch taking a rollout (finished -> finished) is not a second finish.
    assert await audit_rows(journal, "rollouts-not-done-once") == []


# -- the rules, one rollout at a time ------------------------------------------------------------------

def rollout(**over: Any) -> dict[str, Any]:
    base = {"id": "r1", "task": {"prompt": "p", "turns": 1}, "labels": {"split": "train"},
            "result": {"actions": ["ab"], "reward": 0.5}, "weight_version": "inc:3"}
    return {**base, **over}


def test_the_rules_judge_in_order_and_say_why() -> None:
    rules = BatchRules(reward_key="reward", labels={"split": "train"}, max_staleness=1, sample=episode)
    assert rules.judge(rollout(), "inc:4")[0] == {"rollout_id": "r1", "weight_version": "inc:3", "prompt": "p",
                                                 "completion": "ab", "reward": 0.5}
    assert "label 'split' is None" in str(rules.judge(rollout(labels=None), "inc:4")[1])
    assert "no finite number under 'reward'" in str(rules.judge(rollout(result={"actions": ["a"]}), "inc:4")[1])
    assert "no finite number" in str(rules.judge(rollout(result={"reward": True, "actions": ["a"]}), "inc:4")[1])
    assert str(rules.judge(rollout(), "inc:5")[1]).startswith("stale: it ran on inc:3, 2 publications behind")
    assert "another incarnation" in str(rules.judge(rollout(), "other:0")[1])
    assert "recorded no weight version" in str(rules.judge(rollout(weight_version=None), "inc:4")[1])
    assert "the sample function failed: ValueError: its result has no non-empty 'actions'" in str(
        rules.judge(rollout(result={"reward": 1, "actions": []}), "inc:4")[1])
    nan = BatchRules(reward_key=None, max_staleness=None, sample=lambda r: {"x": float("nan")})
    assert "cannot be a job's payload" in str(nan.judge(rollout(), None)[1])
    assert staleness("inc:4", "inc:4") == (0, None)
    # Staleness counts publications: sequence 4 was a rejected candidate, never committed.
    assert staleness("inc:5", "inc:3", [0, 1, 2, 3, 5]) == (1, None)
    assert staleness("inc:5", "inc:3") == (2, None)
    assert rules.judge(rollout(weight_version="inc:3"), "inc:5", [0, 1, 2, 3, 5])[1] is None


def test_batching_configuration_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  batching:\n    enabled: true\n")
    with pytest.raises(ConfigError, match="training.batching.enabled needs training.enabled"):
        load(path)
    engines = "  enabled: true\n  engines: [{name: e, url: 'http://127.0.0.1:1'}]\n"
    for bad, said in (("size: 0", "training.batching.size"), ("max_staleness: -1", "training.batching.max_staleness"),
                      ("sample: nowhere.at_all:fn", "module 'nowhere.at_all' of 'nowhere.at_all:fn' cannot be found"),
                      ("sample: not a path", "is not an import path"), ("colour: red", "training.batching.colour")):
        path.write_text(f"training:\n{engines}  initial_weights: /w\n  batching:\n    enabled: true\n    {bad}\n")
        with pytest.raises(ConfigError, match=said):
            load(path)
    # A staleness bound needs a head from the start, which the initial weights are.
    path.write_text(f"training:\n{engines}  batching:\n    enabled: true\n")
    with pytest.raises(ConfigError, match="training.batching.max_staleness needs training.initial_weights"):
        load(path)
    path.write_text(f"training:\n{engines}  batching:\n    enabled: true\n    max_staleness: null\n")
    assert load(path).training.batching.max_staleness is None
