"""Helpers for the checkpoint workflows run through the whole orchestrator against real participants.

- ``procs`` / ``controller``: fixtures (import them into a test module to use them): the
  reference processes one test starts (SIGKILLed at the end), and an HTTP controller.
- :func:`settings`: orchestrator settings for a journal URL and the four participants' URLs.
- :func:`table`, :func:`rpc_calls` (bodies resolved), :func:`until`, :func:`wait_healthy`, :func:`wait_terminal`, :func:`events`:
  read the journal while the orchestrator runs.
- :func:`run_checkpoint`: start a checkpoint with ``start_checkpoint`` and wait until it ends.
- :func:`closed_executions`: every participant's ``executions`` as they stand while the
  checkpoint holds the policy model closed (nothing completes anywhere then).
- :func:`steps_of`, :func:`by_rollout`: what "every step completed exactly once" means.
- :func:`audit_rows`: run one of docs/audit.md's named queries, as written, on a journal.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.runtime.service import Orchestrator
from journal import Journal, audit, models
from journal.writes import to_row
from tests.support.audit_sql import queries
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, Stack
from workers.protocol import EpisodeId


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
async def controller() -> AsyncIterator[ParticipantClient]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        yield ParticipantClient(http)


def urls(stack: Stack) -> dict[str, str]:
    """Participant name (``<kind>-0``) -> URL."""
    return {f"{kind}-0": stack.url(kind) for kind in KINDS}


def state_dirs(root: Path) -> dict[str, Path]:
    return {kind: root / kind for kind in KINDS}


def settings(journal_url: str, stack: Stack, **checkpoint: Any) -> Settings:
    """The orchestrator's settings for ``stack``; ``checkpoint`` overrides keys of ``checkpoint:``
    (``roots=[...]`` lets requests name directories there)."""
    return Settings.model_validate({
        "checkpoint": {"commit_timeout_s": 20, "resume_timeout_s": 10, **checkpoint},
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 60},
        "dispatcher": {"backoff_base_s": 0.1, "backoff_cap_s": 1},
        "participants": [{"name": name, "url": url} for name, url in urls(stack).items()],
        "logging": {"level": "WARNING"},
    })


async def table(orch: Orchestrator, t: sa.Table) -> dict[str, Any]:
    async with orch.journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(t))).all()}


async def rpc_calls(orch: Orchestrator) -> dict[str, Any]:
    """``rpc_calls`` by id, each ``body`` what the call sends: its own, or its shared body parsed."""
    t, b = models.rpc_calls, models.rpc_bodies
    async with orch.journal.read() as conn:
        rows = (await conn.execute(sa.select(t, b.c.content).outerjoin(b, b.c.id == t.c.body_id))).all()
    out = {}
    for r in rows:
        row = dict(r._mapping)
        content = row.pop("content")
        if row["body_id"] is not None:
            row["body"] = json.loads(content)
        out[row["id"]] = row
    return out


async def until(check: Any, timeout: float = 120.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


async def wait_healthy(orch: Orchestrator, stack: Stack) -> list[Any]:
    """Wait until the four participants are healthy at the stack's URLs; their rows."""
    want = urls(stack)

    async def healthy() -> list[Any]:
        rows = await table(orch, models.participants)
        ok = {n: r for n, r in rows.items() if r["state"] == "healthy" and want.get(n) == r["url"]}
        return [to_row("participants", r) for r in ok.values()] if len(ok) == len(want) else []
    rows: list[Any] = await until(healthy)
    return rows


async def wait_terminal(orch: Orchestrator, t: sa.Table, entity_id: str, terminal: tuple[str, ...],
                        timeout: float = 60.0) -> dict[str, Any]:
    async def finished() -> dict[str, Any] | None:
        row = (await table(orch, t)).get(entity_id)
        return row if row is not None and row["state"] in terminal else None
    try:
        row: dict[str, Any] = await until(finished, timeout)
    except AssertionError:
        calls = await table(orch, models.rpc_calls)
        raise AssertionError(f"{t.name} {entity_id} did not finish: {(await table(orch, t)).get(entity_id)}\n"
                             f"calls: {[(c['path'], c['target'][-6:], c['state']) for c in calls.values()]}"
                             ) from None
    return row


