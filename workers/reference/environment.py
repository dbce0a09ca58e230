"""Reference environment server: multi-turn episodes, checkpointable at every step boundary.

``POST /run`` with ``{"rollout_id", "attempt"?, "task": {"prompt", "turns"}}`` runs
one attempt of an episode and answers ``{"rollout_id", "attempt", "actions",
"checks", "reward"}``. The attempt is ``attempt`` (default 0) or, as the protocol's agents read
it, the suffix of an attempt-qualified ``rollout_id`` (``"r-a2"`` is attempt 2 of ``r``, which is
how Tidelog sends every attempt after the first); a body that sets both is refused
(``invalid_request``), since the two would contradict each other. The episode:

1. seeds a resources session (``/seed_session``; its reply says the verify mode
   and whether the episode is a restart) and an agent session;
2. each turn runs two steps, each followed by a boundary: ``act`` (replay mode:
   the agent asks the policy model for an action; the model holds its response
   while a checkpoint is open, so the step is exported at the boundary before it
   and, after a crash, asked again) and ``check`` (wait mode: the resources
   server checks the action, and a checkpoint waits for it);
3. finally ``verify`` (in the mode the resources server chose) scores the whole
   episode; the environment ends the agent session (which frees the model's
   ledger of the episode) and returns.

Every boundary is ``{"turn", "next", "session_id", "actions", "checks", ...}``; a
restored attempt continues from its boundary, so no completed step runs again.
Status shows ``executions``: per capture key, how often each step *completed* here (a
replayed ``act`` whose answer was never delivered did not complete), so across a crash
and restore every step of a rollout completes exactly once.

    TIDELOG_CONTROL_TOKEN=... python -m workers.reference.environment --port 8104 \\
        --state-dir /var/lib/ref/env --agent http://127.0.0.1:8103 --resources http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..participant.kinds.agent import RESTART_HEADER
from ..participant.kinds.environment import Episode, EnvironmentParticipant
from ..participant.kinds.resources import verify_mode_of
from ..protocol import ATTEMPT_SUFFIX, EpisodeId, ErrorCode, ProtocolError
from . import _common
from ._common import Executions, json_response, read_json


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=10_000)
    turns: int = Field(ge=1, le=100)


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    attempt: int | None = Field(default=None, ge=0)
    task: Task

    def episode(self) -> EpisodeId:
        """The attempt this body names: ``attempt``, or the ``-a<N>`` suffix of ``rollout_id``."""
        if ATTEMPT_SUFFIX.search(self.rollout_id) is None:
            return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt or 0)
        if self.attempt is not None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"invalid /run body: rollout_id {self.rollout_id!r} names an attempt by its suffix "
                                f"and attempt={self.attempt} names one too; send one of them")
        return EpisodeId.from_capture_key(self.rollout_id)


class ReferenceEnvironment(EnvironmentParticipant):
    """The environment participant plus this server's step counts in its status."""

    def __init__(self, instance: str) -> None:
        super().__init__(instance)
        self.executions = Executions()

    def status_extra(self) -> dict[str, Any]:
        return {**super().status_extra(), "executions": self.executions.snapshot()}


class Downstream:
    """Data-plane calls to the agent and resources servers, under the rollout path prefix."""

    def __init__(self, agent: str, resources: str, session: aiohttp.ClientSession) -> None:
        self.agent = agent.rstrip("/")
        self.resources = resources.rstrip("/")
        self.http = session

    async def post(self, base: str, key: str, path: str, body: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, str]]:
        async with self.http.post(f"{base}/ng-rollout/{key}/{path}", json=body) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200:
                error = reply.get("error", {}) if isinstance(reply, dict) else {}
                code = error.get("code")
                if code in {c.value for c in ErrorCode}:
                    raise ProtocolError(ErrorCode(code), f"{path} on {base}: {error.get('detail')}")
                raise RuntimeError(f"{path} on {base} answered HTTP {resp.status}: {reply}")
            return reply, dict(resp.headers)


