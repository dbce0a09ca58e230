"""Reference resources server: a verifier whose sessions keep the checks of an episode.

- ``POST /ng-rollout/<capture key>/seed_session`` with ``{"prompt"}`` creates a session
  and answers ``{"session_id"}``, its headers saying the verify mode (and the restart
  header in ``restart_only`` mode);
- ``POST /ng-rollout/<capture key>/check`` with ``{"session_id", "action"}`` checks one
  action (the ``--task`` rule, deterministic), keeps it in the session, answers ``{"ok"}``;
- ``POST /ng-rollout/<capture key>/verify`` with ``{"session_id", "actions"}`` answers
  ``{"reward"}``, the fraction of the session's checks that passed (``actions`` must be
  the actions it checked), and ends the session;
- ``POST /ng-rollout/<capture key>/close_session`` with ``{"session_id"}`` ends it.

``--task`` is the rule a check applies (:func:`checker`): ``hex`` (the default,
:func:`check_ok`: the action's first byte, two hex digits, is not a multiple of 3 — for the
digest actions of the model's default mode) or ``letter:<c>[:<n>]`` (the action holds the
letter ``c`` at least ``n`` times, default once — a rule a policy generating text can learn:
the RL demo, ``engine/demos/training.py``).

``--mode exported`` (the default here, so episodes are checkpointable mid-episode; the
kind's own default stays ``restart_only``) exports each session's state
``{"prompt", "checks": [{"action", "ok"}, ...]}`` through :class:`SessionStates`.
``--mode restart_only`` saves nothing (every session is a restart). There is no
``stateless`` mode: the checks live here. ``--verify-mode`` (``wait`` or ``replay``)
tells the environment how to run ``/verify``. Status shows ``executions`` (per capture
key, how often each ``check-<n>`` and ``verify`` completed here) and ``session_states``
(states held, so a test can see every ended session freed).

    TIDELOG_CONTROL_TOKEN=... python -m workers.reference.resources --port 8102 \\
        --state-dir /var/lib/ref/resources
"""

from __future__ import annotations

import argparse
import copy
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from ..participant.kinds.resources import ResourcesParticipant
from ..protocol import EpisodeId, ErrorCode, ProtocolError
from . import _common
from ._common import Executions, episode_of, json_response, read_json

MODES = ("exported", "restart_only")


def check_ok(action: str) -> bool:
    """Whether an action passes: its first byte (two hex digits) is not a multiple of 3."""
    try:
        return int(action[:2], 16) % 3 != 0
    except ValueError:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"action {action[:40]!r} is not hex") from None


def checker(task: str) -> Callable[[str], bool]:
    """The check of ``--task``: ``hex`` (:func:`check_ok`) or ``letter:<c>[:<n>]`` (see the module docs)."""
    if task == "hex":
        return check_ok
    kind, _, rest = task.partition(":")
    letter, _, count = rest.partition(":")
    if kind != "letter" or len(letter) != 1 or not "a" <= letter <= "z" or (count and not count.isdigit()):
        raise SystemExit(f"--task must be hex or letter:<a-z>[:<count>], not {task!r}")
    least = int(count) if count else 1
    if least < 1:
        raise SystemExit(f"--task {task!r}: the count must be >= 1")
    return lambda action: action.lower().count(letter) >= least


def _is_state(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"prompt", "checks"} and isinstance(value["prompt"], str)
            and isinstance(value["checks"], list)
            and all(isinstance(c, dict) and set(c) == {"action", "ok"} and isinstance(c["action"], str)
                    and isinstance(c["ok"], bool) for c in value["checks"]))


