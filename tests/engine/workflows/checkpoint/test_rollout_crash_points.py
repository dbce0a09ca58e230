"""Crash points of the rollout machine: the orchestrator SIGKILLed right after every commit of a
``rollouts`` row that a run passes through, enumerated from the machine (not picked by hand), then
restarted; every run ends as the uncrashed one does.

The run (``tests.support.workflow_worker rollouts TAG``) submits two rollouts that finish and one the
environment refuses every time (``rollouts.max_failures`` 2), and ends once all three are
forgotten. The points are the machine's edges the uncrashed run reached, then those only a crashed
run reaches (a ``/run`` in flight when the orchestrator died turns ``ambiguous``, is retired
everywhere and runs again), each crashed at after the crashes that led there, until no new one
turns up. After each run: the two finish with the
result of their last attempt, which ran every step once from its input; the refused one failed after
two typed errors; each attempt's ``/run`` was sent at most once; every rollout is forgotten and no
participant holds a retire mark; ``audit.verify`` is clean. The reference participants are real
processes that live through every crash; each run has a fresh journal.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from journal import Journal, audit, machines, models
from tests.engine.runtime.test_crash_recovery import new_journal_url
from tests.engine.workflows.checkpoint.test_checkpoint_crash_points import KINDS, run_worker, targets
from tests.support.reference_procs import ParticipantClient, Procs, Stack, start_stack
from tests.support.workflow_worker import rollout_tasks
from tests.support.workflows import steps_of
from workers.protocol import EpisodeId

pytestmark = pytest.mark.slow


async def journal_view(url: str, tag: str) -> tuple[set[str], dict[str, Any], dict[str, list[tuple[Any, str]]],
                                                       list[dict[str, Any]]]:
    """The rollout edges the run reached, the rows, each row's history and every /run call."""
    journal = Journal.open(url)
    try:
        async with journal.read() as conn:
            e, r, c = models.events, models.rollouts, models.rpc_calls
            events = (await conn.execute(sa.select(e.c.entity_id, e.c.from_state, e.c.to_state)
                                         .where(e.c.entity_kind == "rollouts").order_by(e.c.seq))).all()
            rows = {x.id: dict(x._mapping) for x in (await conn.execute(sa.select(r))).all()}
            calls = [dict(x._mapping) for x in (await conn.execute(sa.select(c).where(c.c.path == "/run"))).all()]
        assert await audit.verify(journal) == [], tag
    finally:
        await journal.dispose()
    edges = {f"rollouts:created:{b}" if a is None else f"rollouts:{a}->{b}" for _, a, b in events}
    history: dict[str, list[tuple[Any, str]]] = {}
    for rid, a, b in events:
        history.setdefault(rid, []).append((a, b))
    return edges, rows, history, calls


async def rollout_run(backend: str, request: pytest.FixtureRequest, tmp_path: Path, stack: Stack,
                      c: ParticipantClient, tag: str, crashes: list[str]) -> tuple[set[str], list[int]]:
    """One run on a fresh journal: a worker per crash point in ``crashes`` (each SIGKILLed right after
    its point's commit, the next picking up where it died), then one to the end."""
    url = await new_journal_url(backend, request, tmp_path / f"{tag}.db")
    codes = [await run_worker(url, stack, "rollouts", [tag], point) for point in crashes]
    codes.append(await run_worker(url, stack, "rollouts", [tag], None))
    crash_at = " then ".join(crashes)
    edges, rows, history, calls = await journal_view(url, tag)
    tasks = rollout_tasks(tag)
    assert {rid: r["state"] for rid, r in rows.items()} == dict.fromkeys(tasks, "forgotten"), (crash_at, rows)
    executions = (await c.status(stack.url("environment")))["executions"]
    for rid in (f"{tag}-g0", f"{tag}-g1"):
        row = rows[rid]
        assert row["result"]["rollout_id"] == rid and row["result"]["attempt"] == row["attempt"], (crash_at, row)
        key = EpisodeId(rollout_id=rid, attempt=row["attempt"]).capture_key
        assert executions[key] == dict.fromkeys(steps_of("environment", 2), 1), (crash_at, key, executions[key])
        assert history[rid][-2:] == [("dispatched", "finished"), ("finished", "forgotten")], (crash_at, history[rid])
    bad = rows[f"{tag}-bad"]
    assert bad["failures"] == 2 and "HTTP 422 invalid_request" in bad["detail"], (crash_at, bad)
    assert history[f"{tag}-bad"][-2:] == [("retired", "failed"), ("failed", "forgotten")], (crash_at, history)
    # At most one /run per attempt (one whose connection was never made sent nothing).
    sent = [call["body"]["rollout_id"] for call in calls
            if not (call["state"] == "failed" and (call["error"] or {}).get("sent") is False)]
    assert len(sent) == len(set(sent)), (crash_at, sorted(sent))
    for kind in KINDS:
        assert (await c.status(stack.url(kind)))["retired_rollouts"] == 0, (crash_at, kind)
    return edges, codes


async def test_every_rollout_crash_point_recovers(backend: str, request: pytest.FixtureRequest, procs: Procs,
                                                   controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=0.05)
    reached, codes = await rollout_run(backend, request, tmp_path, stack, controller, "clean", [])
    assert codes == [0]
    # Each point with the crashes that lead to it: none for what the uncrashed run reaches.
    todo: list[list[str]] = [[p] for p in targets(reached, [machines.ROLLOUTS])]
    assert {"rollouts:created:pending", "rollouts:pending->dispatched", "rollouts:dispatched->finished",
            "rollouts:dispatched->errored", "rollouts:retired->failed"} <= {t[-1] for t in todo}, todo
    done: list[str] = []
    while todo:
        crashes = todo.pop(0)
        edges, codes = await rollout_run(backend, request, tmp_path, stack, controller, f"t{len(done)}", crashes)
        assert codes == [-signal.SIGKILL] * len(crashes) + [0], f"{crashes}: a hook did not fire ({codes})"
        done.append(crashes[-1])
        # Points only reached after a crash (a /run in flight turned ambiguous): crash there too,
        # after the crashes that led there.
        queued = {t[-1] for t in todo}
        todo += [[*crashes, p] for p in targets(edges, [machines.ROLLOUTS]) if p not in done and p not in queued]
    assert {"rollouts:dispatched->ambiguous", "rollouts:ambiguous->retiring"} <= set(done), done
    print(f"{len(done)} rollout crash points: {done}")
