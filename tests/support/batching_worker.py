"""Subprocess entry point for the batching crash harness: rollouts through batches into two jobs.

    python -m tests.support.batching_worker JOURNAL_URL WORKDIR TAG INITIAL_WEIGHTS ENGINE_URL -- NAME=URL...

An orchestrator built from its configuration (as ``tidelog serve`` builds it) with the four reference
participants NAME=URL, one reference engine, the reference trainer in process (``uni``: its torch is
the zygote's) and ``training.batching`` (size 2, ``max_staleness`` 1, ``labels: {split: train}``, the
reference task's sample). Once it leads it submits, each only if the journal does not hold it yet:
first ``TAG-eval`` (labelled ``split: eval``); once a batch has taken that one (excluded), ``TAG-t0`` and
``TAG-t1``; once their batch is ``trained``, ``TAG-t2`` and ``TAG-t3`` (``split: train``). So the two
batches hold the same rollouts in every run, and the trained weights are the same bytes. It exits 0
once two batches are ``trained`` and every rollout is ``forgotten``; 3 on a time-out (what it saw goes
to stderr). ``TIDELOG_CRASH_AT`` kills it with
SIGKILL right after that commit; the next run picks up where it died.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts
from journal import Journal, WriteTx, models
from tests.support.reference_procs import TOKEN
from tests.support.training_worker import migrate_if_needed

DEADLINE_S = 240.0
SIZE, MAX_STALENESS = 2, 1


def settings(journal_url: str, workdir: str, initial: str, engine_url: str, participants: dict[str, str]) -> Settings:
    return Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 1.0, "lease_renew_s": 0.25, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 1},
        "dispatcher": {"poll_s": 0.2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 2},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "rollouts": {"forget_retry_s": 0.5},
        "logging": {"level": "WARNING"},
        "training": {"enabled": True, "executor": "uni", "deployment": "dep",
                     "trainer": {"seed": 0, "device": "cpu", "state_dir": os.path.join(workdir, "trainer")},
                     "checkpoint_dir": os.path.join(workdir, "checkpoints"),
                     "weights_dir": os.path.join(workdir, "weights"), "initial_weights": initial,
                     "retry_after_s": 0.2, "publish_retry_after_s": 0.2, "engine_timeout_s": 10,
                     "engines": [{"name": "e0", "url": engine_url}],
                     "batching": {"enabled": True, "size": SIZE, "max_staleness": MAX_STALENESS,
                                  "labels": {"split": "train"}, "sample": "workers.reference.samples:episode"}}})


def tasks(tag: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The evaluation rollout, then the four training ones (rollout id -> task). The prompts do not
    name the tag, so every run trains on the same episodes."""
    evaluation = {f"{tag}-eval": {"input": {"prompt": "eval", "turns": 1}, "labels": {"split": "eval"}}}
    train = {f"{tag}-t{i}": {"input": {"prompt": f"task {i}", "turns": 1}, "labels": {"split": "train"}}
             for i in range(4)}
    return evaluation, train


async def submit_absent(orch: Orchestrator, batch: dict[str, dict[str, Any]]) -> None:
    t = models.rollouts

    async def write(tx: WriteTx) -> None:
        held = set((await tx.execute(sa.select(t.c.id).where(t.c.id.in_(sorted(batch))))).scalars())
        todo = [check_task({"rollout_id": rid, **task}, i) for i, (rid, task) in enumerate(batch.items())
                if rid not in held]
        if todo:
            await submit_rollouts(tx, todo)
    await orch.committer.run(write)


async def seen(journal: Journal) -> dict[str, Any]:
    async with journal.read() as conn:
        batches = {r.id: (r.state, r.rollout_ids) for r in
                   (await conn.execute(sa.select(models.training_batches))).all()}
        rollouts = {r.id: (r.state, r.batch_id) for r in (await conn.execute(sa.select(models.rollouts))).all()}
        jobs = {r.id[:12]: (r.state, r.detail) for r in (await conn.execute(sa.select(models.training_jobs))).all()}
    return {"batches": batches, "rollouts": rollouts, "jobs": jobs}


async def main(journal_url: str, workdir: str, tag: str, initial: str, engine_url: str,
               participants: dict[str, str]) -> int:
    await migrate_if_needed(journal_url)
    orch = Orchestrator(settings(journal_url, workdir, initial, engine_url, participants))
    await orch.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    evaluation, train = tasks(tag)
    try:
        while not (orch.is_leader and orch.working()):
            if loop.time() > deadline:
                return 3
            await asyncio.sleep(0.05)
        await submit_absent(orch, evaluation)
        while loop.time() < deadline:
            view = await seen(orch.journal)
            trained = sum(state == "trained" for state, _ in view["batches"].values())
            first, second = dict(list(train.items())[:2]), dict(list(train.items())[2:])
            if view["rollouts"].get(f"{tag}-eval", (None, None))[1] is not None:
                await submit_absent(orch, first)
            if trained >= 1:
                await submit_absent(orch, second)
            if (trained == 2 and len(view["rollouts"]) == 5
                    and all(state == "forgotten" for state, _ in view["rollouts"].values())):
                os._exit(0)  # noqa: SLF001 - done: no graceful stop (not what this harness tests)
            await asyncio.sleep(0.05)
        sys.stderr.write(f"timed out: {await seen(orch.journal)}\n")
        return 3
    finally:
        await orch.stop()


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--")
    named = dict(a.split("=", 1) for a in args[split + 1:])
    raise SystemExit(asyncio.run(main(*args[:5], participants=named)))