class SessionStates:
    """The session states (the hooks of ``exported`` mode): session id -> ``{"prompt", "checks"}``."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}
        self.episodes: dict[str, EpisodeId] = {}  # session id -> the episode it was made for

    async def export_session_states(self, session_ids: Sequence[str]) -> Mapping[str, Any]:
        return {sid: copy.deepcopy(self.states[sid]) for sid in session_ids if sid in self.states}

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        for sid, state in states.items():  # validate all, then install all
            if not _is_state(state):
                raise ValueError(f"session {sid!r} holds no valid state")
        for sid, state in states.items():
            self.states[sid] = copy.deepcopy(state)

    async def retire_session_state(self, session_id: str) -> None:
        self.states.pop(session_id, None)
        self.episodes.pop(session_id, None)


class ReferenceResources(ResourcesParticipant):
    """The resources participant plus this server's step counts in its status."""

    def __init__(self, instance: str, store: SessionStates, *, mode: str, verify_mode: str) -> None:
        if mode not in MODES:
            raise SystemExit(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
        if verify_mode not in ("wait", "replay"):
            raise SystemExit(f"--verify-mode must be wait or replay, not {verify_mode!r}")
        super().__init__(instance, mode="exported" if mode == "exported" else "restart_only",
                         hooks=store if mode == "exported" else None,
                         verify_mode="replay" if verify_mode == "replay" else "wait")
        self.store = store
        self.executions = Executions()

    async def retire(self, episode: EpisodeId) -> None:
        await super().retire(episode)
        # Without hooks (restart_only) the kind frees no state: free the covered sessions' here.
        for sid, owner in list(self.store.episodes.items()):
            if owner.rollout_id == episode.rollout_id and owner.attempt <= episode.attempt:
                await self.store.retire_session_state(sid)

    def status_extra(self) -> dict[str, Any]:
        return {**super().status_extra(), "session_states": len(self.store.states),
                "executions": self.executions.snapshot()}


def _field(body: dict[str, Any], name: str) -> str:
    """A text field of a data body, bounded (the session keeps it): see :func:`_common.text_field`."""
    return _common.text_field(body, name)


def build_app(args: argparse.Namespace, token: str) -> web.Application:
    store = SessionStates()
    rule = checker(args.task)
    res = ReferenceResources(args.instance, store, mode=args.mode, verify_mode=args.verify_mode)
    app = _common.build(res, args, token)

    def state_of(sid: str) -> dict[str, Any]:
        state = store.states.get(sid)
        if state is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"unknown session {sid!r}")
        return state

    async def seed(request: web.Request) -> web.Response:
        episode = episode_of(request)
        prompt = _field(await read_json(request), "prompt")
        async with res.request(episode, "seed") as req:
            sid = f"s-{uuid.uuid4().hex}"
            store.states[sid], store.episodes[sid] = {"prompt": prompt, "checks": []}, episode
            try:
                headers = req.bind(sid)
            except BaseException:
                await store.retire_session_state(sid)
                raise
        return json_response({"session_id": sid}, headers=headers)

    async def check(request: web.Request) -> web.Response:
        episode = episode_of(request)
        body = await read_json(request)
        sid, action = _field(body, "session_id"), _field(body, "action")
        async with res.request(episode, "data", session_id=sid):
            state = state_of(sid)
            ok = rule(action)
            state["checks"].append({"action": action, "ok": ok})
            n = len(state["checks"])
        res.executions.count(episode.capture_key, f"check-{n}")
        return json_response({"ok": ok})

    async def verify(request: web.Request) -> web.Response:
        episode = episode_of(request)
        body = await read_json(request)
        sid, actions = _field(body, "session_id"), body.get("actions")
        if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "actions must be a list of strings")
        async with res.request(episode, "verify", session_id=sid):
            checks = state_of(sid)["checks"]
            if [c["action"] for c in checks] != actions:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"session {sid!r} checked other actions "
                                    f"({len(checks)}) than the {len(actions)} given")
            reward = sum(1 for c in checks if c["ok"]) / len(checks) if checks else 0.0
        if res.hooks is None:  # the kind frees the state of an ended session only through hooks
            await store.retire_session_state(sid)
        res.executions.count(episode.capture_key, "verify")
        return json_response({"reward": reward})

    async def close(request: web.Request) -> web.Response:
        episode = episode_of(request)
        sid = _field(await read_json(request), "session_id")
        async with res.request(episode, "close", session_id=sid):
            pass
        if res.hooks is None:
            await store.retire_session_state(sid)
        return json_response({"closed": True})

    for path, handler in (("seed_session", seed), ("check", check), ("verify", verify), ("close_session", close)):
        app.router.add_post(f"{_common.ROLLOUT_PREFIX}/{path}", handler)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = _common.parser("resources", "Reference resources server (a verifier with checkpointable sessions).")
    p.add_argument("--mode", choices=MODES, default="exported",
                   help="exported (default: sessions are checkpointed) or restart_only")
    p.add_argument("--verify-mode", choices=("wait", "replay"), default="wait",
                   help="how the environment runs /verify: wait (default) or replay")
    p.add_argument("--task", default="hex",
                   help="the rule a check applies: hex (default: the first byte of a hex action is not a "
                        "multiple of 3) or letter:<c>[:<n>] (the action holds the letter c at least n times)")
    _common.main(argv, build_app, p)


if __name__ == "__main__":
    main()
