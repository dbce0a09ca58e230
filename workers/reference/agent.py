"""Reference agent server: one conversation per rollout, checkpointed through session hooks.

- ``POST /ng-rollout/<capture key>/v1/agent_sessions`` with ``{"prompt"}`` seeds the
  episode's session (key: the rollout id, so a replacement attempt claims its restored
  session and continues its conversation) and answers ``{"session_key", "turns"}``
  with the session's headers (the restart header when restart-only).
- ``POST /ng-rollout/<capture key>/v1/act`` with ``{"turn": n}`` runs one activation:
  a boundary, then (the session ``at_boundary`` meanwhile) the policy model is asked
  ``{--model}/ng-rollout/<capture key>/v1/chat/completions`` with the conversation,
  whose reply is appended to it; answers ``{"action"}``. A turn the conversation
  already answered (its reply was delivered before a crash) is answered from it,
  without asking the model again. A call the model refuses with ``checkpoint_parked``
  is retried until it is admitted.
- ``POST /ng-rollout/<capture key>/v1/agent_sessions/end`` forgets the finished
  episode's session and conversation and asks the model to release its ledger.

The conversation is the session state the hooks (:class:`Conversations`) export and
restore. ``--restart-only`` runs without hooks: every session is a restart. Status
shows ``executions``: per capture key, how often each ``act-<turn>`` completed here.

    TIDELOG_CONTROL_TOKEN=... python -m workers.reference.agent --port 8103 \\
        --state-dir /var/lib/ref/agent --model http://127.0.0.1:8101
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from ..participant.kinds.agent import AgentParticipant, RestoredSession
from ..protocol import ErrorCode, ProtocolError
from . import _common
from ._common import Executions, episode_of, json_response, read_json

#: How long the agent waits before re-asking a model that answered ``checkpoint_parked``.
PARKED_RETRY_S = 0.05
Conversation = list[dict[str, str]]


def _is_conversation(value: Any) -> bool:
    return (isinstance(value, list) and len(value) >= 1
            and all(isinstance(m, dict) and set(m) == {"role", "content"}
                    and isinstance(m["role"], str) and isinstance(m["content"], str) for m in value))


def assistant_turns(conversation: Conversation) -> list[str]:
    return [m["content"] for m in conversation if m["role"] == "assistant"]


class Conversations:
    """The session hooks: each session's state is ``{"messages": conversation}``."""

    def __init__(self) -> None:
        self.by_key: dict[str, Conversation] = {}

    async def export_sessions(self, keys: Sequence[str]) -> Mapping[str, Any]:
        return {k: {"messages": [dict(m) for m in self.by_key[k]]} for k in keys if k in self.by_key}

    async def restore_sessions(self, sessions: Sequence[RestoredSession]) -> None:
        for s in sessions:  # validate all, then install all
            if not isinstance(s.session, dict) or not _is_conversation(s.session.get("messages")):
                raise ValueError(f"session {s.session_key!r} holds no valid conversation")
        for s in sessions:
            self.by_key[s.session_key] = [dict(m) for m in s.session["messages"]]

    async def retire_session(self, key: str) -> None:
        self.by_key.pop(key, None)


class ReferenceAgent(AgentParticipant):
    """The agent participant plus this server's step counts in its status."""

    def __init__(self, instance: str, conversations: Conversations, *, restart_only: bool) -> None:
        super().__init__(instance, hooks=None if restart_only else conversations)
        self.conversations = conversations
        self.executions = Executions()

    def status_extra(self) -> dict[str, Any]:
        return {**super().status_extra(), "executions": self.executions.snapshot()}


