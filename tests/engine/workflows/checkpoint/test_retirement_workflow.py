"""The retire and forget workflow through the whole orchestrator, against the four reference
participants as real processes, on both journal backends: a retire waits for an open checkpoint,
runs callers first and leaves the attempt refused on every data plane; a forget of a live rollout is
refused; a forget of the retired one lifts the marks."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.workflows.checkpoint.retirement import (RETIRE_ORDER, InvalidRetirement, RetirementController, RetirementSettings, request_retirement)
from engine.runtime.service import Orchestrator
from journal import models
from tests.support.reference_procs import KINDS, ParticipantClient, Procs, Stack, start_stack
from tests.support.workflows import (
    rpc_calls,
    add_rollouts,
    events,
    settings,
    state_dirs,
    probed,
    table,
    until,
    wait_healthy,
    wait_terminal,
)
from workers.protocol import EpisodeId

pytestmark = pytest.mark.slow

TASK = {"prompt": "retire me", "turns": 3}
#: kind -> a data-plane request of rollout r1 attempt 0 (path, body)
DATA_PLANE: dict[str, tuple[str, dict[str, Any]]] = {
    "environment": ("/run", {"rollout_id": "r1", "attempt": 0, "task": TASK}),
    "model": ("/ng-rollout/r1/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "agent": ("/ng-rollout/r1/v1/agent_sessions", {"prompt": "hi"}),
    "resources": ("/ng-rollout/r1/seed_session", {"prompt": "hi"}),
}


async def retirement(orch: Orchestrator, retirement_id: str, op: Any, **kw: Any) -> dict[str, Any]:
    async def request(tx: Any) -> None:
        await request_retirement(tx, retirement_id, op, **kw)
    await orch.committer.run(request)
    return await wait_terminal(orch, models.retirements, retirement_id, ("done", "failed"))


async def calls_by_stage(orch: Orchestrator, stack: Stack, retirement_id: str) -> list[list[dict[str, Any]]]:
    kind_of = {stack.url(k): k for k in KINDS}
    calls = [c for c in (await rpc_calls(orch)).values() if c["entity_id"] == retirement_id]
    return [[c for c in calls if kind_of[c["target"]] in kinds] for kinds in RETIRE_ORDER]


def assert_callers_first(stages: list[list[dict[str, Any]]], op: str) -> None:
    assert [sorted(c["path"].rsplit("/", 1)[1] for c in s) for s in stages] == [[op], [op], [op, op]]
    assert all(c["state"] == "succeeded" for s in stages for c in s)
    for earlier, later in zip(stages, stages[1:]):
        # A stage's calls are created only once every call of the stage before has answered.
        assert max(c["updated_at"] for c in earlier) <= min(c["created_at"] for c in later)


async def test_retire_waits_for_the_checkpoint_then_forget_lifts_the_marks(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=0.3)
    orch = Orchestrator(settings(journal_url, stack, prepare_timeout_s=10),
                        controllers=[RetirementController(RetirementSettings(retire_timeout_s=20, poll_s=0.1))])
    await orch.start()
    try:
        participants = await wait_healthy(orch, stack)
        await add_rollouts(orch, {"r1": TASK, "live": TASK})
        run = asyncio.create_task(c.run(stack.url("environment"), "r1", TASK))

        async def live() -> bool:
            return bool((await c.status(stack.url("environment")))["episodes"] == 1)
        while not await live():
            await asyncio.sleep(0.02)

        # A checkpoint is open when the retire is requested: the retire stays queued until it ends.
        async def both(tx: Any) -> None:
            await start_checkpoint(tx, "ck-open", str(tmp_path / "ckpts"), participants)
            await request_retirement(tx, "retire-1", "retire", episodes=[EpisodeId(rollout_id="r1")])
        await orch.committer.run(both)
        seen_queued = 0
        while (await table(orch, models.checkpoints))["ck-open"]["state"] not in ("done", "aborted", "failed"):
            assert (await table(orch, models.retirements))["retire-1"]["state"] == "queued"
            seen_queued += 1
            await asyncio.sleep(0.02)
        retired = await wait_terminal(orch, models.retirements, "retire-1", ("done", "failed"))
        checkpoint_end = (await events(orch, "checkpoints", "ck-open"))[-1]
        trail = await events(orch, "retirements", "retire-1")
        retire_stages = await calls_by_stage(orch, stack, "retire-1")
        rollouts = await table(orch, models.rollouts)
        crashed = (await asyncio.gather(run, return_exceptions=True))[0]
        statuses = {k: await c.status(stack.url(k)) for k in KINDS}
        refused = {k: await c.post(stack.url(k), path, body) for k, (path, body) in DATA_PLANE.items()}

        # A forget of a rollout still live is refused before anything is sent.
        refused_forget = await retirement(orch, "forget-live", "forget", rollout_ids=["live", "r1"])
        forget_live_calls = [x for x in (await rpc_calls(orch)).values()
                             if x["entity_id"] == "forget-live"]
        forgotten = await retirement(orch, "forget-1", "forget", rollout_ids=["r1"])
        forget_stages = await calls_by_stage(orch, stack, "forget-1")
        rollouts_after = await table(orch, models.rollouts)
    finally:
        await orch.stop()

    assert seen_queued > 0 and checkpoint_end["to_state"] == "done"
    assert retired["state"] == "done" and retired["detail"] is None, retired
    assert [e["to_state"] for e in trail] == ["queued", "running", "running", "running", "done"]
    assert trail[1]["ts"] >= checkpoint_end["ts"], "left the queue only once the checkpoint ended"
    assert_callers_first(retire_stages, "retire")
    body = retire_stages[0][0]["body"]
    assert body["episode_ids"] == [{"rollout_id": "r1", "attempt": 0}] and body["checkpoint_id"].startswith("retire-")
    assert rollouts["r1"]["state"] == "retired" and rollouts["live"]["state"] == "dispatched"
    assert isinstance(crashed, BaseException), crashed  # the running attempt was stopped
    for kind, status in statuses.items():
        assert status["retired_rollouts"] == 1 and status["phase"] == "idle", (kind, status)
    assert statuses["environment"]["episodes"] == 0
    for kind, (code, reply) in refused.items():
        assert (code, reply["error"]["code"]) == (409, "stale_attempt"), (kind, reply)

    assert refused_forget["state"] == "failed" and "live" in refused_forget["detail"], refused_forget
    assert "r1" not in refused_forget["detail"].split(": ", 1)[1] and forget_live_calls == []
    assert forgotten["state"] == "done", forgotten
    assert_callers_first(forget_stages, "forget")
    assert forget_stages[0][0]["body"]["rollout_ids"] == ["r1"]
    assert rollouts_after["r1"]["state"] == "forgotten" and rollouts_after["live"]["state"] == "dispatched"
    for kind in KINDS:
        assert (await c.status(stack.url(kind)))["retired_rollouts"] == 0, kind
    # The attempt is accepted again: the whole episode runs.
    result = await c.run(stack.url("environment"), "r1", TASK)
    assert result["attempt"] == 0 and len(result["actions"]) == TASK["turns"]


async def test_a_retire_a_participant_refuses_fails_with_its_error(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    stack = await start_stack(procs, state_dirs(tmp_path / "state"))
    orch = Orchestrator(settings(journal_url, stack),
                        controllers=[RetirementController(RetirementSettings(retire_timeout_s=20, poll_s=0.1))])
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        # The agent holds a checkpoint open that the journal knows nothing of: it refuses the retire.
        await c.ok(stack.url("agent"), "prepare", {"checkpoint_id": "elsewhere", "deadline_ts": time.time() + 3600})
        row = await retirement(orch, "retire-2", "retire", episodes=[EpisodeId(rollout_id="r9", attempt=2)])
        stages = await calls_by_stage(orch, stack, "retire-2")
    finally:
        await orch.stop()
    assert row["state"] == "failed", row
    assert row["detail"].startswith("retire failed in stage agent on 1 participant(s): agent-0: HTTP 409 checkpoint_conflict")
    assert [len(s) for s in stages] == [1, 1, 0], "later stages never reached"
    assert (await c.status(stack.url("environment")))["retired_rollouts"] == 1  # its mark stays


def test_request_retirement_validates_before_writing() -> None:
    async def call(op: Any, **kw: Any) -> None:
        await request_retirement(None, "x", op, **kw)  # type: ignore[arg-type]
    cases: list[tuple[Any, dict[str, Any], str]] = [
        ("retire", {}, "episodes"),
        ("retire", {"episodes": [EpisodeId(rollout_id="r1")], "rollout_ids": ["r1"]}, "rollout_ids"),
        ("forget", {}, "rollout_ids"),
        ("forget", {"rollout_ids": ["r1-a2"]}, "rollout_ids"),
        ("forget", {"episodes": [EpisodeId(rollout_id="r1")], "rollout_ids": ["r1"]}, "episodes"),
        ("purge", {"rollout_ids": ["r1"]}, "op"),
    ]
    for op, kw, field in cases:
        with pytest.raises(InvalidRetirement) as err:
            asyncio.run(call(op, **kw))
        assert err.value.field == field and isinstance(err.value, ValueError), (op, kw)


async def test_a_retire_waits_for_a_participant_that_is_briefly_unreachable(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """The resources server is SIGSTOPped (its probe times out: unreachable) when a retire starts: the
    model+resources stage waits for it instead of leaving it out, and once it is back (SIGCONT, a
    probe) the stage runs and the retire is done everywhere. A participant that stays down fails
    the retire at the stage's deadline, naming it."""
    c = controller
    stack = await start_stack(procs, state_dirs(tmp_path / "state"))
    base = settings(journal_url, stack)
    s = base.model_copy(update={"discovery": base.discovery.model_copy(update={"probe_timeout_s": 0.5,
                                                                                "probe_tries": 1})})
    orch = Orchestrator(s, controllers=[RetirementController(RetirementSettings(retire_timeout_s=30, poll_s=0.2))])
    resources = stack.procs["resources"].proc
    assert resources is not None
    await orch.start()
    try:
        await wait_healthy(orch, stack)
        resources.send_signal(signal.SIGSTOP)
        await probed(orch, "resources-0", "unreachable")

        async def request(tx: Any) -> None:
            await request_retirement(tx, "rt-wait", "retire", episodes=[EpisodeId(rollout_id="r1", attempt=0)])
        await orch.committer.run(request)

        async def at_last_stage() -> bool:
            return (await table(orch, models.retirements))["rt-wait"]["stage"] == 2
        await until(at_last_stage, 30)
        await asyncio.sleep(1.0)  # a few looks of the waiting stage
        waiting = (await table(orch, models.retirements))["rt-wait"]
        stages = await calls_by_stage(orch, stack, "rt-wait")
        resources.send_signal(signal.SIGCONT)
        await probed(orch, "resources-0", "healthy")
        row = await wait_terminal(orch, models.retirements, "rt-wait", ("done", "failed"))
        after = await calls_by_stage(orch, stack, "rt-wait")
    finally:
        resources.send_signal(signal.SIGCONT)
        await orch.stop()
    assert (waiting["state"], waiting["stage"]) == ("running", 2), waiting
    assert [len(stage) for stage in stages] == [1, 1, 0], stages  # the stage sent nothing while it waited
    assert row["state"] == "done", row
    assert_callers_first(after, "retire")
    for kind in KINDS:
        assert (await c.status(stack.url(kind)))["retired_rollouts"] == 1, kind

    # Down for good: the stage waits out its deadline, then the retire fails naming the participant.
    stack.procs["resources"].kill()
    orch = Orchestrator(s, controllers=[RetirementController(RetirementSettings(retire_timeout_s=2, poll_s=0.2))])
    await orch.start()
    try:
        await probed(orch, "resources-0", "unreachable")
        failed = await retirement(orch, "rt-down", "retire", episodes=[EpisodeId(rollout_id="r2", attempt=0)])
    finally:
        await orch.stop()
    assert failed["state"] == "failed", failed
    assert "stage model+resources: it waited 2 s (checkpoint.retire_timeout_s) for resources-0 is unreachable" \
        in failed["detail"], failed["detail"]
