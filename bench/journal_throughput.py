"""Durable transitions per second: Tidelog's journal against DBOS 3.x on the same database kind.

Figures, per backend (SQLite file in WAL with synchronous=FULL; PostgreSQL on
``TIDELOG_BENCH_POSTGRES_URL`` or 127.0.0.1:5432):

- ``tidelog_sequential``: one entity, ``--seq`` transitions, each its own fenced
  transaction (compare-and-set + event + lease check), one after another — the
  cost of one durable step — written with ``Journal.apply`` (what controllers
  use through ``ctx.apply``); ``tidelog_sequential_interactive`` does the same
  through ``async with journal.write(fence)`` (read-decide-write transactions).
- ``tidelog_concurrent``: ``--entities`` entities advancing ``--steps`` steps each
  through the real reconciler (level-triggered controller, de-duplicating queue,
  group commit); every transition is still its own compare-and-set with its own
  event, and each entity's steps are sequential (one commit each).
- ``dbos_sequential``: one DBOS workflow of ``--seq`` sequential no-op steps.
- ``dbos_concurrent``: ``--dbos-workflows`` one-step DBOS workflows at the DBOS
  concurrency that was fastest among ``--dbos-concurrency`` values.

Ratios: ``sequential_ratio = tidelog_sequential / dbos_sequential`` (target >= 3)
and ``concurrent_ratio = tidelog_concurrent / dbos_concurrent`` (target >= 30).
The run ends with one JSON line holding every figure and ratio.

    make bench            # or: .venv/bin/python bench/journal_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _dbos_peer import measure as measure_dbos  # noqa: E402

from engine.runtime.clock import SystemClock  # noqa: E402
from engine.runtime.committer import GroupCommitter  # noqa: E402
from engine.runtime.reconciler import BaseController, Context, Reconciler, Result  # noqa: E402
from journal import EntityKind, Journal, StateMachine, Transition, lease, schema  # noqa: E402
from journal.models import entity_columns  # noqa: E402

KIND = "bench_items"
metadata = sa.MetaData()
table = sa.Table(KIND, metadata, *entity_columns(), sa.Column("n", sa.Integer, nullable=False, default=0))
MACHINE = StateMachine.build(KIND, initial=["run"], edges={"run": ["run", "done"]}, terminal=["done"])


async def open_bench_journal(url: str) -> Journal:
    await asyncio.to_thread(schema.upgrade, url)
    journal = Journal.open(url, pool_size=10)
    journal.kinds.register(EntityKind(KIND, table, MACHINE))
    async with journal.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    return journal


async def tidelog_sequential(url: str, n: int, interactive: bool) -> float:
    """``n`` fenced transitions of one entity, one transaction each.

    ``interactive=False`` uses ``Journal.apply`` (the declarative write controllers
    make through ``ctx.apply``); ``True`` uses ``async with journal.write(fence)``
    and ``tx.transition`` (the read-decide-write transaction).
    """
    journal = await open_bench_journal(url)
    try:
        held = await lease.acquire(journal, "orchestrator", "bench", 3600)
        assert held is not None
        fence = held.fence()
        async with journal.write(fence) as tx:
            await tx.create(KIND, "seq", reason="bench", values={"n": 0})
        version = 1

        async def step(i: int) -> None:
            op = Transition(KIND, "seq", "run", version, "run", "step", {"n": i})
            if interactive:
                async with journal.write(fence) as tx:
                    await tx.apply([op])
            else:
                (outcome,) = await journal.apply([[op]], fence)
                if isinstance(outcome, Exception):
                    raise outcome

        for i in range(20):  # warm-up, not timed
            await step(i + 1)
            version += 1
        started = time.perf_counter()
        for i in range(n):
            await step(i + 21)
            version += 1
        elapsed = time.perf_counter() - started
        async with journal.read() as conn:
            final = (await conn.execute(sa.select(table.c.n, table.c.version))).one()
        assert tuple(final) == (n + 20, n + 21), f"lost transitions: {tuple(final)}"
        return n / elapsed
    finally:
        await journal.dispose()


class StepController(BaseController):
    """Advance ``n`` by one per reconcile until it reaches ``steps``, then finish."""

    kind = KIND

    def __init__(self, steps: int, done: asyncio.Event, total: int) -> None:
        self.steps = steps
        self.done = done
        self.remaining = total

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state == "done":
            return Result()
        n = row["n"]
        to = "done" if n + 1 >= self.steps else "run"

        await ctx.apply(Transition(KIND, entity_id, row.state, row.version, to, "step", {"n": n + 1}))
        if to == "done":
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()
        return Result()


async def tidelog_concurrent(url: str, entities: int, steps: int, concurrency: int) -> float:
    journal = await open_bench_journal(url)
    try:
        held = await lease.acquire(journal, "orchestrator", "bench", 3600)
        assert held is not None
        ids = [f"e{i:06d}" for i in range(entities)]
        async with journal.write(held.fence()) as tx:
            for entity_id in ids:
                await tx.create(KIND, entity_id, reason="bench", values={"n": 0})
        clock = SystemClock()
        committer = GroupCommitter(journal, held.fence, max_batch=512)
        reconciler = Reconciler(journal, committer, clock, concurrency=concurrency, resync_interval_s=3600)
        done = asyncio.Event()
        reconciler.register(StepController(steps, done, entities))
        journal.add_commit_listener(reconciler.on_commit)
        started = time.perf_counter()
        runner = asyncio.create_task(reconciler.run())
        await asyncio.wait_for(done.wait(), timeout=600)
        elapsed = time.perf_counter() - started
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await committer.close()
        async with journal.read() as conn:
            finished = (await conn.execute(sa.select(sa.func.count()).select_from(table)
                                           .where(table.c.state == "done", table.c.n == steps))).scalar()
        assert finished == entities, f"only {finished} of {entities} entities finished"
        return entities * steps / elapsed
    finally:
        await journal.dispose()


# -- databases --------------------------------------------------------------------------------

def pg_admin_url() -> str:
    return os.environ.get("TIDELOG_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def pg_create() -> str:
    name = f"tidelog_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(pg_admin_url())
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return name


async def pg_drop(name: str) -> None:
    conn = await asyncpg.connect(pg_admin_url())
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def pg_url(name: str, driver: str) -> str:
    base = sa.make_url(pg_admin_url()).set(drivername=driver, database=name)
    return base.render_as_string(hide_password=False)


async def with_database(backend: str, tmp: Path, fn: Any, *args: Any) -> Any:
    """Run ``fn(url, *args)`` on a fresh database of ``backend``; drop it afterwards."""
    if backend == "sqlite":
        path = tmp / f"{uuid.uuid4().hex[:8]}.db"
        return await fn(f"sqlite+aiosqlite:///{path}", *args)
    name = await pg_create()
    try:
        return await fn(pg_url(name, "postgresql+asyncpg"), *args)
    finally:
        await pg_drop(name)


async def dbos_figures(backend: str, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    best: dict[str, Any] = {}
    for concurrency in args.dbos_concurrency:
        if backend == "sqlite":
            url = f"sqlite:///{tmp / (uuid.uuid4().hex[:8] + '-dbos.sqlite')}"
            got = await asyncio.to_thread(measure_dbos, backend, url, seq_steps=args.seq,
                                          n_workflows=args.dbos_workflows, concurrency=concurrency)
        else:
            name = await pg_create()
            try:
                got = await asyncio.to_thread(measure_dbos, backend, pg_url(name, "postgresql"),
                                              seq_steps=args.seq, n_workflows=args.dbos_workflows,
                                              concurrency=concurrency)
            finally:
                await pg_drop(name)
        if not best or got["concurrent_workflows_per_s"] > best["concurrent_workflows_per_s"]:
            best = {**got, "concurrency": concurrency}
        best["sequential_steps_per_s"] = max(best["sequential_steps_per_s"], got["sequential_steps_per_s"])
    return {"dbos_sequential": float(best["sequential_steps_per_s"]),
            "dbos_concurrent": float(best["concurrent_workflows_per_s"]),
            "dbos_best_concurrency": float(best["concurrency"]), "dbos_version": best["dbos_version"]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": f"{platform.machine()} {os.cpu_count()} cpu",
                               "python": platform.python_version()}
    with tempfile.TemporaryDirectory(prefix="tidelog-bench-") as raw:
        tmp = Path(raw)
        for backend in args.backends:
            print(f"== {backend}", flush=True)
            seq = await with_database(backend, tmp, tidelog_sequential, args.seq, False)
            print(f"tidelog sequential: {seq:10.0f} transitions/s (Journal.apply)", flush=True)
            seq_tx = await with_database(backend, tmp, tidelog_sequential, args.seq, True)
            print(f"tidelog sequential: {seq_tx:10.0f} transitions/s (journal.write + tx.transition)", flush=True)
            conc = await with_database(backend, tmp, tidelog_concurrent, args.entities, args.steps,
                                       args.concurrency)
            print(f"tidelog concurrent: {conc:10.0f} transitions/s "
                  f"({args.entities} entities x {args.steps} steps)", flush=True)
            dbos = await dbos_figures(backend, tmp, args)
            print(f"dbos    sequential: {dbos['dbos_sequential']:10.0f} steps/s", flush=True)
            print(f"dbos    concurrent: {dbos['dbos_concurrent']:10.0f} one-step workflows/s "
                  f"(best concurrency {dbos['dbos_best_concurrency']:.0f})", flush=True)
            seq_ratio = seq / dbos["dbos_sequential"]
            conc_ratio = conc / dbos["dbos_concurrent"]
            print(f"ratio sequential {seq_ratio:.1f}x (target >= 3; interactive {seq_tx / dbos['dbos_sequential']:.1f}x), "
                  f"concurrent {conc_ratio:.1f}x (target >= 30)", flush=True)
            figures[backend] = {"tidelog_sequential": round(seq, 1), "tidelog_sequential_interactive": round(seq_tx, 1),
                                "tidelog_concurrent": round(conc, 1),
                                **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in dbos.items()},
                                "sequential_ratio": round(seq_ratio, 2),
                                "sequential_interactive_ratio": round(seq_tx / dbos["dbos_sequential"], 2),
                                "concurrent_ratio": round(conc_ratio, 2),
                                "sequential_target_met": seq_ratio >= 3, "concurrent_target_met": conc_ratio >= 30}
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--seq", type=int, default=2000, help="sequential transitions (and DBOS steps)")
    p.add_argument("--entities", type=int, default=2000, help="entities advancing concurrently")
    p.add_argument("--steps", type=int, default=10, help="steps per entity")
    p.add_argument("--concurrency", type=int, default=256, help="reconciler concurrency")
    p.add_argument("--dbos-workflows", type=int, default=2000, help="one-step DBOS workflows")
    p.add_argument("--dbos-concurrency", type=int, nargs="+", default=[8, 32],
                   help="DBOS concurrency levels to try (the best is kept)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = p.parse_args()
    if args.quick:
        args.seq, args.entities, args.steps, args.dbos_workflows = 300, 300, 5, 300
        args.dbos_concurrency = [8]
    figures = asyncio.run(run(args))
    figures["args"] = {k: v for k, v in vars(args).items()}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
