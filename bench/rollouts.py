"""Rollout dispatch rate, and what 10,000 rollouts in flight cost a checkpoint (issue 15).

Participants: ``--procs`` processes of ``bench/_fanout_participants.py`` serving ``--participants``
real kit participants (64 environment, 64 model, 64 agent, 64 resources by default), each its own
aiohttp server on loopback. Every environment server also serves ``POST /run``: the attempt is a kit
episode of one step (boundary, one ``replay`` step, boundary), answered at once, or, for a task with
``"hold": true``, only once the bench releases it.

Per journal backend (a SQLite file in WAL with ``synchronous=FULL``; PostgreSQL on
``TIDELOG_BENCH_POSTGRES_URL`` or 127.0.0.1:5432), an :class:`~engine.runtime.service.Orchestrator`
runs in this process:

**Dispatch** (the orchestrator configured with the 64 environment servers only, and
config.example.yaml's ``rollouts`` bounds: 256 attempts in flight, 32 per environment). Each
round submits ``--rollouts`` one-step rollouts with the API's own write (``check_task`` +
``submit_rollouts``, one transaction) and times from just before that write to the commit of the
last ``finished``: every rollout is a row created, moved to ``dispatched`` with its ``/run`` intent,
claimed, sent once, and its reply recorded as ``finished``. ``rollouts_per_s`` is ``--rollouts``
over that time. Beside it, alternating with it, the **peer**: a journal-less dispatcher in this
process sends the same ``/run`` bodies to the same servers under the same bounds (aiohttp, a
global and a per-server semaphore, the least busy server first); ``peer_rollouts_per_s`` is its
rate and ``ratio_vs_peer`` the quotient. The forget batches that follow (every finished rollout
is forgotten on every participant) are waited for before the next round and reported as
``forgotten_s`` (from the submission), not counted in the rate. Each round checks that every
rollout finished at attempt 0 and that the servers ran exactly ``--rollouts`` attempts.

**Checkpoint** (all 256 participants; ``rollouts.max_in_flight`` 10,000 and room for it in the
data pool and the dispatcher). ``--rounds`` checkpoints with no rollout (after a warm-up one), then
``--in-flight`` ``hold`` rollouts are submitted and dispatched, and once every one is live on its
environment server (``/run`` in flight, its episode in its step), ``--rounds`` more checkpoints:
each from the commit of ``start_checkpoint`` to the commit of ``done`` (prepare, commit of the
journal's scope by every member, publish, resume), checked to continue exactly the rollouts in
flight. ``checkpoint_10k_vs_empty`` is the median with them over the median without. Then the holds
are released and the run waits for every rollout to finish and be forgotten.

Targets (issue 15): ``ratio_vs_peer >= 0.5``, ``rollouts_per_s >= 1000`` (on a quiet machine) and
``checkpoint_10k_vs_empty <= 1.2``. The run ends with one JSON line holding every figure, per
backend under ``sqlite`` and ``postgresql``.

    .venv/bin/python bench/rollouts.py            # both backends, ~6 min
    .venv/bin/python bench/rollouts.py --quick    # SQLite only, one round of each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _databases import Database  # noqa: E402  (bench/, the script's folder)
from checkpoint_fanout import TOKEN, Participants, Server, analyse, config, count, expected_requests, until  # noqa: E402
from engine.config import Settings  # noqa: E402
from engine.runtime.service import Orchestrator  # noqa: E402
from engine.workflows.checkpoint.checkpoint import start_checkpoint  # noqa: E402
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts  # noqa: E402
from journal import Committed, models  # noqa: E402
from journal.writes import to_row  # noqa: E402

RATE_TARGET = 1000.0
RATIO_TARGET = 0.5
CHECKPOINT_TARGET = 1.2
#: config.example.yaml's dispatch bounds.
MAX_IN_FLIGHT = 256
PER_ENVIRONMENT = 32


class Stamps:
    """The journal's commit listener: when each rollout and checkpoint reached each state, and how
    many of the rollouts being watched reached each state (kept as it goes: this runs in the
    orchestrator's process, so it must cost it next to nothing)."""

    def __init__(self) -> None:
        self.rollouts: dict[str, dict[str, float]] = {}
        self.checkpoints: dict[str, dict[str, float]] = {}
        self.watched: set[str] = set()
        self.counts: dict[str, int] = {}
        self.changed = asyncio.Event()

    def watch(self, ids: Sequence[str]) -> None:
        self.watched, self.counts = set(ids), {}

    def __call__(self, committed: Sequence[Committed]) -> None:
        now = time.time()
        for c in committed:
            if c.kind == "rollouts":
                seen = self.rollouts.setdefault(c.entity_id, {})
                if c.to_state not in seen and c.entity_id in self.watched:
                    self.counts[c.to_state] = self.counts.get(c.to_state, 0) + 1
                seen[c.to_state] = now
            elif c.kind == "checkpoints":
                self.checkpoints.setdefault(c.entity_id, {}).setdefault(c.to_state, now)
        self.changed.set()

    def reached(self, state: str) -> int:
        """How many of the watched rollouts reached ``state``."""
        return self.counts.get(state, 0)

    async def wait(self, done: Any, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not done():
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out waiting for {what}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass


class Fleet:
    """The participant processes' admin routes this bench uses."""

    def __init__(self, parts: Participants) -> None:
        self.parts = parts

    async def post(self, path: str) -> None:
        assert self.parts.http is not None
        await asyncio.gather(*(self.parts.http.post(f"{a}{path}") for a in self.parts.admins))

    async def episodes(self) -> tuple[int, int]:
        assert self.parts.http is not None

        async def one(admin: str) -> dict[str, int]:
            async with self.parts.http.get(f"{admin}/episodes") as r:  # type: ignore[union-attr]
                reply: dict[str, int] = orjson.loads(await r.read())
                return reply
        got = await asyncio.gather(*(one(a) for a in self.parts.admins))
        return sum(g["live"] for g in got), sum(g["runs"] for g in got)


# -- the peer ------------------------------------------------------------------------------------

async def peer_round(envs: Sequence[Server], ids: Sequence[str]) -> float:
    """Send one ``/run`` per id, bounded as the orchestrator's dispatch is; the wall time."""
    busy = {s.url: 0 for s in envs}
    total = asyncio.Semaphore(MAX_IN_FLIGHT)
    freed = asyncio.Condition()

    async def one(session: aiohttp.ClientSession, rollout_id: str, i: int) -> None:
        async with total:
            async with freed:
                await freed.wait_for(lambda: min(busy.values()) < PER_ENVIRONMENT)
                url = min(busy, key=busy.__getitem__)
                busy[url] += 1
            try:
                body = orjson.dumps({"rollout_id": rollout_id, "task": {"n": i}})
                async with session.post(f"{url}/run", data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"peer: /run of {rollout_id} answered {r.status}: {raw[:200]!r}")
            finally:
                async with freed:
                    busy[url] -= 1
                    freed.notify()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_IN_FLIGHT),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, rid, i) for i, rid in enumerate(ids)))
        return time.perf_counter() - started


