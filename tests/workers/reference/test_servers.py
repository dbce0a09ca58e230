"""Each reference server on its own: retire marks that survive SIGKILL, restart-only modes, the
agent's retry of a parked model, and bad command lines."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.reference_procs import REPO, TOKEN, ParticipantClient, Procs, deadline
from workers.participant.kinds.agent import RESTART_HEADER
from workers.participant.kinds.resources import VERIFY_HEADER

pytestmark = pytest.mark.slow

UNREACHABLE = "http://127.0.0.1:9"  # a downstream these tests never reach

#: kind -> (extra arguments, a data-plane request of rollout ``r1`` attempt 0: path, body)
DATA_REQUESTS: dict[str, tuple[tuple[str, ...], str, dict[str, Any]]] = {
    "model": ((), "/ng-rollout/r1/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "agent": (("--model", UNREACHABLE), "/ng-rollout/r1/v1/agent_sessions", {"prompt": "hi"}),
    "resources": ((), "/ng-rollout/r1/seed_session", {"prompt": "hi"}),
}


@pytest.mark.parametrize("kind", sorted(DATA_REQUESTS))
async def test_retired_attempt_is_refused_after_sigkill_until_forget(
        kind: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    args, path, body = DATA_REQUESTS[kind]
    state = tmp_path / "state"
    proc = procs.start(kind, state, *args)
    retired = await c.ok(proc.url, "retire", {"checkpoint_id": "retire-1", "deadline_ts": deadline(),
                                              "episode_ids": [{"rollout_id": "r1", "attempt": 0}]})
    assert retired == {"retired_count": 1}
    status, reply = await c.post(proc.url, path, body)
    assert (status, reply["error"]["code"]) == (409, "stale_attempt")

    proc.kill()
    proc = procs.start(kind, state, *args)

    assert (await c.status(proc.url))["retired_rollouts"] == 1
    status, reply = await c.post(proc.url, path, body)
    assert (status, reply["error"]["code"]) == (409, "stale_attempt"), reply
    forgot = await c.ok(proc.url, "forget", {"checkpoint_id": "forget-1", "deadline_ts": deadline(),
                                             "rollout_ids": ["r1"]})
    assert forgot == {"forgotten_count": 1}
    status, reply = await c.post(proc.url, path, body)
    assert status == 200, reply
    assert (await c.status(proc.url))["retired_rollouts"] == 0


async def test_the_environment_reads_the_attempt_from_an_attempt_qualified_id(
        procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """``"r-a2"`` runs as attempt 2 of ``r`` (the seeded sessions and step counts are keyed ``r-a2``);
    a body naming an attempt both ways is refused, and so is an id whose rest is reserved again."""
    from tests.support.reference_procs import start_stack
    stack = await start_stack(procs, {k: tmp_path / k for k in ("environment", "model", "agent", "resources")})
    env = stack.url("environment")
    task = {"prompt": "hi", "turns": 1}
    status, reply = await controller.post(env, "/run", {"rollout_id": "r-a2", "task": task})
    assert status == 200 and (reply["rollout_id"], reply["attempt"]) == ("r", 2), reply
    executions = (await controller.status(env))["executions"]
    assert set(executions) == {"r-a2"}, executions
    status, reply = await controller.post(env, "/run", {"rollout_id": "q-a1", "attempt": 1, "task": task})
    assert (status, reply["error"]["code"]) == (422, "invalid_request"), reply
    assert "names an attempt by its suffix and attempt=1 names one too" in reply["error"]["detail"], reply
    status, reply = await controller.post(env, "/run", {"rollout_id": "q-a1-a2", "task": task})
    assert (status, reply["error"]["code"]) == (422, "invalid_request"), reply
    assert "q" not in "".join((await controller.status(env))["executions"]), "nothing ran for a refused body"


@pytest.mark.parametrize(("kind", "args", "path"), [
    ("agent", ("--model", UNREACHABLE, "--restart-only"), "/ng-rollout/r1/v1/agent_sessions"),
    ("resources", ("--mode", "restart_only"), "/ng-rollout/r1/seed_session"),
])
async def test_restart_only_servers_mark_their_sessions_restarts(
        kind: str, args: tuple[str, ...], path: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    c = controller
    proc = procs.start(kind, tmp_path / "state", *args)
    async with c.http.post(f"{proc.url}{path}", json={"prompt": "hi"}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers.get(RESTART_HEADER) == "1"
    prepared = await c.ok(proc.url, "prepare", {"checkpoint_id": "ckpt-1", "deadline_ts": deadline()})
    assert prepared["phase"] == "prepared" and prepared["report"]["restarts"] == ["r1"]
    status, reply = await c.control(proc.url, "commit", {
        "checkpoint_id": "ckpt-1", "deadline_ts": deadline(), "checkpoint_dir": str(tmp_path / "ckpt"),
        "episode_ids": [{"rollout_id": "r1"}]})
    assert (status, reply["error"]["code"]) == (409, "restart_in_scope")
    await c.ok(proc.url, "resume", {"checkpoint_id": "ckpt-1", "deadline_ts": deadline()})


async def test_resources_seed_reply_says_the_verify_mode(procs: Procs, controller: ParticipantClient,
                                                         tmp_path: Path) -> None:
    proc = procs.start("resources", tmp_path / "state", "--verify-mode", "replay")
    async with controller.http.post(f"{proc.url}/ng-rollout/r1/seed_session", json={"prompt": "hi"}) as resp:
        assert resp.status == 200
        assert resp.headers.get(VERIFY_HEADER) == "replay" and RESTART_HEADER not in resp.headers
        session_id = (await resp.json())["session_id"]
    status, reply = await controller.post(proc.url, "/ng-rollout/r1/verify",
                                          {"session_id": session_id, "actions": ["ab"]})
    assert (status, reply["error"]["code"]) == (422, "invalid_request")  # it checked no action
    status, reply = await controller.post(proc.url, "/ng-rollout/r1/close_session", {"session_id": session_id})
    assert (status, reply) == (200, {"closed": True})
    assert (await controller.status(proc.url))["sessions"] == 0


async def test_agent_retries_a_parked_model_and_stays_at_its_boundary(
        procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    """While the model's checkpoint is open it refuses new calls; the agent asks again, at its
    boundary (not blocking its own checkpoint), and completes the turn once the model resumes."""
    c = controller
    model = procs.start("model", tmp_path / "model")
    agent = procs.start("agent", tmp_path / "agent", "--model", model.url)
    status, seeded = await c.post(agent.url, "/ng-rollout/r1/v1/agent_sessions", {"prompt": "hi"})
    assert (status, seeded) == (200, {"session_key": "r1", "turns": 0})
    prepared = await c.ok(model.url, "prepare", {"checkpoint_id": "ckpt-1", "deadline_ts": deadline()})
    assert prepared["phase"] == "prepared"

    act = asyncio.create_task(c.post(agent.url, "/ng-rollout/r1/v1/act", {"turn": 1}))
    await asyncio.sleep(0.5)
    assert not act.done()
    assert (await c.status(agent.url))["report"]["counts"]["at_boundary"] == 1
    agent_prepared = await c.ok(agent.url, "prepare", {"checkpoint_id": "ckpt-a", "deadline_ts": deadline()})
    assert agent_prepared["phase"] == "prepared"
    await c.ok(agent.url, "resume", {"checkpoint_id": "ckpt-a", "deadline_ts": deadline()})
    await c.ok(model.url, "resume", {"checkpoint_id": "ckpt-1", "deadline_ts": deadline()})

    status, acted = await asyncio.wait_for(act, 10)
    assert status == 200 and len(acted["action"]) == 12
    status, again = await c.post(agent.url, "/ng-rollout/r1/v1/act", {"turn": 1})
    assert (status, again) == (200, acted)  # an answered turn is answered from the conversation
    assert (await c.status(model.url))["executions"] == {"r1": {"generate-1": 1}}
    assert (await c.status(agent.url))["executions"] == {"r1": {"act-1": 2}}


def _run(kind: str, *args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TIDELOG_CONTROL_TOKEN"}
    if token is not None:
        env["TIDELOG_CONTROL_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", f"workers.reference.{kind}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)


MINIMAL_ARGS = {
    "environment": ("--agent", UNREACHABLE, "--resources", UNREACHABLE),
    "model": (),
    "agent": ("--model", UNREACHABLE),
    "resources": (),
}


@pytest.mark.parametrize("token", [None, ""], ids=["unset", "empty"])
@pytest.mark.parametrize("kind", sorted(MINIMAL_ARGS))
def test_missing_control_token_exits_naming_the_variable(kind: str, token: str | None, tmp_path: Path) -> None:
    done = _run(kind, "--port", "0", "--state-dir", str(tmp_path), *MINIMAL_ARGS[kind], token=token)
    assert done.returncode != 0
    assert "TIDELOG_CONTROL_TOKEN" in done.stderr
    assert "listening on" not in done.stdout


@pytest.mark.parametrize(("kind", "args", "message"), [
    ("model", ("--step-delay", "-1"), "--step-delay"),
    ("resources", ("--mode", "stateless"), "--mode"),
    ("agent", ("--lease-grace-seconds", "0", "--model", UNREACHABLE), "--lease-grace-seconds"),
    ("environment", (), "--agent"),
])
def test_bad_arguments_exit_nonzero_with_a_message(kind: str, args: tuple[str, ...], message: str,
                                                   tmp_path: Path) -> None:
    done = _run(kind, "--port", "0", "--state-dir", str(tmp_path), *args, token=TOKEN)
    assert done.returncode != 0
    assert message in done.stderr