async def events(orch: Orchestrator, kind: str, entity_id: str | None = None) -> list[dict[str, Any]]:
    async with orch.journal.read() as conn:
        return list(await audit.query_events(conn, audit.EventFilter(entity_kind=kind, entity_id=entity_id, limit=audit.MAX_PAGE)))


async def run_checkpoint(orch: Orchestrator, stack: Stack, checkpoint_id: str, directory: Path) -> dict[str, Any]:
    participants = await wait_healthy(orch, stack)

    async def start(tx: Any) -> None:
        await start_checkpoint(tx, checkpoint_id, str(directory), participants)
    await orch.committer.run(start)
    return await wait_terminal(orch, models.checkpoints, checkpoint_id, ("done", "aborted", "failed"))


async def probed(orch: Orchestrator, name: str, state: str) -> None:
    """Probe participant ``name`` now (as ``POST /v1/participants/probe`` does) until its row is ``state``."""
    async def there() -> bool:
        orch.handle("discovery").request_probe(name)
        orch.reconciler.enqueue("participants", name)
        await asyncio.sleep(0.3)
        return bool((await table(orch, models.participants))[name]["state"] == state)
    await until(there, 30)


async def add_rollouts(orch: Orchestrator, tasks: Mapping[str, Any]) -> None:
    """A ``dispatched`` rollout row (attempt 0) per task."""
    async def create(tx: Any) -> None:
        for rid, task in tasks.items():
            await tx.create("rollouts", rid, reason="dispatched", state="dispatched", values={"attempt": 0, "task": task})
    await orch.committer.run(create)


async def closed_executions(c: ParticipantClient, stack: Stack, checkpoint_id: str,
                            timeout: float = 30.0) -> dict[str, dict[str, dict[str, int]]]:
    """Every participant's ``executions`` while ``checkpoint_id`` holds the policy model closed.

    From the model's prepare to its resume no policy response is delivered, so no step
    completes anywhere (the environment's wait steps finished before its own prepare; its
    other steps need the model), and what the processes counted is what the checkpoint
    holds. A round is kept when the model reports the checkpoint prepared or committed both
    before and after the other three statuses were read.
    """
    def closed(status: dict[str, Any]) -> bool:
        return status["checkpoint_id"] == checkpoint_id and status["phase"] in ("prepared", "committed")
    model = stack.url("model")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if closed(await c.status(model)):
            others = {k: await c.status(stack.url(k)) for k in ("environment", "agent", "resources")}
            last = await c.status(model)
            if closed(last):
                return {"model": last["executions"], **{k: s["executions"] for k, s in others.items()}}
        await asyncio.sleep(0.002)
    raise AssertionError(f"never saw checkpoint {checkpoint_id} holding the model closed")


def steps_of(kind: str, turns: int) -> set[str]:
    """Every step one episode completes on a server of ``kind``."""
    if kind == "environment":
        return {f"turn-{t}:{s}" for t in range(1, turns + 1) for s in ("act", "check")} | {"verify"}
    if kind == "model":
        return {f"generate-{t}" for t in range(1, turns + 1)}
    if kind == "agent":
        return {f"act-{t}" for t in range(1, turns + 1)}
    return {f"check-{t}" for t in range(1, turns + 1)} | {"verify"}


def by_rollout(*snapshots: dict[str, dict[str, int]]) -> dict[str, Counter[str]]:
    """Executions summed per rollout over several processes' ``executions``."""
    total: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for snapshot in snapshots:
        for key, steps in snapshot.items():
            total[EpisodeId.from_capture_key(key).rollout_id].update(steps)
    return dict(total)


async def audit_rows(journal: Journal, name: str, **params: Any) -> list[dict[str, Any]]:
    """Run docs/audit.md's query ``name``, as written, on ``journal``'s backend; its rows."""
    async with journal.read() as conn:
        result = await conn.execute(sa.text(queries(journal.backend)[name]), params)
        return [dict(r._mapping) for r in result.all()]
