"""The rollout machine through the whole orchestrator against the four reference participants as
real processes, on both journal backends: submitted rollouts are dispatched under the configured
bounds, recorded and finished with every step completed once; an attempt whose ``/run`` was in
flight when the orchestrator was SIGKILLed is never sent again: it is retired everywhere and the
rollout runs again from its input as the next attempt (``<id>-a1`` on the wire); an attempt the
environment refuses with a typed error is retried up to ``max_failures``, then the rollout fails
with the reason."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts
from journal import Journal, audit, models
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, Stack, start_stack
from tests.support.workflows import (audit_rows, controller, probed, procs, table, until, urls,  # noqa: F401
                                     wait_healthy)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[4]


def config(journal_url: str, stack: Stack, **rollouts: Any) -> dict[str, Any]:
    return {
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 3, "lease_renew_s": 0.5, "shutdown_grace_s": 1},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 60},
        "dispatcher": {"backoff_base_s": 0.1, "backoff_cap_s": 1},
        "checkpoint": {"retire_timeout_s": 20},
        "participants": [{"name": name, "url": url} for name, url in urls(stack).items()],
        "rollouts": rollouts,
        "logging": {"level": "WARNING"},
    }


async def submit(orch: Orchestrator, tasks: dict[str, Any]) -> None:
    checked = [check_task({"rollout_id": rid, "input": task}, i) for i, (rid, task) in enumerate(tasks.items())]

    async def write(tx: Any) -> None:
        await submit_rollouts(tx, checked)
    await orch.committer.run(write)


async def rollouts(journal: Journal) -> dict[str, dict[str, Any]]:
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(models.rollouts))).all()}


async def settled(journal: Journal, ids: list[str], states: tuple[str, ...] = ("forgotten",),
                  timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    async def done() -> dict[str, dict[str, Any]] | None:
        rows = await rollouts(journal)
        return rows if all(rows.get(i, {}).get("state") in states for i in ids) else None
    try:
        found: dict[str, dict[str, Any]] = await until(done, timeout)
    except AssertionError:
        rows = await rollouts(journal)
        raise AssertionError(f"rollouts did not settle: {[(k, v['state'], v['attempt']) for k, v in rows.items()]}") from None
    return found


async def run_calls(journal: Journal) -> list[dict[str, Any]]:
    t = models.rpc_calls
    async with journal.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(sa.select(t).where(t.c.path == "/run"))).all()]


def most_in_flight(history: list[dict[str, Any]]) -> tuple[int, Counter[str]]:
    """The most attempts ``dispatched`` at once, in all and per environment, replaying the events."""
    where: dict[str, str] = {}
    peak, peaks = 0, Counter[str]()
    for ev in sorted(history, key=lambda e: e["seq"]):
        rid = ev["entity_id"]
        if ev["to_state"] == "dispatched":
            where[rid] = (ev["payload"] or {}).get("set", {}).get("environment", where.get(rid, "?"))
        elif ev["from_state"] == "dispatched":
            where.pop(rid, None)
        peak = max(peak, len(where))
        for env, n in Counter(where.values()).items():
            peaks[env] = max(peaks[env], n)
    return peak, peaks


async def test_submitted_rollouts_are_dispatched_within_bounds_and_finish_once(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=0.02)
    orch = Orchestrator(Settings.model_validate(config(journal_url, stack, max_in_flight=3, per_environment=3,
                                                       max_failures=2)))
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        tasks = {f"r{i}": {"prompt": f"p{i}", "turns": 2} for i in range(10)}
        # The environment refuses this input (an empty prompt) with a typed error, every time.
        await submit(orch, {**tasks, "bad": {"prompt": "", "turns": 1}})
        # Done for good, then forgotten everywhere (in batches).
        rows = await settled(orch.journal, [*tasks, "bad"])
        marks = {k: (await controller.status(stack.url(k)))["retired_rollouts"] for k in KINDS}
        batches = [r for r in (await table(orch, models.retirements)).values() if r["op"] == "forget"]
        calls = await run_calls(orch.journal)
        async with orch.journal.read() as conn:
            history = await audit.query_events(conn, audit.EventFilter(entity_kind="rollouts", limit=audit.MAX_PAGE))
        assert await audit.verify(orch.journal) == []
        # docs/audit.md's rollout queries, as written, on this backend.
        assert await audit_rows(orch.journal, "rollouts-not-done-once") == []
        attempts = await audit_rows(orch.journal, "rollout-attempts", rollout="bad")
    finally:
        await orch.stop()
    assert [(a["from_state"], a["to_state"]) for a in attempts] == [
        ("pending", "dispatched"), ("dispatched", "errored"), ("pending", "dispatched"), ("dispatched", "errored"),
        ("retired", "failed"), ("failed", "forgotten")]
    # The reruns' retire marks were lifted by the forget: nothing is held for rollouts no longer live.
    assert marks == {k: 0 for k in KINDS}, marks
    assert batches and all(b["id"].startswith("fgb-") and b["state"] == "done" for b in batches), batches
    assert sorted(i for b in batches for i in b["rollout_ids"]) == sorted([*tasks, "bad"])
    assert "HTTP 422 invalid_request" in attempts[1]["reason"]
    bad = rows.pop("bad")
    assert {k: (r["state"], r["attempt"], r["environment"], r["failures"]) for k, r in rows.items()} == {
        k: ("forgotten", 0, "environment-0", 0) for k in tasks}
    assert {k: [(e["from_state"], e["to_state"]) for e in history if e["entity_id"] == k][-2:] for k in tasks} == {
        k: [("dispatched", "finished"), ("finished", "forgotten")] for k in tasks}
    # Retried once as attempt 1 (after its attempt 0 was retired everywhere), then failed with the reason.
    assert (bad["state"], bad["attempt"], bad["failures"]) == ("forgotten", 1, 2), bad
    assert "attempt 1 on environment-0: HTTP 422 invalid_request" in bad["detail"], bad["detail"]
    assert [(e["from_state"], e["to_state"]) for e in history if e["entity_id"] == "bad"] == [
        (None, "pending"), ("pending", "dispatched"), ("dispatched", "errored"), ("errored", "retiring"),
        ("retiring", "retired"), ("retired", "pending"), ("pending", "dispatched"), ("dispatched", "errored"),
        ("errored", "retiring"), ("retiring", "retired"), ("retired", "failed"), ("failed", "forgotten")]
    failed_reason = [e["reason"] for e in history if e["entity_id"] == "bad"][-2]
    assert failed_reason.startswith("failed: 2 attempt(s) ended in an error (rollouts.max_failures = 2)"), failed_reason
    calls = [c for c in calls if c["body"]["rollout_id"] not in ("bad", "bad-a1")]
    for rid, row in rows.items():
        assert row["result"]["rollout_id"] == rid and row["result"]["attempt"] == 0
        assert len(row["result"]["actions"]) == 2 and isinstance(row["result"]["reward"], (int, float))
        assert row["dispatched_at"] <= row["ended_at"]
    # One /run per rollout, never repeatable, on the data pool, the first attempt named by the bare id.
    assert sorted(c["body"]["rollout_id"] for c in calls) == sorted(tasks)
    assert {(c["state"], c["repeatable"], c["pool"], c["attempts"]) for c in calls} == {("succeeded", False, "data", 1)}
    assert all(c["body"]["task"] == tasks[c["body"]["rollout_id"]] for c in calls)
    peak, per_env = most_in_flight(history)
    assert 1 <= peak <= 3 and max(per_env.values()) <= 3, (peak, per_env)
    # Every step of every rollout completed exactly once on the environment.
    executions = (await controller.status(stack.url("environment")))["executions"]
    assert executions == {rid: {s: 1 for s in ("turn-1:act", "turn-1:check", "turn-2:act", "turn-2:check", "verify")}
                          for rid in tasks}


def serve(cfg: dict[str, Any], tmp: Path) -> subprocess.Popen[bytes]:
    path = tmp / "tidelog.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115 - the process owns it
    env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "--config", str(path), "serve"], cwd=ROOT,
                            env=env, stdout=log, stderr=log)


async def test_a_run_in_flight_when_the_orchestrator_dies_is_retired_and_run_again_as_the_next_attempt(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    # A step of 1 s makes an episode (three turns of act and check, then verify) last about 7 s, so
    # that on a loaded machine the first /run cannot finish before the third has been sent.
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS}, env_delay=1.0)
    cfg = config(journal_url, stack, max_in_flight=8)
    cfg["api"] = {"port": 0}
    # A probe that times out on a loaded machine marks the server unreachable until the next probe:
    # two seconds, not the shared config's minute (nothing is dispatched to an unreachable server).
    cfg["discovery"] = {**cfg["discovery"], "interval_s": 2}
    # The rollouts are written beside it, not through its API: a leader sees another writer's rows
    # at its next resync, every second here (30 s by default).
    cfg["reconciler"] = {"resync_interval_s": 1}
    tasks = {f"k{i}": {"prompt": f"p{i}", "turns": 3} for i in range(3)}
    journal = Journal.open(journal_url)
    first = serve(cfg, tmp_path)
    try:
        orch_rows: dict[str, Any] = {}

        async def leading() -> bool:
            async with journal.read() as conn:
                return (await conn.execute(sa.select(models.leases.c.epoch))).scalar() is not None
        await until(leading, 60)
        # Submitted beside the running leader, through the journal it reads (as the API would write).
        async with journal.write() as tx:
            await submit_rollouts(tx, [check_task({"rollout_id": k, "input": v}) for k, v in tasks.items()])

        async def in_flight() -> bool:
            calls = await run_calls(journal)
            # Past this point the test cannot do what it is for: say what happened instead of waiting.
            assert all(c["state"] in ("pending", "inflight") for c in calls), [(c["entity_id"], c["state"]) for c in calls]
            return len(calls) == 3 and all(c["state"] == "inflight" for c in calls)
        try:
            await until(in_flight, 90)
        except AssertionError as exc:
            async with journal.read() as conn:
                seen = [(r.id, r.state, r.detail) for r in (await conn.execute(sa.select(models.participants))).all()]
            log_tail = (tmp_path / "serve.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{exc}; participants {seen}; serve.log ends:\n{log_tail}") from None
        # Mid-episode on the environment: one act step completed, the episodes are still running.
        await asyncio.sleep(1.5)
        first.send_signal(signal.SIGKILL)
        first.wait()
        orch_rows = await rollouts(journal)
        assert {k: (r["state"], r["attempt"]) for k, r in orch_rows.items()} == {k: ("dispatched", 0) for k in tasks}
    finally:
        if first.poll() is None:
            first.kill()
        await journal.dispose()
    orch = Orchestrator(Settings.model_validate(config(journal_url, stack, max_in_flight=8)))
    await orch.start()
    try:
        rows = await settled(orch.journal, list(tasks))
        calls = await run_calls(orch.journal)
        retirements = await table(orch, models.retirements)
        async with orch.journal.read() as conn:
            history = {k: [(e["from_state"], e["to_state"]) for e in await audit.query_events(
                conn, audit.EventFilter(entity_kind="rollouts", entity_id=k))] for k in tasks}
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()
    assert {k: (r["state"], r["attempt"]) for k, r in rows.items()} == {k: ("forgotten", 1) for k in tasks}
    assert all(h == [(None, "pending"), ("pending", "dispatched"), ("dispatched", "ambiguous"),
                     ("ambiguous", "retiring"), ("retiring", "retired"), ("retired", "pending"),
                     ("pending", "dispatched"), ("dispatched", "finished"), ("finished", "forgotten")]
               for h in history.values()), history
    # Attempt 0's /run was never sent again: it stays ambiguous; attempt 1 went as "<id>-a1".
    by_attempt = Counter((c["body"]["rollout_id"], c["state"]) for c in calls)
    assert by_attempt == Counter({**{(k, "ambiguous"): 1 for k in tasks}, **{(f"{k}-a1", "succeeded"): 1 for k in tasks}})
    assert all(r["result"]["rollout_id"] == k and r["result"]["attempt"] == 1 for k, r in rows.items())
    reruns = [r for r in retirements.values() if r["op"] == "retire"]
    assert sorted((r["id"].split("-")[0], r["state"]) for r in reruns) == [("rerun", "done")] * 3, reruns
    assert all(r["state"] == "done" for r in retirements.values() if r["op"] == "forget")
    # The rerun ran from its input: every step of attempt 1 completed once, under its own key.
    executions = (await controller.status(stack.url("environment")))["executions"]
    steps = {f"turn-{t}:{s}" for t in (1, 2, 3) for s in ("act", "check")} | {"verify"}
    for k in tasks:
        assert executions[f"{k}-a1"] == {s: 1 for s in steps}, executions
    # Forgotten once finished: the participants hold no mark of the retired attempts any more.
    for kind in KINDS:
        assert (await controller.status(stack.url(kind)))["retired_rollouts"] == 0, kind


async def test_no_attempt_is_dispatched_while_a_checkpoint_is_open(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """A checkpoint held open (its agent SIGSTOPped: the agent's prepare, and any resume, waits
    until SIGCONT) pauses dispatch from its creation to its end; the rollouts submitted meanwhile
    wait, and go once it has ended and everyone resumed."""
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
    cfg = config(journal_url, stack)
    # Deadlines far beyond the test: the checkpoint stays open for as long as the agent is stopped.
    cfg["checkpoint"] = {**cfg["checkpoint"], "prepare_timeout_s": 60, "resume_timeout_s": 30, "max_tries": 1}
    orch = Orchestrator(Settings.model_validate(cfg))
    await orch.start()
    agent = stack.procs["agent"].proc
    assert agent is not None
    try:
        participants = await wait_healthy(orch, stack)
        agent.send_signal(signal.SIGSTOP)

        async def start(tx: Any) -> None:
            await start_checkpoint(tx, "ck-held", str(tmp_path / "ckpts"), participants, max_tries=1)
        await orch.committer.run(start)
        tasks = {f"w{i}": {"prompt": f"p{i}", "turns": 1} for i in range(4)}
        await submit(orch, tasks)

        async def agent_waited() -> bool:
            # From the events: the agent's prepare was sent (whatever its member row says by now).
            async with orch.journal.read() as conn:
                seen = await audit.query_events(conn, audit.EventFilter(entity_kind="checkpoint_members",
                                                                        entity_id="ck-held/agent-0"))
            return any(e["to_state"] == "preparing" for e in seen)
        await until(agent_waited, 60)
        assert {r["state"] for r in (await rollouts(orch.journal)).values()} == {"pending"}
        agent.send_signal(signal.SIGCONT)
        rows = await settled(orch.journal, list(tasks))
        async with orch.journal.read() as conn:
            trail = await audit.query_events(conn, audit.EventFilter(limit=audit.MAX_PAGE))
    finally:
        agent.send_signal(signal.SIGCONT)
        await orch.stop()
    assert {r["state"] for r in rows.values()} == {"forgotten"}
    ended = [e["seq"] for e in trail if e["entity_kind"] == "checkpoints" and e["to_state"] in ("done", "aborted", "failed")]
    dispatched = [e["seq"] for e in trail if e["entity_kind"] == "rollouts" and e["to_state"] == "dispatched"]
    assert len(ended) == 1 and len(dispatched) == 4 and min(dispatched) > ended[0], (ended, dispatched)


async def test_a_checkpoint_waits_for_a_retirement_already_running(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """A retire held running (its agent SIGSTOPped, so the agent stage waits to its deadline) is not
    cut off by a checkpoint started meanwhile: the checkpoint's first stage starts only after the
    retirement has ended."""
    from engine.workflows.checkpoint.retirement import request_retirement
    from workers.protocol import EpisodeId

    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
    cfg = config(journal_url, stack)
    # A retire deadline far beyond the test: the retirement runs for as long as the agent is stopped.
    cfg["checkpoint"] = {**cfg["checkpoint"], "retire_timeout_s": 60, "prepare_timeout_s": 30}
    orch = Orchestrator(Settings.model_validate(cfg))
    await orch.start()
    agent = stack.procs["agent"].proc
    assert agent is not None
    try:
        participants = await wait_healthy(orch, stack)
        agent.send_signal(signal.SIGSTOP)

        async def retire(tx: Any) -> None:
            await request_retirement(tx, "rt-held", "retire", episodes=[EpisodeId(rollout_id="x1", attempt=0)])
        await orch.committer.run(retire)

        async def at_agent() -> bool:
            row = (await table(orch, models.retirements)).get("rt-held", {})
            return row.get("state") == "running" and row.get("stage") == 1
        await until(at_agent, 60)

        async def start(tx: Any) -> None:
            await start_checkpoint(tx, "ck-after", str(tmp_path / "ckpts"), participants, max_tries=1)
        await orch.committer.run(start)
        await asyncio.sleep(0.5)
        waiting = (await table(orch, models.checkpoints))["ck-after"]
        agent.send_signal(signal.SIGCONT)

        async def ended() -> bool:
            row = (await table(orch, models.checkpoints)).get("ck-after", {})
            return row.get("state") in ("done", "aborted", "failed")
        await until(ended, 60)
        async with orch.journal.read() as conn:
            trail = await audit.query_events(conn, audit.EventFilter(limit=audit.MAX_PAGE))
    finally:
        agent.send_signal(signal.SIGCONT)
        await orch.stop()
    assert (waiting["state"], waiting["deadline_ts"]) == ("preparing", None), waiting
    retired = [e["seq"] for e in trail if e["entity_id"] == "rt-held" and e["to_state"] in ("done", "failed")]
    started = [e["seq"] for e in trail if e["entity_id"] == "ck-after" and e["reason"] == "stage 0 starts"]
    assert len(retired) == 1 and len(started) == 1 and started[0] > retired[0], (retired, started)


async def test_a_rerun_retirement_that_fails_is_requested_again_until_one_is_done(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """The resources server is down (SIGSTOPped: its probe times out) when an errored attempt is
    retired: each rerun retirement waits out its deadline and fails, the rollout stays ``retiring``
    and its retirement is requested again (``-t2``, ``-t3``, …) until, the server back, one is done
    everywhere and the rollout goes on to its end."""
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
    cfg = config(journal_url, stack, max_failures=1, forget_retry_s=0.5)
    cfg["checkpoint"] = {**cfg["checkpoint"], "retire_timeout_s": 1.5}
    cfg["discovery"] = {**cfg["discovery"], "probe_timeout_s": 0.5, "probe_tries": 1}
    orch = Orchestrator(Settings.model_validate(cfg))
    resources = stack.procs["resources"].proc
    assert resources is not None
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        resources.send_signal(signal.SIGSTOP)
        await probed(orch, "resources-0", "unreachable")
        await submit(orch, {"bad": {"prompt": "", "turns": 1}})  # refused with a typed error: errored

        async def failed_twice() -> bool:
            rows = (await table(orch, models.retirements)).values()
            return sum(r["state"] == "failed" and r["id"].startswith("rerun-") for r in rows) >= 2
        await until(failed_twice, 60)
        resources.send_signal(signal.SIGCONT)
        await probed(orch, "resources-0", "healthy")
        rows = await settled(orch.journal, ["bad"])
        reruns = sorted((r for r in (await table(orch, models.retirements)).values() if r["id"].startswith("rerun-")),
                        key=lambda r: r["created_at"])
        async with orch.journal.read() as conn:
            history = [(e["from_state"], e["to_state"]) for e in await audit.query_events(
                conn, audit.EventFilter(entity_kind="rollouts", entity_id="bad"))]
        marks = {k: (await controller.status(stack.url(k)))["retired_rollouts"] for k in KINDS}
        assert await audit.verify(orch.journal) == []
    finally:
        resources.send_signal(signal.SIGCONT)
        await orch.stop()
    assert (rows["bad"]["state"], rows["bad"]["attempt"]) == ("forgotten", 0), rows["bad"]
    base = reruns[0]["id"]
    assert [r["id"] for r in reruns] == [base, *(f"{base}-t{n}" for n in range(2, len(reruns) + 1))], reruns
    assert [r["state"] for r in reruns[:-1]] == ["failed"] * (len(reruns) - 1) and reruns[-1]["state"] == "done"
    assert all("resources-0 is unreachable" in r["detail"] for r in reruns[:-1]), reruns
    assert history == [(None, "pending"), ("pending", "dispatched"), ("dispatched", "errored"),
                       ("errored", "retiring"), *[("retiring", "retiring")] * (len(reruns) - 1),
                       ("retiring", "retired"), ("retired", "failed"), ("failed", "forgotten")], history
    assert marks == {k: 0 for k in KINDS}, marks


async def test_an_attempt_refused_before_it_started_goes_again_as_the_same_attempt(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """The environment's admission is closed by a checkpoint the orchestrator does not know of (this
    test prepares the environment itself, as another controller would): each ``/run`` is refused
    ``checkpoint_parked`` before it starts, so the rollout goes back to ``pending`` as the same
    attempt, no failure counted, and that environment is passed over for ``COOLDOWN_S`` before the
    next try (no busy loop of refusals). Once the environment resumes, attempt 0 runs and finishes."""
    from engine.workflows.checkpoint.rollouts import COOLDOWN_S
    stack = await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})
    orch = Orchestrator(Settings.model_validate(config(journal_url, stack)))
    env = stack.url("environment")
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        held = {"checkpoint_id": "foreign-1", "deadline_ts": time.time() + 60}
        assert (await controller.ok(env, "prepare", held))["phase"] == "prepared"
        await submit(orch, {"p0": {"prompt": "parked", "turns": 1}})

        async def refused_twice() -> bool:
            calls = [c for c in await run_calls(orch.journal) if c["state"] == "failed"]
            return len(calls) >= 2
        await until(refused_twice, 60)
        await controller.ok(env, "resume", {"checkpoint_id": "foreign-1", "deadline_ts": time.time() + 30})
        rows = await settled(orch.journal, ["p0"])
        calls = sorted(await run_calls(orch.journal), key=lambda c: c["created_at"])
        async with orch.journal.read() as conn:
            events = await audit.query_events(conn, audit.EventFilter(entity_kind="rollouts", entity_id="p0"))
    finally:
        await orch.stop()
    assert (rows["p0"]["attempt"], rows["p0"]["failures"]) == (0, 0), rows["p0"]
    assert rows["p0"]["result"]["attempt"] == 0
    refused, last = calls[:-1], calls[-1]
    assert len(refused) >= 2 and all(c["error"]["code"] == "checkpoint_parked" for c in refused), refused
    assert last["state"] == "succeeded" and {c["body"]["rollout_id"] for c in calls} == {"p0"}
    moves = [(e["from_state"], e["to_state"], e["ts"]) for e in events]
    assert [m[:2] for m in moves[-4:]] == [("dispatched", "pending"), ("pending", "dispatched"),
                                           ("dispatched", "finished"), ("finished", "forgotten")], moves
    assert all(m[:2] in ((None, "pending"), ("pending", "dispatched"), ("dispatched", "pending"))
               for m in moves[:-2]), moves
    # Each try after a refusal waited out the environment's cooldown (the journal's own clock).
    for back, again in zip(moves, moves[1:]):
        if back[:2] == ("dispatched", "pending") and again[:2] == ("pending", "dispatched"):
            assert (again[2] - back[2]).total_seconds() >= COOLDOWN_S - 0.05, (back, again)
