"""The checkpoint workflow through the whole orchestrator, against the four reference participants
as real processes, on both journal backends: a checkpoint taken mid-episode is published and every
participant resumed; a stage that misses its deadline aborts with its blockers in the journal."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.runtime.service import Orchestrator
from journal import audit, models
from tests.support.audit_sql import queries
from tests.support.reference_procs import ParticipantClient, Procs, start_stack
from tests.support.workflows import add_rollouts, settings, table, until

pytestmark = pytest.mark.slow




async def audit_query(orch: Orchestrator, name: str, **params: str) -> list[dict[str, Any]]:
    """Run one of docs/audit.md's queries, as written, on this journal's backend."""
    backend = orch.journal.backend
    async with orch.journal.read() as conn:
        result = await conn.execute(sa.text(queries(backend)[name]), params)
        return [dict(r._mapping) for r in result.all()]


async def run_checkpoint(orch: Orchestrator, checkpoint_id: str, directory: Path, *, max_tries: int = 1,
                         rollouts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Checkpoint once every participant is healthy, first recording ``rollouts`` (id -> task) as
    dispatched (attempt 0) by the test's own code; the checkpoint's row once it ended."""
    async def healthy() -> list[Any]:
        rows = await table(orch, models.participants)
        return [r for r in rows.values() if r["state"] == "healthy"] if len(rows) == 4 and all(
            r["state"] == "healthy" for r in rows.values()) else []
    await until(healthy)
    from journal.writes import to_row
    participants = [to_row("participants", r) for r in (await table(orch, models.participants)).values()]
    if rollouts:
        await add_rollouts(orch, rollouts)

    async def start(tx: Any) -> None:
        await start_checkpoint(tx, checkpoint_id, str(directory), participants, max_tries=max_tries)
    await orch.committer.run(start)

    async def finished() -> dict[str, Any] | None:
        row = (await table(orch, models.checkpoints)).get(checkpoint_id)
        return row if row is not None and row["state"] in ("done", "aborted", "failed") else None
    try:
        row: dict[str, Any] = await until(finished, 60)
    except AssertionError:
        calls = await table(orch, models.rpc_calls)
        raise AssertionError(f"checkpoint did not finish: {await table(orch, models.checkpoints)}\n"
                             f"members: {[(m['participant'], m['state']) for m in (await table(orch, models.checkpoint_members)).values()]}\n"
                             f"calls: {[(c['path'], c['target'][-6:], c['state']) for c in calls.values()]}") from None
    return row