async def ask_model(http: aiohttp.ClientSession, url: str, messages: Conversation) -> str:
    """The model's action for ``messages``; retries while the model is parked by a checkpoint."""
    while True:
        async with http.post(url, json={"messages": messages}) as resp:
            reply = await resp.json(content_type=None)
        if resp.status == 200:
            content = reply["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise RuntimeError(f"the model answered a non-string content: {content!r}")
            return content
        error = reply.get("error", {}) if isinstance(reply, dict) else {}
        code = error.get("code")
        if code == ErrorCode.CHECKPOINT_PARKED.value:
            await asyncio.sleep(PARKED_RETRY_S)
            continue
        if code in {c.value for c in ErrorCode}:
            raise ProtocolError(ErrorCode(code), f"the policy model refused the call: {error.get('detail')}")
        raise RuntimeError(f"the policy model answered HTTP {resp.status}: {reply}")


def build_app(args: argparse.Namespace, token: str) -> web.Application:
    conversations = Conversations()
    agent = ReferenceAgent(args.instance, conversations, restart_only=args.restart_only)
    app = _common.build(agent, args, token)
    model_base = args.model.rstrip("/")
    holder: dict[str, aiohttp.ClientSession] = {}

    async def start(_app: web.Application) -> None:
        holder["http"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def stop(_app: web.Application) -> None:
        await holder["http"].close()

    async def seed(request: web.Request) -> web.Response:
        episode = episode_of(request)
        prompt = _common.text_field(await read_json(request), "prompt")  # kept in the conversation
        key = episode.rollout_id
        prior = agent.get(key)
        try:
            session = await agent.seed(key, episode)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        conversation = conversations.by_key.get(key)
        if session is not prior or conversation is None:
            conversation = conversations.by_key[key] = [{"role": "user", "content": prompt}]
        elif conversation[0]["content"] != prompt:
            raise ProtocolError(ErrorCode.CHECKPOINT_CONFLICT,
                                f"session {key!r} holds the conversation of another prompt")
        return json_response({"session_key": key, "turns": len(assistant_turns(conversation))},
                             headers=session.headers)

    async def act(request: web.Request) -> web.Response:
        episode = episode_of(request)
        turn = (await read_json(request)).get("turn")
        if not isinstance(turn, int) or isinstance(turn, bool) or turn < 1:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "turn must be an integer >= 1")
        agent.check_attempt(episode)
        key = episode.rollout_id
        session = agent.get(key)
        if session is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"no agent session for {key!r}: seed it first")
        if session.episode != episode:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"session {key!r} belongs to attempt "
                                f"{session.episode.attempt}, not {episode.attempt}")
        async with session.activation():
            await session.boundary(lambda: {"turns": len(assistant_turns(conversations.by_key.get(key, [])))})
            conversation = conversations.by_key[key]
            done = assistant_turns(conversation)
            if turn <= len(done):
                action = done[turn - 1]  # delivered before a crash: answer from the conversation
            elif turn == len(done) + 1:
                async with session.awaiting_model():
                    url = f"{model_base}/ng-rollout/{episode.capture_key}/v1/chat/completions"
                    action = await ask_model(holder["http"], url, conversation)
                    conversation.append({"role": "assistant", "content": action})
            else:
                raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                    f"turn {turn} of {key!r} asked before turn {len(done) + 1}")
        agent.executions.count(episode.capture_key, f"act-{turn}")
        return json_response({"action": action})

    async def end(request: web.Request) -> web.Response:
        """The episode is over: forget its session and conversation, and have the model free its
        ledger (retried while a checkpoint holds the model parked). Idempotent."""
        episode = episode_of(request)
        agent.check_attempt(episode)
        key = episode.rollout_id
        session = agent.get(key)
        if session is not None and session.episode == episode:
            agent.end(key)
            await conversations.retire_session(key)
        url = f"{model_base}/ng-rollout/{episode.capture_key}/v1/release"
        while True:
            async with holder["http"].post(url, json={}) as resp:
                reply = await resp.json(content_type=None)
            if resp.status == 200:
                break
            code = reply.get("error", {}).get("code") if isinstance(reply, dict) else None
            if code != ErrorCode.CHECKPOINT_PARKED.value:
                raise RuntimeError(f"the policy model did not release {episode.capture_key!r}: "
                                   f"HTTP {resp.status} {reply}")
            await asyncio.sleep(PARKED_RETRY_S)
        return json_response({"ended": episode.capture_key})

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post(f"{_common.ROLLOUT_PREFIX}/v1/agent_sessions/end", end)
    app.router.add_post(f"{_common.ROLLOUT_PREFIX}/v1/agent_sessions", seed)
    app.router.add_post(f"{_common.ROLLOUT_PREFIX}/v1/act", act)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = _common.parser("agent", "Reference agent server (conversations checkpointed through session hooks).")
    p.add_argument("--model", required=True, help="base URL of the policy model server")
    p.add_argument("--restart-only", action="store_true",
                   help="run without session hooks: every session is a restart, never exported")
    _common.main(argv, build_app, p)


if __name__ == "__main__":
    main()