# -- the orchestrator ----------------------------------------------------------------------------

async def submit(orch: Orchestrator, ids: Sequence[str], hold: bool = False) -> None:
    """Submit ``ids`` as the API's ``POST /v1/rollouts`` does (one transaction per 10,000)."""
    for start in range(0, len(ids), 10_000):
        tasks = [check_task({"rollout_id": rid, "input": {"n": start + i, "hold": hold} if hold else {"n": start + i}}, i)
                 for i, rid in enumerate(ids[start:start + 10_000])]

        async def write(tx: Any, tasks: Any = tasks) -> Any:
            return await submit_rollouts(tx, tasks)
        await orch.committer.run(write)


async def settle(orch: Orchestrator, stamps: Stamps, ids: Sequence[str], timeout: float) -> None:
    """Wait until every rollout of ``ids`` is forgotten, and check that each ended at attempt 0."""
    await stamps.wait(lambda: stamps.reached("forgotten") == len(ids), timeout, "every rollout forgotten")
    t = models.rollouts
    wrong = 0
    for i in range(0, len(ids), 500):
        wrong += await count(orch.journal, t, t.c.id.in_(list(ids[i:i + 500])),
                             sa.or_(t.c.attempt != 0, t.c.state != "forgotten"))
    if wrong:
        raise RuntimeError(f"{wrong} rollouts did not end forgotten at attempt 0")


