"""The reference task end to end on four real processes: whole episodes, and a crash mid-episode.

Every step of every rollout must complete exactly once, summed over the processes that ran
it (``r`` and ``r-a1`` are the same rollout), and an episode continued after a checkpoint,
a SIGKILL of every server and a restore must finish with what an uninterrupted run gives.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.reference_procs import KINDS, ParticipantClient, Procs, Stack, deadline, start_stack
from tests.support.workflows import by_rollout, steps_of
from workers.protocol import EpisodeId
from workers.reference.model import action_for
from workers.reference.resources import check_ok

pytestmark = pytest.mark.slow

TURNS = 3
TASKS = {f"r{i}": {"prompt": f"reference task {i}", "turns": TURNS} for i in range(4)}


def expected_result(prompt: str, turns: int) -> dict[str, Any]:
    """What the reference task gives, computed from the model's and the verifier's rules."""
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    actions = []
    for _ in range(turns):
        actions.append(action_for(messages))
        messages.append({"role": "assistant", "content": actions[-1]})
    checks = [check_ok(a) for a in actions]
    return {"actions": actions, "checks": checks, "reward": sum(checks) / len(checks)}


def state_dirs(root: Path) -> dict[str, Path]:
    return {kind: root / kind for kind in KINDS}


async def test_full_episode_runs_every_step_once(procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, state_dirs(tmp_path / "state"))
    task = {"prompt": "a whole episode", "turns": TURNS}

    result = await controller.run(stack.url("environment"), "whole", task)

    assert result == {"rollout_id": "whole", "attempt": 0, **expected_result("a whole episode", TURNS)}
    assert len(set(result["actions"])) == TURNS
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["executions"] == {"whole": {step: 1 for step in steps_of(kind, TURNS)}}, kind
        assert status["phase"] == "idle" and status["report"]["ready"]
    # A finished episode leaves nothing behind: its agent session and model ledger are freed.
    assert (await controller.status(stack.url("agent")))["sessions"] == 0
    assert (await controller.status(stack.url("model")))["ledgers"] == 0
    assert (await controller.status(stack.url("resources")))["session_states"] == 0


async def until(check: Any, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.02)


class Checkpointed:
    """What one checkpoint-crash-restore drill saw: executions before and after, commit replies."""

    def __init__(self) -> None:
        self.old: dict[str, Any] = {}
        self.new: dict[str, Any] = {}
        self.commits: dict[str, dict[str, Any]] = {}
        self.prepared: dict[str, dict[str, Any]] = {}
        self.results: list[dict[str, Any]] = []


async def checkpoint_crash_restore(c: ParticipantClient, procs: Procs, stack: Stack, dirs: dict[str, Path],
                                   tasks: dict[str, dict[str, Any]], runs: list[asyncio.Task[Any]],
                                   checkpoint_dir: Path) -> Checkpointed:
    """As the controller: checkpoint the stack mid-episode, SIGKILL it, restore fresh processes on the
    same state dirs, resume them and run every episode again as attempt 1."""
    seen = Checkpointed()
    env = stack.url("environment")
    # Prepare stage by stage; commit the environment without a scope (it exports every episode it
    # holds), then the others with its episodes as the scope.
    cid = "ckpt-1"
    for kind in KINDS:
        reply = await c.ok(stack.url(kind), "prepare", {"checkpoint_id": cid, "deadline_ts": deadline()})
        assert reply["phase"] == "prepared", (kind, reply)
        assert reply["report"]["restarts"] == []
        seen.prepared[kind] = reply
    env_commit = await c.ok(env, "commit", {"checkpoint_id": cid, "deadline_ts": deadline(),
                                            "checkpoint_dir": str(checkpoint_dir)})
    assert sorted(env_commit["episode_ids"]) == sorted(tasks), "every episode is in flight"
    scope = [EpisodeId.from_capture_key(k).model_dump() for k in env_commit["episode_ids"]]
    seen.commits["environment"] = env_commit
    for kind in ("model", "agent", "resources"):
        seen.commits[kind] = await c.ok(stack.url(kind), "commit", {
            "checkpoint_id": cid, "deadline_ts": deadline(), "checkpoint_dir": str(checkpoint_dir),
            "episode_ids": scope})
        assert seen.commits[kind]["phase"] == "committed"
    seen.old = {kind: (await c.status(stack.url(kind)))["executions"] for kind in KINDS}

    stack.kill()
    crashed = await asyncio.gather(*runs, return_exceptions=True)
    assert all(isinstance(r, BaseException) for r in crashed), crashed

    fresh = await start_stack(procs, dirs)
    rid = "restore-1"
    for kind in KINDS:
        reply = await c.ok(fresh.url(kind), "restore", {"checkpoint_id": rid, "deadline_ts": deadline(),
                                                        "checkpoint_dir": str(checkpoint_dir), "episode_ids": scope})
        assert reply["phase"] == "restored" and reply["source_checkpoint_id"] == cid
        assert reply["restored"] == sorted(f"{r}-a1" for r in tasks)
    for kind in reversed(KINDS):
        await c.ok(fresh.url(kind), "resume", {"checkpoint_id": rid, "deadline_ts": deadline()})
    seen.results = list(await asyncio.gather(
        *(c.run(fresh.url("environment"), r, tasks[r], attempt=1) for r in tasks)))
    seen.new = {kind: (await c.status(fresh.url(kind)))["executions"] for kind in KINDS}
    resources = await c.status(fresh.url("resources"))
    assert (resources["sessions"], resources["session_states"]) == (0, 0), "every session ended and was freed"
    return seen


def assert_every_step_once(seen: Checkpointed, tasks: dict[str, dict[str, Any]]) -> None:
    for kind in KINDS:
        assert by_rollout(seen.old[kind], seen.new[kind]) == {
            r: Counter(dict.fromkeys(steps_of(kind, t["turns"]), 1)) for r, t in tasks.items()}, (
            kind, seen.old[kind], seen.new[kind])
        assert all(key.endswith("-a1") for key in seen.new[kind]), seen.new[kind]
    # The model exported exactly the rows of delivered calls: a staging key per delivered generation.
    old_model = seen.old["model"]
    by_episode = seen.commits["model"]["staging_keys_by_episode"]
    assert set(by_episode) == set(old_model)
    for key, keys in by_episode.items():
        assert keys == sorted(f"{key}/{step.removeprefix('generate-')}" for step in old_model[key])


async def test_checkpoint_mid_episode_then_sigkill_continues_every_step_once(
        procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    # What uninterrupted runs of the same tasks give, on a separate clean set of servers.
    clean = await start_stack(procs, state_dirs(tmp_path / "clean"))
    expected = dict(zip(TASKS, await asyncio.gather(
        *(c.run(clean.url("environment"), rid, task) for rid, task in TASKS.items()))))
    clean.kill()
    for rid, result in expected.items():
        assert {k: result[k] for k in ("actions", "checks", "reward")} == expected_result(
            TASKS[rid]["prompt"], TURNS)

    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, env_delay=0.2, model_delay=0.05)
    env = stack.url("environment")

    async def staggered(i: int, rid: str) -> dict[str, Any]:
        await asyncio.sleep(0.12 * i)
        return await c.run(env, rid, TASKS[rid])
    runs = [asyncio.create_task(staggered(i, rid)) for i, rid in enumerate(TASKS)]

    async def all_live() -> bool:
        return bool((await c.status(env))["episodes"] == len(TASKS))
    await until(all_live)
    await asyncio.sleep(0.35)  # the first ones are into their second turn, the last still in its first

    seen = await checkpoint_crash_restore(c, procs, stack, dirs, TASKS, runs, tmp_path / "checkpoint")

    assert sum(sum(steps.values()) for steps in seen.old["environment"].values()) > 0, "some steps ran before"
    assert any("verify" not in steps for steps in seen.old["environment"].values()), "checkpointed mid-episode"
    for result in seen.results:
        want = expected[result["rollout_id"]]
        assert result["attempt"] == 1
        assert (result["actions"], result["checks"], result["reward"]) == (
            want["actions"], want["checks"], want["reward"])
    assert_every_step_once(seen, TASKS)


async def test_response_held_at_checkpoint_is_generated_again_after_crash(
        procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """A policy call generating when the checkpoint closes is held, left out of the commit and,
    after the crash, asked again: its step completes once, in the new processes."""
    c = controller
    dirs = state_dirs(tmp_path / "state")
    stack = await start_stack(procs, dirs, model_delay=1.5)
    tasks = {"held": {"prompt": "held at the checkpoint", "turns": 2}}
    runs = [asyncio.create_task(c.run(stack.url("environment"), "held", tasks["held"]))]

    async def generating() -> bool:
        return bool((await c.status(stack.url("model")))["inflight"] == 1)
    await until(generating)

    seen = await checkpoint_crash_restore(c, procs, stack, dirs, tasks, runs, tmp_path / "checkpoint")

    # Still generating when prepared (admitted, not yet held), so nothing blocked the checkpoint.
    assert seen.prepared["model"]["report"]["counts"] == {"inflight": 1, "held": 0, "streaming": 0}
    assert seen.prepared["agent"]["report"]["counts"]["at_boundary"] == 1
    assert seen.old["model"] == {} and seen.old["agent"] == {} and seen.old["environment"] == {}
    assert seen.commits["model"]["staging_keys"] == []
    assert seen.commits["environment"]["episode_ids"] == ["held"]
    assert seen.results[0]["actions"] == expected_result("held at the checkpoint", 2)["actions"]
    assert_every_step_once(seen, tasks)
