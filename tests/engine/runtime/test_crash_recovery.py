"""Crash recovery: SIGKILL the orchestrator right after every named commit, restart, check.

A subprocess runs two pipelines of five remote steps each (``tests/support/pipeline.py``)
against a real aiohttp server that applies every idempotency key once and counts calls.
A clean run tells which crash hooks the workflow passes through; the harness then
kills the worker at each of them in turn (every one the machines define that the run
reaches, enumerated from the machines, not picked by hand), restarts it, and checks:
the run finishes, every step's effect was applied exactly once, nothing is left in
flight, and folding the events gives the final rows.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import sqlalchemy as sa

from engine.runtime.crash import ENV, hook_names
from journal import Journal, audit, machines, models
from tests.support import pipeline
from tests.support.counting_server import CountingServer
from tests.support.databases import PostgresServer, migrate, sqlite_url
from tests.support.zygote import shared

PIPELINES = ["p-a", "p-b"]
pytestmark = pytest.mark.slow


async def run_worker(journal_url: str, target: str, crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if crash_at is not None:
        env[ENV] = crash_at
    code, _, err = await shared().communicate("tests.support.pipeline_worker", [journal_url, target], env=env,
                                              timeout=60)
    if code not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {code}:\n{err.decode()[-3000:]}")
    return code


async def seed(journal_url: str) -> Journal:
    journal = Journal.open(journal_url)
    pipeline.register(journal)
    await pipeline.install(journal)
    async with journal.write() as tx:
        for name in PIPELINES:
            await tx.create(pipeline.KIND, name, reason="seeded by the test", values={"results": []})
    return journal


async def edges_taken(journal: Journal) -> set[str]:
    e = models.events
    async with journal.read() as conn:
        rows = (await conn.execute(sa.select(e.c.entity_kind, e.c.from_state, e.c.to_state)
                                   .where(e.c.entity_kind.in_([pipeline.KIND, "rpc_calls"])))).all()
    return {f"{k}:created:{b}" if a is None else f"{k}:{a}->{b}" for k, a, b in rows}


async def check_invariants(journal: Journal, server: CountingServer) -> None:
    t = pipeline.table
    async with journal.read() as conn:
        states = dict((await conn.execute(sa.select(t.c.id, t.c.state))).all())
        open_calls = (await conn.execute(sa.select(sa.func.count()).select_from(models.rpc_calls)
                                         .where(models.rpc_calls.c.state != "succeeded"))).scalar()
    assert states == {name: "done" for name in PIPELINES}
    assert open_calls == 0
    # Every step of every pipeline was applied exactly once, whatever was re-sent.
    applied = sorted((e["pipeline"], e["step"]) for e in server.effects)
    assert applied == sorted((p, k) for p in PIPELINES for k in range(pipeline.STEPS))
    assert len(server.applied) == len(PIPELINES) * pipeline.STEPS
    assert await audit.verify(journal) == []


async def one_run(journal_url: str, crash_at: str | None) -> tuple[set[str], CountingServer, list[int]]:
    server = CountingServer()
    target = await server.start()
    journal = await seed(journal_url)
    codes = []
    try:
        codes.append(await run_worker(journal_url, target, crash_at))
        if codes[-1] != 0:
            codes.append(await run_worker(journal_url, target, None))
        assert codes[-1] == 0
        await check_invariants(journal, server)
        return await edges_taken(journal), server, codes
    finally:
        await journal.dispose()
        await server.stop()


async def new_journal_url(backend: str, request: pytest.FixtureRequest, path: Path) -> str:
    """Another fresh migrated journal on the same backend (one per crash run)."""
    if backend == "sqlite":
        url = sqlite_url(path)
        await asyncio.to_thread(migrate, url)
        return url
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = await asyncio.to_thread(server.create_migrated)
    request.addfinalizer(lambda: server.drop_later(name))
    return server.url_for(name)


async def test_every_crash_point_recovers(backend: str, request: pytest.FixtureRequest,
                                          tmp_path: Path) -> None:
    # A clean run first: which hooks does the workflow pass through?
    clean_url: str = request.getfixturevalue("journal_url")
    reached, clean_server, codes = await one_run(clean_url, None)
    assert codes == [0]
    assert max(clean_server.calls.values()) == 1  # nothing re-sent without a crash

    every_hook = hook_names([pipeline.machine(), machines.RPC_CALLS])
    targets = [h for h in every_hook if h in reached and not h.startswith(f"{pipeline.KIND}:created")]
    # The clean run must pass through every pipeline edge on the happy path and the
    # outbox's pending -> inflight -> succeeded; the rest are failure edges.
    assert len(targets) >= pipeline.STEPS + 3
    unreached = sorted(set(every_hook) - reached)
    assert all("failed" in h or "ambiguous" in h or "inflight->pending" in h for h in unreached), unreached

    # Repeated hooks are also hit mid-run (their third occurrence), not only the first time.
    points = targets + [f"{h}@3" for h in targets if h.startswith("rpc_calls:")]
    for n, point in enumerate(points):
        url = await new_journal_url(backend, request, tmp_path / f"run-{n}.db")
        _, server, codes = await one_run(url, point)
        assert codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({codes})"
        # Re-sent calls reuse their idempotency key; the server applied each once.
        assert all(n >= 1 for n in server.calls.values())