async def dispatch_rounds(backend: str, tmp: Path, parts: Participants, rounds: int, n: int) -> dict[str, Any]:
    fleet = Fleet(parts)
    envs = [s for s in parts.servers if s.kind == "environment"]
    ours: list[dict[str, float]] = []
    theirs: list[float] = []
    async with Database(backend, tmp, "tidelog_rollouts") as url:
        cfg = config(url, envs, tmp / f"ckpts-d-{backend}", control={"token": TOKEN},
                     rollouts={"max_in_flight": MAX_IN_FLIGHT, "per_environment": PER_ENVIRONMENT})
        orch = Orchestrator(Settings.model_validate(cfg))
        stamps = Stamps()
        orch.journal.add_commit_listener(stamps)
        await orch.start()
        try:
            await until(lambda: _healthy(orch, len(envs)), 120, "every environment healthy", every=0.2)
            warm = [f"warm-{backend}-{i:04d}" for i in range(512)]
            await peer_round(envs, [f"peer-warm-{backend}-{i:04d}" for i in range(512)])
            stamps.watch(warm)
            await submit(orch, warm)
            await settle(orch, stamps, warm, 120)
            for r in range(rounds):
                ids = [f"peer-{backend}-{r}-{i:05d}" for i in range(n)]
                peer_s = await peer_round(envs, ids)
                theirs.append(n / peer_s)
                ids = [f"d-{backend}-{r}-{i:05d}" for i in range(n)]
                _, before = await fleet.episodes()
                stamps.watch(ids)
                cpu, commits = time.process_time(), orch.committer.commits
                started = time.time()
                await submit(orch, ids)
                await stamps.wait(lambda: stamps.reached("finished") == n, 600, "every rollout finished")
                wall = max(stamps.rollouts[i]["finished"] for i in ids) - started
                await settle(orch, stamps, ids, 600)
                forgotten = max(stamps.rollouts[i]["forgotten"] for i in ids) - started
                cpu, commits = time.process_time() - cpu, orch.committer.commits - commits
                _, after = await fleet.episodes()
                if after - before != n:
                    raise RuntimeError(f"the servers ran {after - before} attempts for {n} rollouts")
                ours.append({"rollouts_per_s": n / wall, "wall_s": wall, "forgotten_s": forgotten,
                             "cpu_s": cpu, "group_commits": commits})
                print(f"[{backend}] round {r}: tidelog {n / wall:.0f} rollouts/s ({wall:.2f} s; all forgotten "
                      f"at {forgotten:.2f} s; {commits} group commits, {cpu:.2f} s of CPU here); peer "
                      f"{n / peer_s:.0f} rollouts/s ({peer_s:.2f} s)", flush=True)
        finally:
            await orch.stop()
    rate, peer = statistics.median(o["rollouts_per_s"] for o in ours), statistics.median(theirs)
    return {"rollouts_per_s": round(rate, 1), "peer_rollouts_per_s": round(peer, 1),
            "ratio_vs_peer": round(rate / peer, 3),
            "dispatch_wall_s": round(statistics.median(o["wall_s"] for o in ours), 3),
            "forgotten_s": round(statistics.median(o["forgotten_s"] for o in ours), 3),
            "dispatch_cpu_s": round(statistics.median(o["cpu_s"] for o in ours), 3),
            "dispatch_group_commits": int(statistics.median(o["group_commits"] for o in ours)),
            "rate_target_met": rate >= RATE_TARGET, "ratio_target_met": rate / peer >= RATIO_TARGET}


async def _healthy(orch: Orchestrator, n: int) -> bool:
    return await count(orch.journal, models.participants, models.participants.c.state == "healthy") == n


