"""Reference policy model server: deterministic actions, responses held while a checkpoint is open.

``POST /ng-rollout/<capture key>/v1/chat/completions`` with ``{"messages": [{"role",
"content"}, ...]}`` answers ``{"choices": [{"index": 0, "message": {"role":
"assistant", "content": action}, "finish_reason": "stop"}]}``. The action is the first
12 hex digits of the SHA-256 of the messages' compact, key-sorted JSON
(:func:`action_for`), so the same conversation always gets the same action — after a
crash, the re-issued call of a restored episode produces what the lost one would have.

Every call runs inside :meth:`PolicyModelParticipant.call`: it generates (``--step-delay``
seconds), then starts its response, which waits while a checkpoint is open (the call stays
*undelivered*), then records one token-free ledger row ``{"call", "digest",
"staging_key"}``. Status shows ``executions``: per capture key, how often each
``generate-<n>`` (``n`` = assistant turns in the messages + 1) was *delivered* here.

    TIDELOG_CONTROL_TOKEN=... python -m workers.reference.model --port 8101 --state-dir /var/lib/ref/model
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..participant.kinds.model import PolicyModelParticipant
from ..protocol import ErrorCode, ProtocolError
from . import _common
from ._common import Executions, episode_of, json_response, read_json

COMPLETIONS_PATH = f"{_common.ROLLOUT_PREFIX}/v1/chat/completions"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=100_000)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # sampling parameters are accepted and ignored
    messages: list[Message] = Field(min_length=1, max_length=1_000)


def action_for(messages: Sequence[dict[str, Any]]) -> str:
    """The action the model answers ``messages`` with: 12 hex digits of their canonical digest."""
    canonical = json.dumps(list(messages), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def call_index(messages: Sequence[dict[str, Any]]) -> int:
    """Which policy call of the episode this is: the assistant turns so far, plus one."""
    return sum(1 for m in messages if m.get("role") == "assistant") + 1


class ReferenceModel(PolicyModelParticipant):
    """The policy model participant plus this server's step counts in its status."""

    def __init__(self, instance: str) -> None:
        super().__init__(instance)
        self.executions = Executions()

    def status_extra(self) -> dict[str, Any]:
        return {**super().status_extra(), "executions": self.executions.snapshot()}


def build_app(args: argparse.Namespace, token: str) -> web.Application:
    if args.step_delay < 0:
        raise SystemExit(f"--step-delay must be >= 0, not {args.step_delay}")
    model = ReferenceModel(args.instance)
    app = _common.build(model, args, token)

    async def complete(request: web.Request) -> web.Response:
        episode = episode_of(request)
        try:
            req = ChatRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"invalid chat request: {exc.errors()[0]['msg']}") from None
        messages = [m.model_dump() for m in req.messages]
        n = call_index(messages)
        async with model.call(episode) as ticket:
            action = action_for(messages)
            if args.step_delay:
                await asyncio.sleep(args.step_delay)  # generation time
            await ticket.start_response()  # held while a checkpoint is open
            ticket.record({"call": n, "digest": action, "staging_key": f"{ticket.key}/{n}"})
            model.executions.count(ticket.key, f"generate-{n}")
        return json_response({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": action}, "finish_reason": "stop"}]})

    async def release(request: web.Request) -> web.Response:
        """The episode is over: free its ledger (``checkpoint_parked`` while a checkpoint is open)."""
        episode = episode_of(request)
        model.check_attempt(episode)
        model.release(episode)
        return json_response({"released": episode.capture_key})

    app.router.add_post(COMPLETIONS_PATH, complete)
    app.router.add_post(f"{_common.ROLLOUT_PREFIX}/v1/release", release)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = _common.parser("model", "Reference policy model server (deterministic actions, held responses).")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds each generation takes before its response starts (default 0)")
    _common.main(argv, build_app, p)


if __name__ == "__main__":
    main()
