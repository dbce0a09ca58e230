"""The agent participant: agent sessions, exported through session hooks, or restart-only.

An agent server keys its work by *session* (``session_key``), each bound to
one episode attempt when it is seeded. Its data plane::

    session = await participant.seed(session_key, episode)   # put session.headers on the reply
    async with session.activation():                          # one activation: state running
        await session.boundary(snapshot_fn)                   # a point it could resume from
        async with session.awaiting_model():                  # state at_boundary
            reply = await call_policy_model(...)
    participant.end(session_key)                              # the session is finished

A session is ``idle`` (no activation running), ``running`` or ``at_boundary``
(reported a boundary and is waiting for the policy model, or parked). The
snapshot passed to :meth:`AgentSession.boundary` is a zero-argument function,
evaluated only when a commit exports the session.

**With session hooks** (:class:`SessionHooks`) sessions are checkpointed. A
checkpoint is ready when no session is ``running``. While a checkpoint holds
admission closed, new seeds and new activations wait for it to reopen, and a
running activation parks at its next :meth:`AgentSession.boundary` (or on its
way back from :meth:`AgentSession.awaiting_model`) — parked, it does not block.
A commit exports, for each session in scope, ``{"episode_id", "session_key",
"session", "boundary"}``: ``session`` is what ``export_sessions`` returned for
it and ``boundary`` the snapshot's value (``None`` if none was reported); both
are checked as JSON payloads, and a failure names the episode.

**Without hooks** the agent is *restart-only*: every live session is a restart
— it never blocks, is never exported, keeps running through checkpoints, and
is reported in ``restarts`` (a commit whose scope names one gets
``restart_in_scope``). Its seed reply carries ``x-ng-checkpoint-restart: 1``
(:data:`RESTART_HEADER`; :attr:`AgentSession.headers`). Seeds wait while a
checkpoint is open, so the restarts a prepare reported cannot change before its
commit.

**Restore** requires no live sessions. Sessions are handed to
``restore_sessions`` all at once (all or nothing), then registered under the
replacement attempt, idle, with their boundary as the continuation. A seed by
the replacement attempt with the same ``session_key`` claims its restored
session; a seed or activation of any other attempt of that rollout is refused
(``stale_attempt``). **Retire** cancels the activations of the attempt and
earlier ones (they end with ``stale_attempt``), waits for them, calls
``retire_session`` (which must be idempotent) and forgets the sessions.
Retired attempts are refused through the control plane's marks, which
``ControlPlane(participant, state_dir=...)`` attaches.

One episode owns at most one session here.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ...protocol import MAX_BLOCKERS_LISTED, EpisodeId, ErrorCode, PrepareReport, ProtocolError
from ..base import ExportRecord, Participant
from ..storage import check_payload

__all__ = ["RESTART_HEADER", "AgentParticipant", "AgentSession", "RestoredSession", "SessionHooks",
           "SessionState", "restart_headers"]

#: Seed-reply header marking the episode a restart (value ``"1"``); agents without session hooks
#: and ``restart_only`` resources servers send it.
RESTART_HEADER = "x-ng-checkpoint-restart"

SessionState = Literal["idle", "running", "at_boundary"]
#: What a session resumes from, evaluated only at export: a JSON payload, or ``None``.
Snapshot = Callable[[], Any]

_RECORD_FIELDS = frozenset({"episode_id", "session_key", "session", "boundary"})


def restart_headers() -> dict[str, str]:
    """The headers of a seed reply for an episode this server cannot save."""
    return {RESTART_HEADER: "1"}


@dataclass(frozen=True)
class RestoredSession:
    """One session handed to :meth:`SessionHooks.restore_sessions`."""

    session_key: str
    episode_id: EpisodeId  # the replacement attempt
    session: Any
    boundary: Any


class SessionHooks(Protocol):
    """What an agent server implements to have its sessions checkpointed."""

    async def export_sessions(self, keys: Sequence[str]) -> Mapping[str, Any]:
        """The state of every named session (a JSON payload each), all at once."""
        ...

    async def restore_sessions(self, sessions: Sequence[RestoredSession]) -> None:
        """Install every session or none: validate all first, then install all."""
        ...

    async def retire_session(self, key: str) -> None:
        """Free a session for good. Idempotent."""
        ...


class AgentSession:
    """One session of the agent server: its episode, state and boundary snapshot."""

    def __init__(self, owner: AgentParticipant, key: str, episode: EpisodeId, *, restart: bool,
                 restored: bool = False, continuation: Any = None) -> None:
        self._owner = owner
        self.key = key
        self.episode = episode
        self.capture_key = episode.capture_key
        #: Restart-only: never blocks, never exported.
        self.restart = restart
        #: Restored and not yet claimed by a seed of its replacement attempt.
        self.restored = restored
        #: The boundary a restored session continues from (``None``: from the start).
        self.continuation = continuation
        self.state: SessionState = "idle"
        self._snapshot: Snapshot | None = (lambda: continuation) if restored else None
        self._task: asyncio.Task[Any] | None = None  # the running activation's task
        self._cancelled = False  # retire cancelled the activation (it does so once)
        self._idle = asyncio.Event()
        self._idle.set()
        self.retiring = False
        self.ended = False

    @property
    def headers(self) -> dict[str, str]:
        """Headers to put on the seed reply (the restart header for a restart-only session)."""
        return restart_headers() if self.restart else {}

    def _check_live(self) -> None:
        self._owner.check_attempt(self.episode)
        if self.retiring:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"session {self.key!r} is being retired")
        if self.ended:
            raise RuntimeError(f"session {self.key!r} has ended")

    def activation(self) -> AbstractAsyncContextManager[AgentSession]:
        """Run one activation (state ``running``) for the ``async with`` block.

        With hooks, waits first while a checkpoint is open. One at a time per session
        (``RuntimeError``). Cancelled by a retire, the block ends with ``stale_attempt``.
        """
        return self._activation()

    @asynccontextmanager
    async def _activation(self) -> AsyncIterator[AgentSession]:
        owner = self._owner
        self._check_live()
        if not self.restart:
            await owner._wait_open()
            self._check_live()
        if self._task is not None:
            raise RuntimeError(f"session {self.key!r} already runs an activation")
        task = asyncio.current_task()
        self._task = task
        self._idle.clear()
        self.restored = False
        owner._set_state(self, "running")
        try:
            yield self
        except asyncio.CancelledError:
            if self._cancelled and task is not None and task.uncancel() == 0:
                raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"session {self.key!r} was retired") from None
            raise
        finally:
            self._task = None
            owner._set_state(self, "idle")
            self._idle.set()

    async def boundary(self, snapshot: Snapshot) -> None:
        """Report a point this session could resume from; ``snapshot()`` is evaluated at export.

        Inside an activation of a checkpointed session, parks here (``at_boundary``) while a
        checkpoint is open.
        """
        self._snapshot = snapshot
        if self.restart or self._owner._open or self.state != "running":
            return
        self._owner._set_state(self, "at_boundary")
        try:
            await self._owner._wait_open()
        finally:
            self._owner._set_state(self, "running")

    def awaiting_model(self) -> AbstractAsyncContextManager[None]:
        """The session is ``at_boundary`` while its policy call runs (the model may hold it).

        On the way back it parks while a checkpoint is open, so a reply arriving mid-checkpoint
        does not make the session block again.
        """
        return self._awaiting_model()

    @asynccontextmanager
    async def _awaiting_model(self) -> AsyncIterator[None]:
        if self.state != "running":
            raise RuntimeError("awaiting_model() belongs inside a running activation")
        owner = self._owner
        owner._set_state(self, "at_boundary")
        try:
            yield
            if not self.restart:
                await owner._wait_open()
        finally:
            owner._set_state(self, "running")


class AgentParticipant(Participant):
    """The agent server as a checkpoint participant (see the module docstring)."""

    kind = "agent"

    def __init__(self, instance: str, hooks: SessionHooks | None = None) -> None:
        super().__init__(instance)
        self.hooks = hooks
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._sessions: dict[str, AgentSession] = {}
        self._by_episode: dict[str, str] = {}  # capture key -> session key
        self._running: dict[str, str] = {}  # session key -> capture key (checkpointed, running)
        self._at_boundary = 0

    @property
    def restart_only(self) -> bool:
        return self.hooks is None

    # -- data plane -----------------------------------------------------------------------------

    async def seed(self, session_key: str, episode: EpisodeId) -> AgentSession:
        """Seed (or re-seed) session ``session_key`` for ``episode``; waits while a checkpoint is open.

        The replacement attempt of a restored session claims it (``continuation`` is its
        boundary). Refuses a retired attempt, or another attempt of the rollout the key is bound
        to (``stale_attempt``); ``ValueError`` for a key bound to another rollout, or an episode
        that already owns another session.
        """
        if not session_key:
            raise ValueError("an agent session needs a non-empty key")
        self.check_attempt(episode)
        await self._wait_open()
        self.check_attempt(episode)
        existing = self._sessions.get(session_key)
        if existing is not None:
            if existing.episode.rollout_id != episode.rollout_id:
                raise ValueError(f"session {session_key!r} belongs to rollout {existing.episode.rollout_id!r}")
            if existing.episode != episode or existing.retiring:
                raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"session {session_key!r} belongs to attempt "
                                    f"{existing.episode.attempt}, not {episode.attempt}")
            existing.restored = False
            return existing
        owner = self._by_episode.get(episode.capture_key)
        if owner is not None:
            raise ValueError(f"episode {episode.capture_key!r} already owns session {owner!r}")
        session = AgentSession(self, session_key, episode, restart=self.restart_only)
        self._register(session)
        return session

    def get(self, session_key: str) -> AgentSession | None:
        return self._sessions.get(session_key)

    def end(self, session_key: str) -> None:
        """Session ``session_key`` is finished: forget it (no-op if unknown or being retired)."""
        session = self._sessions.get(session_key)
        if session is not None and not session.retiring:
            session.ended = True
            self._unregister(session)

    def _register(self, session: AgentSession) -> None:
        self._sessions[session.key] = session
        self._by_episode[session.capture_key] = session.key

    def _unregister(self, session: AgentSession) -> None:
        self._set_state(session, "idle")
        self._sessions.pop(session.key, None)
        if self._by_episode.get(session.capture_key) == session.key:
            del self._by_episode[session.capture_key]

    def _set_state(self, session: AgentSession, state: SessionState) -> None:
        if session.state == state:
            return
        if session.state == "at_boundary":
            self._at_boundary -= 1
        session.state = state
        if state == "at_boundary":
            self._at_boundary += 1
        live = self._sessions.get(session.key) is session
        if state == "running" and live and not session.restart:
            self._running[session.key] = session.capture_key
        elif self._running.pop(session.key, None) is not None:
            self.notify()

    async def _wait_open(self) -> None:
        while not self._open:
            await self._opened.wait()

    # -- admission and readiness ----------------------------------------------------------------

    async def close_admission(self) -> None:
        self._open = False
        self._opened.clear()

    async def open_admission(self) -> None:
        self._open = True
        self._opened.set()

    def ready(self) -> bool:
        return not self._running

    def restarts(self) -> list[str]:
        return sorted(s.capture_key for s in self._sessions.values() if s.restart and not s.retiring)

    def readiness(self) -> PrepareReport:
        blockers = heapq.nsmallest(MAX_BLOCKERS_LISTED, set(self._running.values()))
        return PrepareReport(ready=not self._running, blockers=blockers, blocker_count=len(self._running),
                             restarts=self.restarts(),
                             counts={"sessions": len(self._sessions), "running": len(self._running),
                                     "at_boundary": self._at_boundary})

    # -- commit ---------------------------------------------------------------------------------

    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        if self.hooks is None:
            return []
        sessions = sorted((s for s in self._sessions.values()
                           if not s.restart and not s.retiring and (scope is None or s.capture_key in scope)),
                          key=lambda s: s.capture_key)
        if not sessions:
            return []
        states = await self.hooks.export_sessions([s.key for s in sessions])
        records: list[ExportRecord] = []
        for session in sessions:
            if session.key not in states:
                raise ValueError(f"export_sessions returned no state for session {session.key!r} "
                                 f"(episode {session.capture_key!r})")
            state = states[session.key]
            boundary = session._snapshot() if session._snapshot is not None else None
            try:
                check_payload(state)
                check_payload(boundary)
            except ValueError as exc:
                raise ValueError(f"agent session of episode {session.capture_key!r}: {exc}") from None
            records.append((session.capture_key, {"episode_id": session.episode.model_dump(),
                                                  "session_key": session.key, "session": state,
                                                  "boundary": boundary}))
        return records

    def restored_pending(self) -> list[EpisodeId]:
        return sorted((s.episode for s in self._sessions.values() if s.restored), key=lambda e: e.capture_key)

    async def delete_restored(self, episode: EpisodeId) -> None:
        # Only unclaimed restored state; nothing is fenced, the attempt may still start.
        key = self._by_episode.get(episode.capture_key)
        session = self._sessions.get(key) if key is not None else None
        if session is None or not session.restored:
            return
        if self.hooks is not None:
            await self.hooks.retire_session(session.key)
        if session.restored and self._sessions.get(session.key) is session:
            self._unregister(session)

    # -- restore --------------------------------------------------------------------------------

    def check_restorable(self) -> None:
        if self._sessions:
            raise ProtocolError(ErrorCode.INVALID_PHASE,
                                f"an agent restore requires no live sessions; {len(self._sessions)} are live")

    def decode(self, record: dict[str, Any]) -> RestoredSession:
        if self.hooks is None:
            raise ValueError("a restart-only agent (no session hooks) cannot restore sessions")
        unknown = set(record) - _RECORD_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        episode = EpisodeId.model_validate(record["episode_id"])
        key = record.get("session_key")
        if not isinstance(key, str) or not key:
            raise ValueError("session_key is not a non-empty string")
        if "session" not in record:
            raise ValueError("the record has no session")
        return RestoredSession(key, episode.next_attempt(), record["session"], record.get("boundary"))

    async def install(self, records: Sequence[Any], scope: Sequence[EpisodeId]) -> None:
        self.check_restorable()
        restored: list[RestoredSession] = list(records)
        if not restored:
            return
        if self.hooks is None:
            raise ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, "a restart-only agent cannot restore sessions")
        for name, values in (("session", [r.session_key for r in restored]),
                             ("episode", [r.episode_id.capture_key for r in restored])):
            if len(set(values)) != len(values):
                raise ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, f"the checkpoint holds a {name} twice")
        await self.hooks.restore_sessions(restored)
        for item in restored:
            self._register(AgentSession(self, item.session_key, item.episode_id, restart=False, restored=True,
                                        continuation=item.boundary))
        self.notify()

    # -- retire ---------------------------------------------------------------------------------

    async def retire(self, episode: EpisodeId) -> None:
        covered = [s for s in self._sessions.values()
                   if s.episode.rollout_id == episode.rollout_id and s.episode.attempt <= episode.attempt]
        for session in covered:
            session.retiring = True
            if session._task is not None and not session._cancelled:
                session._cancelled = True
                session._task.cancel()
        # Cut short, the sessions stay tracked as retiring; a retry waits again without cancelling.
        await asyncio.gather(*(s._idle.wait() for s in covered))
        for session in covered:
            if self._sessions.get(session.key) is not session:
                continue
            if self.hooks is not None:
                await self.hooks.retire_session(session.key)
            self._unregister(session)

    def status_extra(self) -> dict[str, Any]:
        return {"sessions": len(self._sessions), "restart_only": self.restart_only}
