"""Subprocess entry point for the training crash harness: an orchestrator that trains N jobs.

    python -m tests.support.training_worker JOURNAL_URL WORKDIR N INITIAL_WEIGHTS ENGINE_URL...

Runs ``Orchestrator(settings)`` with ``training.enabled`` — everything built from the
configuration, as ``tidelog serve`` does: the ``mp`` executor (the trainer is its own process,
which SIGTERMs itself when this one dies), the trainer's ``state_dir`` (``WORKDIR/trainer``),
``checkpoint_dir`` and ``weights_dir`` under ``WORKDIR``, ``initial_weights`` = INITIAL_WEIGHTS
(the weights directory the engines started from), deployment ``dep``, engines ``e0``, ``e1``,
... at the given URLs, retry delays of 0.2 s and a resync every half second. The journal is
migrated first if it is not at the head revision. The trainer process is started at once
rather than at the controller's first sync point, only to overlap its start-up with the wait
for the lease (the sync point then brings it onto the latest checkpoint as always).

Once it leads, it submits ``tests.support.training.payload(salt)`` for salt 0..N-1 in order,
each once the one before is ``COMPLETE`` (the payloads are read from ``WORKDIR/payloads.json``
when the harness wrote them there: building them imports torch). Submitting is idempotent
(``new``, ``replay``, ``resume``, ``in_progress``), so a run after a crash submits from salt 0
again and waits; ``JobConflict`` (another job still in flight) is waited out and retried.

Exit 0 when all N jobs are ``COMPLETE`` and every ``engines`` row is ``serving`` the committed
head — at once, without the orchestrator's graceful stop (not what this harness tests; its
trainer process follows when it sees this one gone); 3 on a time-out (what was seen goes to
stderr); 4 when a job ended ``FAILED`` or ``REJECTED``. ``TIDELOG_CRASH_AT`` (engine/runtime/crash.py)
kills it with SIGKILL right after that commit.

Test-only faults — things a real part cannot be made to do on demand:

- ``TIDELOG_TEST_TRAINER_DIE=<method>:<before|after>[@N]``: the trainer rank is
  ``tests.support.faulty_trainer.FaultyTrainer`` (named by ``training.trainer.class``), which SIGKILLs
  its own process at that point once per WORKDIR;
- ``TIDELOG_TEST_ENGINE_DIE=<index>:<path>``: on a journal with no job yet, once every engine row
  is ``serving`` and before the first job is submitted, arm the reference engine ``<index>``'s
  ``POST /_test/die_next {path}``, so the first publication's request to ``path`` on that engine
  kills it (before it acts). The harness restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.training import JobConflict, submit_job
from journal import Journal, models, schema

DEPLOYMENT = "dep"
ENGINE_DIE_ENV = "TIDELOG_TEST_ENGINE_DIE"
#: tests.support.faulty_trainer.ENV (that module imports torch: only imported when it is set).
TRAINER_DIE_ENV = "TIDELOG_TEST_TRAINER_DIE"
PAYLOADS = "payloads.json"
#: A safety net for the whole run, not a measure: two jobs take a few seconds alone, but on a
#: two-core machine running the whole suite a run has taken over 90 s (four orchestrators, their
#: trainers and four engines at once, beside the other test worker).
DEADLINE_S = 300.0


def settings(journal_url: str, workdir: str, initial_weights: str, engine_urls: list[str],
             trainer_class: str = "workers.trainer.worker:Trainer") -> Settings:
    return Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 1.0, "lease_renew_s": 0.25, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 0.5},
        "dispatcher": {"poll_s": 0.2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "logging": {"level": "WARNING"},
        "training": {
            "enabled": True, "deployment": DEPLOYMENT, "executor": "mp",
            "trainer": {"class": trainer_class, "seed": 0, "device": "cpu",
                        "state_dir": os.path.join(workdir, "trainer")},
            "checkpoint_dir": os.path.join(workdir, "checkpoints"),
            "weights_dir": os.path.join(workdir, "weights"),
            "initial_weights": initial_weights,
            "train_timeout_s": 60, "call_timeout_s": 60, "retry_after_s": 0.2,
            "publish_retry_after_s": 0.2, "engine_timeout_s": 10, "weight_update_timeout_s": 30,
            "engines": [{"name": f"e{i}", "url": url} for i, url in enumerate(engine_urls)],
        },
    })


def payloads(workdir: str, n: int) -> list[dict[str, Any]]:
    """``payload(salt)`` for salt 0..n-1, read from ``WORKDIR/payloads.json`` when the harness wrote
    it there (building them imports torch, a second and a half of CPU per process), else built."""
    path = Path(workdir) / PAYLOADS
    if path.exists():
        found: list[dict[str, Any]] = json.loads(path.read_text())
        if len(found) >= n:
            return found[:n]
    from tests.support.training import payload
    return [payload(salt) for salt in range(n)]


async def migrate_if_needed(journal_url: str) -> None:
    journal = Journal.open(journal_url)
    try:
        current = await schema.current_revision(journal)
    finally:
        await journal.dispose()
    if current != schema.head_revision():
        # Alembic's env runs its own event loop: not inside this one.
        await asyncio.to_thread(schema.upgrade, journal_url)


async def snapshot(journal: Journal) -> tuple[dict[str, Any], list[Any], str | None]:
    """Jobs by id (state, detail), the engines rows, and the committed head's id."""
    j, e, v = models.training_jobs, models.engines, models.weight_versions
    async with journal.read() as conn:
        jobs = {r.id: r for r in (await conn.execute(sa.select(j.c.id, j.c.state, j.c.detail, j.c.ambiguity)
                                                     .where(j.c.deployment == DEPLOYMENT))).all()}
        engines = list((await conn.execute(sa.select(e.c.id, e.c.state, e.c.serving_version, e.c.detail)
                                           .where(e.c.deployment == DEPLOYMENT))).all())
        head = (await conn.execute(sa.select(v.c.id).where(v.c.deployment == DEPLOYMENT, v.c.state == "committed")
                                   .order_by(v.c.sequence.desc()).limit(1))).scalar()
    return jobs, engines, head