async def test_a_checkpoint_mid_episode_is_published_and_everyone_resumed(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    # Steps of 0.5 s: an episode (four turns of act and check, then verify) lasts 4.5 s. They start
    # once the orchestrator sees every participant healthy, so the checkpoint comes mid-episode on a
    # loaded machine too (0.2 s steps, started before the orchestrator, all ended first once).
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in
                                      ("environment", "model", "agent", "resources")}, env_delay=0.5)
    orch = Orchestrator(settings(journal_url, stack, prepare_timeout_s=10))
    await orch.start()
    runs = []
    try:
        await all_healthy(orch)
        runs = [asyncio.create_task(controller.run(stack.url("environment"), f"r{i}", {"prompt": f"p{i}", "turns": 4}))
                for i in range(3)]
        await asyncio.sleep(0.7)  # the episodes are mid-way
        # Sent by this test, recorded in the journal as its own dispatch: the checkpoint's scope is
        # the journal's (r3 is dispatched in the journal only: committed, nothing of it exported).
        row = await run_checkpoint(orch, "ck-1", tmp_path / "ckpts",
                                   rollouts={f"r{i}": {"prompt": f"p{i}", "turns": 4} for i in range(4)})
        members = await table(orch, models.checkpoint_members)
        async with orch.journal.read() as conn:
            trail = [e["to_state"] for e in await audit.query_events(conn, audit.EventFilter(entity_kind="checkpoints"))]
        # docs/audit.md's queries answer from this journal.
        containing = await audit_query(orch, "checkpoints-containing-rollout", rollout="r0")
        assert [(r["checkpoint_id"], r["capture_key"]) for r in containing] == [("ck-1", "r0")]
        assert await audit_query(orch, "checkpoints-containing-rollout", rollout="r") == []
        assert [r["to_state"] for r in await audit_query(orch, "checkpoint-trail", checkpoint="ck-1")] == trail
        assert len(await audit_query(orch, "checkpoint-leaders")) == 1
        # Recorded, not dispatched by tidelog: the row's creation is its whole history.
        assert [(r["from_state"], r["to_state"]) for r in await audit_query(orch, "rollout-history", rollout="r0")
                ] == [(None, "dispatched")]
        sent = await audit_query(orch, "checkpoint-call-bodies", checkpoint="ck-1")
    finally:
        await orch.stop()
    results = await asyncio.gather(*runs)
    assert row["state"] == "done", row
    assert trail == ["preparing", "preparing", "preparing", "preparing", "preparing", "prepared", "committing",
                     "committing", "committed", "published", "resuming", "done"]
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == "ck-1"
    published = json.loads((tmp_path / "ckpts" / "ck-1" / "checkpoint.json").read_text())
    assert set(published["members"]) == {"environment-0", "model-0", "agent-0", "resources-0"}
    # Every member committed the journal's scope; the environment exported the three live episodes.
    assert published["committed_scope"] == published["scope"] == ["r0", "r1", "r2", "r3"]
    assert published["rollouts"] == {"continued": [{"rollout_id": f"r{i}", "attempt": 0} for i in range(4)],
                                     "not_dispatched": [], "not_dispatched_count": 0}
    assert members["ck-1/environment-0"]["episode_ids"] == ["r0", "r1", "r2"]
    assert all(m["state"] == "resumed" for m in members.values())
    assert all(m["manifest"]["checkpoint_id"] == "ck-1" for m in members.values())
    # Every step's calls sent one stored body (content-addressed): each prepare stage its own deadline,
    # the commit one body to all four, and the four resume stages one request (the same deadline).
    assert len(sent) == 12 and all(c["body_id"] and c["state"] == "succeeded" for c in sent)
    bodies: dict[str, set[str]] = {}
    for c in sent:
        bodies.setdefault(c["path"].rsplit("/", 1)[1], set()).add(c["body_id"])
    assert {op: len(ids) for op, ids in bodies.items()} == {"prepare": 4, "commit": 1, "resume": 1}
    commits = [json.loads(c["sent"]) for c in sent if c["path"].endswith("/commit")]
    assert len(commits) == 4 and all(b == commits[0] for b in commits)
    assert sorted(e["rollout_id"] for e in commits[0]["episode_ids"]) == published["committed_scope"]
    for kind in ("environment", "model", "agent", "resources"):
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle" and status["checkpoint_id"] is None
    # The episodes were parked at their boundaries and went on after the resume.
    assert sorted(r["rollout_id"] for r in results) == ["r0", "r1", "r2"]
    assert all(len(r["actions"]) == 4 and 0.0 <= r["reward"] <= 1.0 for r in results)


#: Each reference environment step of the slow episode takes this long, and a prepare stage's
#: deadline is this long after the stage starts. The stage starts STEP + 0.5 s into the episode,
#: inside its first ``check`` (a wait step that ends at 2 x STEP), so the deadline passes while the
#: episode is still blocking. PREPARE must also cover the prepare call's way to the participant on
#: a loaded machine: a call that arrives after its deadline is refused with ``deadline_exceeded``
#: (the protocol's rule) instead of answering with its blockers (0.5 s was missed once, under the
#: full suite on three workers).
STEP, PREPARE = 6.0, 3.0


async def all_healthy(orch: Orchestrator) -> None:
    """Until the orchestrator has probed all four participants healthy."""
    async def healthy() -> bool:
        rows = await table(orch, models.participants)
        return len(rows) == 4 and all(r["state"] == "healthy" for r in rows.values())
    await until(healthy)