async def run_episode(env: ReferenceEnvironment, down: Downstream, ep: Episode, task: Task,
                      step_delay: float) -> dict[str, Any]:
    key = ep.key
    state: dict[str, Any]
    if ep.continuation is None:
        seeded, headers = await down.post(down.resources, key, "seed_session", {"prompt": task.prompt})
        state = {"turn": 0, "next": "act", "session_id": seeded["session_id"], "actions": [], "checks": [],
                 "verify_mode": verify_mode_of(headers), "restart": headers.get(RESTART_HEADER) == "1"}
    else:
        state = dict(ep.continuation)
    _, agent_headers = await down.post(down.agent, key, "v1/agent_sessions", {"prompt": task.prompt})
    if state["restart"] or agent_headers.get(RESTART_HEADER) == "1":
        await ep.mark_restart()
    while state["next"] != "return":
        if state["next"] == "act":
            turn = state["turn"] + 1
            async with ep.step("replay"):
                await asyncio.sleep(step_delay)
                acted, _ = await down.post(down.agent, key, "v1/act", {"turn": turn})
                env.executions.count(key, f"turn-{turn}:act")
            state = {**state, "turn": turn, "next": "check", "pending": acted["action"]}
        elif state["next"] == "check":
            turn = state["turn"]
            async with ep.step("wait"):
                await asyncio.sleep(step_delay)
                checked, _ = await down.post(down.resources, key, "check",
                                             {"session_id": state["session_id"], "action": state["pending"]})
                env.executions.count(key, f"turn-{turn}:check")
            state = {**state, "next": "act" if turn < task.turns else "verify",
                     "actions": [*state["actions"], state["pending"]], "checks": [*state["checks"], checked["ok"]]}
            state.pop("pending")
        else:  # verify
            async with ep.step(state["verify_mode"]):
                await asyncio.sleep(step_delay)
                verified, _ = await down.post(down.resources, key, "verify",
                                              {"session_id": state["session_id"], "actions": state["actions"]})
                env.executions.count(key, "verify")
            state = {**state, "next": "return", "reward": verified["reward"]}
        await ep.boundary(state)
    # Free the episode's agent session and model ledger. A replay step: it is idempotent, and it
    # must not block a checkpoint that closes meanwhile (the model refuses releases until resume).
    async with ep.step("replay"):
        await down.post(down.agent, key, "v1/agent_sessions/end", {})
    return {"actions": state["actions"], "checks": state["checks"], "reward": state["reward"]}


def build_app(args: argparse.Namespace, token: str) -> web.Application:
    env = ReferenceEnvironment(args.instance)
    app = _common.build(env, args, token)
    holder: dict[str, Downstream] = {}

    async def start(_app: web.Application) -> None:
        holder["down"] = Downstream(args.agent, args.resources, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)))

    async def stop(_app: web.Application) -> None:
        await holder["down"].http.close()

    async def run(request: web.Request) -> web.Response:
        try:
            req = RunRequest.model_validate(await read_json(request))
            episode = req.episode()
        except ValidationError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"invalid /run body: {exc.errors()[0]['msg']}") from None
        task = req.task.model_dump()
        async with env.episode(episode, task) as ep:
            result = await run_episode(env, holder["down"], ep, req.task, args.step_delay)
        return json_response({"rollout_id": episode.rollout_id, "attempt": episode.attempt, **result})

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/run", run)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = _common.parser("environment", "Reference environment server (checkpointable multi-turn episodes).")
    p.add_argument("--agent", required=True, help="base URL of the agent server")
    p.add_argument("--resources", required=True, help="base URL of the resources server")
    p.add_argument("--step-delay", type=_common.finite_float(minimum=0), default=0.0,
                   help="seconds each step takes (default 0)")
    _common.main(argv, build_app, p)


if __name__ == "__main__":
    main()