async def arm_engine_death(spec: str, engine_urls: list[str]) -> None:
    index, _, path = spec.partition(":")
    async with aiohttp.ClientSession() as http:
        async with http.post(engine_urls[int(index)] + "/_test/die_next", json={"path": path}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"arming die_next {path} on engine {index}: {resp.status} {await resp.text()}")


async def main(journal_url: str, workdir: str, n: int, initial_weights: str, engine_urls: list[str]) -> int:
    trainer_class = "workers.trainer.worker:Trainer"
    if os.environ.get(TRAINER_DIE_ENV):
        from tests.support import faulty_trainer
        faulty_trainer.parse(os.environ[TRAINER_DIE_ENV])  # a typo fails here, not in the trainer
        trainer_class = faulty_trainer.IMPORT_PATH  # selected as a user selects their own trainer
    jobs = payloads(workdir, n)
    await migrate_if_needed(journal_url)
    orch = Orchestrator(settings(journal_url, workdir, initial_weights, engine_urls, trainer_class))
    await orch.start()
    assert orch.handle("training") is not None
    # Start the trainer process while the lease is won (after a crash it lapses first): the
    # controller's first sync point would start it anyway (and then brings it onto the latest
    # checkpoint whoever started it); this only overlaps the two waits.
    ensure = getattr(orch.handle("training").host, "ensure", None)
    warm = asyncio.create_task(asyncio.to_thread(ensure) if ensure is not None else asyncio.sleep(0))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    succeeded = False
    seen: Any = None

    async def until(check: Any) -> bool:
        nonlocal seen
        while loop.time() < deadline:
            seen = await snapshot(orch.journal)
            if check(*seen):
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        if not await until(lambda *_: orch.is_leader and orch.working()):
            print("never led", file=sys.stderr)
            return 3
        die = os.environ.get(ENGINE_DIE_ENV)
        if die and not seen[0]:
            if not await until(lambda jobs, engines, head: len(engines) == len(engine_urls)
                               and all(r.state == "serving" for r in engines)):
                print(f"engines never served: {seen}", file=sys.stderr)
                return 3
            await arm_engine_death(die, engine_urls)
        for salt, job in enumerate(jobs):
            job_id = None
            while job_id is None:
                try:
                    async with orch.journal.write() as tx:
                        job_id = (await submit_job(tx, DEPLOYMENT, job)).job_id
                except JobConflict:
                    if loop.time() > deadline:
                        print(f"job {salt} conflicted until the deadline: {seen}", file=sys.stderr)
                        return 3
                    await asyncio.sleep(0.1)
            current: str = job_id

            def settled(jobs: dict[str, Any], engines: list[Any], head: str | None) -> bool:
                return jobs[current].state in ("COMPLETE", "FAILED", "REJECTED")
            if not await until(settled):
                print(f"job {salt} ({current[:12]}) did not complete: {seen[0].get(current)}", file=sys.stderr)
                return 3
            if seen[0][current].state != "COMPLETE":
                print(f"job {salt} ({current[:12]}) ended {seen[0][current]}", file=sys.stderr)
                return 4
        if not await until(lambda jobs, engines, head: head is not None and len(engines) == len(engine_urls)
                           and all(r.state == "serving" and r.serving_version == head for r in engines)):
            print(f"the engines do not all serve the head: {seen}", file=sys.stderr)
            return 3
        succeeded = True
        return 0
    finally:
        if succeeded:
            # Everything is committed. The graceful stop is not what this harness tests, and waiting
            # for the trainer process to exit costs about a second and a half per run; it SIGTERMs
            # itself once this process is gone.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        await asyncio.gather(warm, return_exceptions=True)
        await orch.stop()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:])))