async def slow_episode_in_check(orch: Orchestrator, url: str, call: Any) -> asyncio.Task[Any]:
    """With every participant healthy, start the slow episode with ``call`` (a coroutine function
    of the environment's URL) and return once it is inside its first ``check``."""
    await all_healthy(orch)
    run = asyncio.create_task(call(url))
    await asyncio.sleep(STEP + 0.5)
    return run


async def test_a_stage_that_misses_its_deadline_aborts_with_its_blockers(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in
                                      ("environment", "model", "agent", "resources")}, env_delay=STEP)
    orch = Orchestrator(settings(journal_url, stack, prepare_timeout_s=PREPARE))
    await orch.start()
    try:
        run = await slow_episode_in_check(orch, stack.url("environment"), lambda url: controller.run(
            url, "slow", {"prompt": "p", "turns": 1}))
        row = await run_checkpoint(orch, "ck-2", tmp_path / "ckpts")
        members = {m["participant"]: m for m in (await table(orch, models.checkpoint_members)).values()}
        reason = await audit_query(orch, "checkpoint-abort-reason", checkpoint="ck-2")
        answers = await audit_query(orch, "checkpoint-members", checkpoint="ck-2")
        failed_calls = await audit_query(orch, "checkpoint-failed-calls", checkpoint="ck-2")
    finally:
        await orch.stop()
    assert row["state"] == "aborted", row
    assert "stage environment not prepared" in row["detail"] and row["blockers"] == {"environment-0": ["slow"]}
    assert members["environment-0"]["report"]["blocker_count"] == 1
    # Later stages were never prepared; everyone was resumed (the ones never reached too).
    assert all(m["state"] == "resumed" for m in members.values())
    assert not (tmp_path / "ckpts" / "LATEST").exists()
    for kind in ("environment", "model", "agent", "resources"):
        assert (await controller.status(stack.url(kind)))["phase"] == "idle"
    assert (await run)["rollout_id"] == "slow"  # the episode went on after the abort
    # docs/audit.md's "why did checkpoint Y abort" answers from the journal.
    assert reason[0]["state"] == "aborted" and "stage environment not prepared" in reason[0]["detail"]
    assert [(a["participant"], a["state"]) for a in answers][0] == ("environment-0", "resumed")
    assert failed_calls == []  # the environment answered (not ready): no call failed


async def test_a_straggler_is_retired_and_the_checkpoint_retried_under_a_new_id(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in
                                      ("environment", "model", "agent", "resources")}, env_delay=STEP)
    orch = Orchestrator(settings(journal_url, stack, prepare_timeout_s=PREPARE))
    await orch.start()
    try:
        run = await slow_episode_in_check(orch, stack.url("environment"), lambda url: controller.post(
            url, "/run", {"rollout_id": "slow", "task": {"prompt": "p", "turns": 1}}))
        first = await run_checkpoint(orch, "ck-3", tmp_path / "ckpts", max_tries=2)

        async def retried() -> dict[str, Any] | None:
            row = (await table(orch, models.checkpoints)).get("ck-3-try2")
            return row if row is not None and row["state"] in ("done", "aborted", "failed") else None
        second = await until(retried)  # the default safety net: 60 s ran out once under the full suite
        retirement = (await table(orch, models.retirements))["stragglers-of-ck-3"]
    finally:
        await orch.stop()
    assert first["state"] == "aborted" and first["blockers"] == {"environment-0": ["slow"]}
    assert retirement["state"] == "done" and retirement["episode_ids"] == [{"rollout_id": "slow", "attempt": 0}]
    assert second["state"] == "done" and second["retry_of"] == "ck-3" and second["try_number"] == 2
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == "ck-3-try2"
    status, reply = await run
    assert status == 409 and reply["error"]["code"] == "stale_attempt"  # the straggler was retired
    env = await controller.status(stack.url("environment"))
    assert env["retired_rollouts"] == 1 and env["phase"] == "idle"
