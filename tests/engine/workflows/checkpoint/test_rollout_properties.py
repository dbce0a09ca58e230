"""Rollout and checkpoint invariants over random sequences of operations, with real processes.

In the spirit of the upstream "checkpoint invariants over random sequences of operations": each
example draws a sequence (from a seed) of submit, checkpoint, participant crash (every participant
SIGKILLed and started again on the same state directories, then the latest checkpoint restored),
orchestrator crash (``tidelog serve`` SIGKILLed and started again), retire (an operator's retire of
a live rollout, then its forget) and finish (wait until every rollout is done and forgotten), against
the four reference participants and a ``tidelog serve`` on one journal. After every step:

- no rollout lost: every submitted rollout has its row, and none is stuck (each is live, done, or,
  after a finish, forgotten);
- no attempt run twice: no attempt's ``/run`` was sent twice (one whose connection was never made
  sent nothing), and no environment process ran a step of one attempt twice;
- no commit holds an attempt retired before it (docs/audit.md's query);
- every published checkpoint is restorable: its manifest resolves and every member's manifest file
  is where it says;
- retire marks are bounded by live rollouts: no participant holds more than the rollouts not yet
  forgotten; after a finish, none;
- ``audit.verify`` is clean.

``make test`` runs ``TIDELOG_PROPERTY_EXAMPLES`` (default 2) seeds per backend from
``TIDELOG_PROPERTY_SEED`` (default 1); a failure names the seed and the steps so far, and
``TIDELOG_PROPERTY_SEED=<seed> TIDELOG_PROPERTY_EXAMPLES=1`` replays it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from engine.workflows.checkpoint.restore import resolve_checkpoint
from journal import Journal, audit, models
from tests.engine.runtime.test_crash_recovery import new_journal_url
from tests.engine.workflows.checkpoint.test_api_checkpoints import call
from tests.engine.workflows.checkpoint.test_rollout_dispatch import config
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, Stack, start_stack
from engine.demos.ports import free_port
from tests.support.workflows import audit_rows, controller, procs, state_dirs, until  # noqa: F401 - fixtures
from tests.support.zygote import Child, shared
from workers.protocol import EpisodeId

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[4]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("TIDELOG_PROPERTY_EXAMPLES", "2"))
FIRST_SEED = int(os.environ.get("TIDELOG_PROPERTY_SEED", "1"))
STEPS = 7
OPS = ("submit", "submit", "checkpoint", "checkpoint", "participants", "orchestrator", "retire", "finish")


class World:
    """The processes, the journal and what the test has done to them."""

    def __init__(self, journal_url: str, procs: Procs, c: ParticipantClient, tmp: Path) -> None:
        self.journal_url, self.procs, self.c, self.tmp = journal_url, procs, c, tmp
        self.dirs = state_dirs(tmp / "state")
        self.ckpts = tmp / "ckpts"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.stack: Stack | None = None
        self.serve: Child | None = None
        self.submitted: dict[str, dict[str, Any]] = {}
        self.published: list[str] = []
        self.retired: set[str] = set()
        self.ran: list[dict[str, dict[str, int]]] = []  # environment executions of killed processes
        self.lives = 0

    async def start_stack(self) -> None:
        self.stack = await start_stack(self.procs, self.dirs, env_delay=0.05)

    def config(self) -> Path:
        assert self.stack is not None
        cfg = config(self.journal_url, self.stack, max_in_flight=16, per_environment=16)
        cfg["api"] = {"host": "127.0.0.1", "port": self.port}
        cfg["checkpoint"] = {**cfg["checkpoint"], "directory": str(self.ckpts), "prepare_timeout_s": 10}
        cfg["discovery"] = {**cfg["discovery"], "interval_s": 2}
        path = self.tmp / "tidelog.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    async def start_serve(self) -> None:
        self.lives += 1
        env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
        log = self.tmp / f"serve-{self.lives}.log"
        self.serve = shared().spawn("engine.cli", ["--config", str(self.config()), "serve"], env=env, cwd=ROOT,
                                    stdout=log, stderr=log)

        async def up() -> bool:
            try:
                status, body = await call("GET", f"{self.base}/readyz")
                if not (status == 200 and body.get("leader")):
                    return False
                status, body = await call("GET", f"{self.base}/v1/participants")
            except OSError:
                return False
            return status == 200 and sum(p["health"] == "healthy" for p in body["participants"]) == len(KINDS)
        await until(up, 60)

    def kill_serve(self) -> None:
        assert self.serve is not None
        self.serve.kill()
        self.serve.wait()

    async def kill_stack(self) -> None:
        assert self.stack is not None
        self.ran.append((await self.c.status(self.stack.url("environment")))["executions"])
        self.stack.kill()

    async def rows(self) -> dict[str, dict[str, Any]]:
        journal = Journal.open(self.journal_url)
        try:
            async with journal.read() as conn:
                return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(models.rollouts))).all()}
        finally:
            await journal.dispose()

    # -- operations -------------------------------------------------------------------------------

    async def submit(self, rng: random.Random) -> str:
        tasks = {f"r{len(self.submitted) + i:03d}": {"prompt": f"task {len(self.submitted) + i}",
                                                     "turns": rng.randint(1, 3)} for i in range(rng.randint(3, 8))}
        status, body = await call("POST", f"{self.base}/v1/rollouts", headers=AUTH, json={"tasks": [
            {"rollout_id": k, "input": v} for k, v in tasks.items()]})
        assert status == 201, body
        self.submitted.update(tasks)
        return f"submit {len(tasks)}"

    async def checkpoint(self, rng: random.Random) -> str:
        status, body = await call("POST", f"{self.base}/v1/checkpoints", headers=AUTH, json={})
        if status == 409:  # a restore or checkpoint open, or a participant not healthy: refused, typed
            return f"checkpoint refused: {body['error']['code']}"
        assert status == 202, body
        cid = body["checkpoint_id"]

        async def ended() -> dict[str, Any] | None:
            _, row = await call("GET", f"{self.base}/v1/checkpoints/{cid}")
            return row if row.get("state") in ("done", "aborted", "failed") else None
        row: dict[str, Any] = await until(ended, 60)
        if row["state"] == "done":
            self.published.append(cid)
        return f"checkpoint {row['state']} ({len(row['scope'] or [])} in scope)"

    async def participants(self, rng: random.Random) -> str:
        await self.kill_stack()
        self.kill_serve()  # participants on new ports: the next orchestrator is configured with them
        await self.start_stack()
        await self.start_serve()
        if not self.published:
            return "participants crashed (nothing to restore)"
        status, body = await call("POST", f"{self.base}/v1/restores", headers=AUTH, json={})
        assert status == 202, body

        async def ended() -> dict[str, Any] | None:
            _, row = await call("GET", f"{self.base}/v1/restores/{body['restore_id']}")
            return row if row.get("state") in ("done", "failed") else None
        row: dict[str, Any] = await until(ended, 60)
        assert row["state"] == "done", row
        return f"participants crashed, {body['checkpoint_id']} restored ({body['episodes']} episodes)"

    async def orchestrator(self, rng: random.Random) -> str:
        self.kill_serve()
        await self.start_serve()
        return "orchestrator crashed"

    async def retire(self, rng: random.Random) -> str:
        live = sorted(rid for rid, r in (await self.rows()).items() if r["state"] == "dispatched")
        if not live:
            return "retire: nothing in flight"
        rid = rng.choice(live)
        attempt = (await self.rows())[rid]["attempt"]
        status, body = await call("POST", f"{self.base}/v1/rollouts/{rid}/retire", headers=AUTH,
                                  json={"attempt": attempt})
        assert status == 202, body
        self.retired.add(rid)
        return f"retire {rid} attempt {attempt}"

    async def finish(self, rng: random.Random) -> str:
        async def done() -> bool:
            rows = await self.rows()
            for rid in self.retired:  # an operator's retire: the operator forgets it once it is retired
                if rows.get(rid, {}).get("state") == "retired":
                    await call("POST", f"{self.base}/v1/rollouts/{rid}/forget", headers=AUTH)
            return all(rows.get(rid, {}).get("state") == "forgotten" for rid in self.submitted)
        await until(done, 120)
        return "finish"

    # -- invariants -------------------------------------------------------------------------------

    async def check(self, finished: bool) -> None:
        journal = Journal.open(self.journal_url)
        try:
            async with journal.read() as conn:
                rows = {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(models.rollouts))).all()}
                t = models.rpc_calls
                calls = [dict(r._mapping) for r in (await conn.execute(sa.select(t).where(t.c.path == "/run"))).all()]
            assert await audit.verify(journal) == []
            assert await audit_rows(journal, "commits-including-retired-attempts") == []
        finally:
            await journal.dispose()
        # No rollout lost.
        assert set(self.submitted) <= set(rows), sorted(set(self.submitted) - set(rows))
        if finished:
            assert {rid: rows[rid]["state"] for rid in self.submitted} == dict.fromkeys(self.submitted, "forgotten")
            for rid in set(self.submitted) - self.retired:
                assert rows[rid]["result"]["attempt"] == rows[rid]["attempt"], rows[rid]
        # No attempt run twice: sent once, and no step of one attempt run twice in one process.
        sent = [call["body"]["rollout_id"] for call in calls
                if not (call["state"] == "failed" and (call["error"] or {}).get("sent") is False)]
        assert len(sent) == len(set(sent)), sorted(k for k in sent if sent.count(k) > 1)
        assert self.stack is not None
        current = (await self.c.status(self.stack.url("environment")))["executions"]
        for executions in [*self.ran, current]:
            twice = {k: s for k, steps in executions.items() for s, n in steps.items() if n > 1}
            assert not twice, twice
        # Every published checkpoint is restorable.
        for cid in self.published:
            checkpoint_id, scope = await asyncio.to_thread(resolve_checkpoint, str(self.ckpts), cid)
            manifest = json.loads((self.ckpts / cid / "checkpoint.json").read_text())
            assert checkpoint_id == cid and all(EpisodeId.from_capture_key(k) for k in scope)
            for name, member in manifest["members"].items():
                assert member["manifest"]["checkpoint_id"] == cid, (cid, name)
        # Retire marks bounded by the rollouts still live (not forgotten); none once all are done.
        live = sum(r["state"] != "forgotten" for r in rows.values())
        for kind in KINDS:
            marks = (await self.c.status(self.stack.url(kind)))["retired_rollouts"]
            assert marks <= live and (marks == 0 or not finished), (kind, marks, live)


async def run_example(journal_url: str, procs: Procs, c: ParticipantClient, tmp: Path, seed: int) -> None:
    rng = random.Random(seed)
    world = World(journal_url, procs, c, tmp)
    steps: list[str] = []
    try:
        await world.start_stack()
        await world.start_serve()
        steps.append(await world.submit(rng))
        await world.check(False)
        for _ in range(STEPS):
            op = rng.choice(OPS)
            steps.append(await getattr(world, op)(rng))
            await world.check(False)
        steps.append(await world.finish(rng))
        await world.check(True)
        print(f"seed {seed}: {steps}")
    except BaseException as exc:
        raise AssertionError(f"seed {seed} failed after steps {steps}: {exc!r} (replay with "
                             f"TIDELOG_PROPERTY_SEED={seed} TIDELOG_PROPERTY_EXAMPLES=1)") from exc
    finally:
        if world.serve is not None and world.serve.poll() is None:
            world.kill_serve()
        if world.stack is not None:
            world.stack.kill()


async def test_rollout_invariants_hold_over_random_sequences_of_operations(
        backend: str, request: pytest.FixtureRequest, procs: Procs, controller: ParticipantClient,
        tmp_path: Path) -> None:
    for seed in range(FIRST_SEED, FIRST_SEED + EXAMPLES):
        url = await new_journal_url(backend, request, tmp_path / f"seed-{seed}.db")
        (tmp_path / f"seed-{seed}").mkdir()
        await run_example(url, procs, controller, tmp_path / f"seed-{seed}", seed)