async def checkpoint_rounds(backend: str, tmp: Path, parts: Participants, rounds: int, n: int) -> dict[str, Any]:
    fleet = Fleet(parts)
    envs = sum(1 for s in parts.servers if s.kind == "environment")
    directory = tmp / f"ckpts-{backend}"
    async with Database(backend, tmp, "tidelog_rollouts") as url:
        room = max(n, MAX_IN_FLIGHT)
        cfg = config(url, parts.servers, directory, control={"token": TOKEN},
                     rollouts={"max_in_flight": room, "per_environment": -(-room // envs)},
                     rpc={"data_pool": room}, dispatcher={"data_concurrency": room})
        orch = Orchestrator(Settings.model_validate(cfg))
        stamps = Stamps()
        orch.journal.add_commit_listener(stamps)
        await orch.start()
        try:
            await until(lambda: _healthy(orch, len(parts.servers)), 120, "every participant healthy", every=0.2)
            async with orch.journal.read() as conn:
                rows = [to_row("participants", r._mapping)
                        for r in (await conn.execute(sa.select(models.participants))).all()]

            kinds, expected = parts.kind_of(), expected_requests(parts.servers)
            phases: dict[str, list[dict[str, float]]] = {}
            split: dict[str, dict[str, Any]] = {}

            async def one(cid: str, scoped: int) -> float:
                await parts.reset()

                async def begin(tx: Any) -> None:
                    await start_checkpoint(tx, cid, str(directory), rows)
                await orch.committer.run(begin)
                await stamps.wait(lambda: any(s in stamps.checkpoints.get(cid, {}) for s in ("done", "aborted", "failed")),
                                  300, f"checkpoint {cid}")
                if "done" not in stamps.checkpoints[cid]:
                    raise RuntimeError(f"checkpoint {cid} did not end done: {sorted(stamps.checkpoints[cid])}")
                t = models.checkpoints
                async with orch.journal.read() as conn:
                    kept = (await conn.execute(sa.select(t.c.rollouts).where(t.c.id == cid))).scalar_one()
                continued = len((kept or {}).get("continued", []))
                if continued != scoped:
                    raise RuntimeError(f"checkpoint {cid} continues {continued} rollouts, not {scoped}")
                began, ended = stamps.checkpoints[cid]["preparing"], stamps.checkpoints[cid]["done"]
                log = await parts.log()
                phases[cid] = steps(log, kinds, began)
                split[cid] = analyse(began, ended, log, kinds, expected)
                return ended - began

            await one(f"warm-{backend}", 0)
            empty = [await one(f"empty-{backend}-{r}", 0) for r in range(rounds)]
            await fleet.post("/hold")
            ids = [f"held-{backend}-{i:05d}" for i in range(n)]
            stamps.watch(ids)
            started = time.time()
            await submit(orch, ids, hold=True)
            await stamps.wait(lambda: stamps.reached("dispatched") == n, 600, "every rollout dispatched")

            async def live() -> bool:
                return (await fleet.episodes())[0] == n
            await until(live, 600, f"{n} episodes live", every=0.2)
            loaded_after = time.time() - started
            full = [await one(f"full-{backend}-{r}", n) for r in range(rounds)]
            await fleet.post("/release")
            await stamps.wait(lambda: stamps.reached("finished") == n, 600, "every held rollout finished")
            await settle(orch, stamps, ids, 900)
            for r, (e, f) in enumerate(zip(empty, full)):
                print(f"[{backend}] checkpoint {r}: none in flight {e:.3f} s; {n} in flight {f:.3f} s", flush=True)
                for label in (f"empty-{backend}-{r}", f"full-{backend}-{r}"):
                    print(f"[{backend}]   {label}: " + "; ".join(
                        f"{s['step']} at {s['first_s']:.2f}-{s['last_s']:.2f} s (slowest {s['handling_s']:.3f} s)"
                        for s in phases[label]), flush=True)
        finally:
            await fleet.post("/release")
            await orch.stop()
    e, f = statistics.median(empty), statistics.median(full)

    def median(prefix: str, key: str) -> float:
        return statistics.median(v[key] for k, v in split.items() if k.startswith(prefix))
    own_e, own_f = median(f"empty-{backend}", "own_work_s"), median(f"full-{backend}", "own_work_s")
    over_e, over_f = median(f"empty-{backend}", "overhead_s"), median(f"full-{backend}", "overhead_s")
    print(f"[{backend}] checkpoint of {len(parts.servers)} participants: {e:.3f} s with none in flight, {f:.3f} s "
          f"with {n} ({f / e:.2f}x; target <= {CHECKPOINT_TARGET}x); {n} dispatched and live in "
          f"{loaded_after:.1f} s", flush=True)
    print(f"[{backend}] of which the participants' own work (slowest handler per step, summed): {own_e:.3f} s "
          f"and {own_f:.3f} s; the rest (the orchestrator, the wire, waiting for the loop): {over_e:.3f} s and "
          f"{over_f:.3f} s ({over_f / over_e:.2f}x)", flush=True)
    return {"checkpoint_empty_s": round(e, 3), "checkpoint_10k_s": round(f, 3),
            "checkpoint_10k_vs_empty": round(f / e, 3), "in_flight_dispatched_live_s": round(loaded_after, 2),
            "checkpoint_own_work_empty_s": round(own_e, 3), "checkpoint_own_work_10k_s": round(own_f, 3),
            "checkpoint_overhead_empty_s": round(over_e, 3), "checkpoint_overhead_10k_s": round(over_f, 3),
            "checkpoint_overhead_10k_vs_empty": round(over_f / over_e, 3),
            "checkpoint_target_met": f / e <= CHECKPOINT_TARGET}


def steps(log: Sequence[list[Any]], kinds: dict[str, str], started: float) -> list[dict[str, Any]]:
    """Per control operation and kind, from the participants' request log: when its first request
    arrived and its last reply left (seconds from ``started``) and the slowest handler."""
    groups: dict[tuple[str, str], list[list[Any]]] = {}
    for name, op, arrived, finished, _status in log:
        if finished is not None and op in ("prepare", "commit", "resume"):
            groups.setdefault((op, kinds[name]), []).append([arrived, finished])
    out = [{"step": f"{op} {kind}", "first_s": min(r[0] for r in recs) - started,
            "last_s": max(r[1] for r in recs) - started, "handling_s": max(r[1] - r[0] for r in recs)}
           for (op, kind), recs in groups.items()]
    return sorted(out, key=lambda s: s["first_s"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": f"{platform.machine()} {os.cpu_count()} cpu",
                               "python": platform.python_version(), "participants": args.participants,
                               "rollouts": args.rollouts, "in_flight": args.in_flight, "rounds": args.rounds,
                               "targets": {"rollouts_per_s": RATE_TARGET, "ratio_vs_peer": RATIO_TARGET,
                                           "checkpoint_10k_vs_empty": CHECKPOINT_TARGET}}
    with tempfile.TemporaryDirectory(prefix="tidelog-rollouts-") as raw:
        tmp = Path(raw)
        parts = Participants(tmp, args.participants, args.procs, 0)
        try:
            await parts.start()
            print(f"{len(parts.servers)} participants in {args.procs} processes", flush=True)
            for backend in args.backends:
                figures[backend] = await dispatch_rounds(backend, tmp, parts, args.rounds, args.rollouts)
                figures[backend] |= await checkpoint_rounds(backend, tmp, parts, args.rounds, args.in_flight)
                print(f"[{backend}] {json.dumps(figures[backend])}", flush=True)
        finally:
            await parts.stop()
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--participants", type=int, default=256, help="a quarter of them environment servers")
    p.add_argument("--procs", type=int, default=4, help="participant processes")
    p.add_argument("--rollouts", type=int, default=10_000, help="one-step rollouts per dispatch round")
    p.add_argument("--in-flight", type=int, default=10_000, help="rollouts in flight during the loaded checkpoints")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each measurement per backend (median kept)")
    p.add_argument("--backends", nargs="*", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--quick", action="store_true", help="SQLite only, one round of each")
    args = p.parse_args()
    if args.quick:
        args.backends, args.rounds = ["sqlite"], 1
    figures = asyncio.run(run(args))
    figures["args"] = vars(args)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
