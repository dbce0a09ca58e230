"""The resources participant: sessions bound to episodes, in one of three modes.

A resources server (a sandbox, a tool host, a verifier) serves sessions that
an environment seeds for an episode. Every data-plane request runs inside
:meth:`ResourcesParticipant.request`, which admits it and counts it in flight::

    async with participant.request(episode, route="seed") as req:
        session_id = create_session(...)
        headers = req.bind(session_id)                 # put these on the seed reply
    async with participant.request(episode, route="data", session_id=sid): ...
    async with participant.request(episode, route="verify", session_id=sid): ...   # ends it
    async with participant.request(episode, route="close", session_id=sid): ...    # ends it

Modes (``mode=``):

- ``restart_only`` (the default: it fails closed) — sessions cannot be saved.
  Every live session is reported in ``restarts`` (a commit naming one gets
  ``restart_in_scope``), nothing is exported, in-flight requests never block,
  and seed replies carry ``x-ng-checkpoint-restart: 1``. Seeds wait while a
  checkpoint is open, so the reported restarts cannot change before its commit.
- ``stateless`` — sessions are exported with ``state: null`` so that their
  cookies keep routing after a restore.
- ``exported`` — states come from :class:`SessionStateHooks`, which the server
  supplies: export all at once, restore all or nothing, retire idempotently.
  The participant owns the end of a session's state: it calls
  ``retire_session_state`` when a session ends (verify or close), is retired, or
  is unclaimed restored state a commit left out of scope.

**Admission.** A retired attempt, or a retired session until its rollout is
forgotten, is refused with ``stale_attempt``. While a checkpoint holds admission
closed, data routes are refused with ``admission_closed``, except ``close``
(never refused) and a ``verify`` of a session whose verify mode is
``replay``; ``restart_only`` seeds wait instead. Ready = no request in flight
that blocks: requests of ``restart_only`` servers, replay-mode verifies and
requests admitted while closed never block. A session ended while a checkpoint
is closed stays bound — and exported — until admission reopens, since the
environment replays its verify after a crash.

**Verify mode.** ``verify_mode`` (``"wait"`` or ``"replay"``, a server-wide
default that :meth:`ResourcesRequest.bind` may override per session) tells the
environment how to run ``/verify``; the seed reply carries it in
``x-ng-checkpoint-verify`` (:data:`VERIFY_HEADER`). Restored sessions take the
server default.

**Records** are ``{"episode_id", "session_id", "state", "owner"}``; ``owner``
is the participant instance that served the session. **Restore** requires no
live sessions and registers each session under the replacement attempt; the
replacement's first request claims it. **Retire** marks the covered sessions
retired, cancels their requests in flight (they end with ``stale_attempt``),
waits for them and frees their state; ``status`` shows ``retired_sessions``.
Retired attempts are refused through the control plane's marks, which
``ControlPlane(participant, state_dir=...)`` attaches.

One episode owns at most one session: binding a new session for an episode
replaces (and forgets) the session it had.
"""

from __future__ import annotations

import asyncio
import logging
import heapq
import itertools
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ...protocol import MAX_BLOCKERS_LISTED, EpisodeId, ErrorCode, PrepareReport, ProtocolError
from ..base import ExportRecord, Participant
from ..storage import check_payload
from .agent import RESTART_HEADER

__all__ = ["MODES", "VERIFY_HEADER", "ResourcesMode", "ResourcesParticipant", "ResourcesRequest", "Route",
           "SessionStateHooks", "VerifyMode", "verify_headers", "verify_mode_of"]

#: Seed-reply header telling the environment how to run ``/verify``: ``replay`` or ``wait``.
VERIFY_HEADER = "x-ng-checkpoint-verify"

ResourcesMode = Literal["stateless", "exported", "restart_only"]
MODES: tuple[ResourcesMode, ...] = ("stateless", "exported", "restart_only")
VerifyMode = Literal["wait", "replay"]
#: What a request is: ``seed`` creates a session, ``verify`` and ``close`` end it.
Route = Literal["seed", "data", "verify", "close"]

_RECORD_FIELDS = frozenset({"episode_id", "session_id", "state", "owner"})
log = logging.getLogger("tidelog.participant")


def verify_headers(mode: VerifyMode) -> dict[str, str]:
    """The seed-reply header that selects the verify mode."""
    return {VERIFY_HEADER: mode}


def verify_mode_of(headers: Mapping[str, str]) -> VerifyMode:
    """The verify mode a seed reply selects (environment side): ``replay`` only if the header
    (looked up case-insensitively) says exactly that, else ``wait``."""
    for name, value in headers.items():
        if name.lower() == VERIFY_HEADER:
            return "replay" if value.strip() == "replay" else "wait"
    return "wait"


class SessionStateHooks(Protocol):
    """What an ``exported``-mode resources server supplies."""

    async def export_session_states(self, session_ids: Sequence[str]) -> Mapping[str, Any]:
        """The state of every named session (a JSON payload each), all at once."""
        ...

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        """Install every state or none."""
        ...

    async def retire_session_state(self, session_id: str) -> None:
        """Free one session's state. Idempotent."""
        ...


@dataclass(eq=False)
class _Session:
    session_id: str
    episode: EpisodeId
    verify_mode: VerifyMode
    owner: str
    restored: bool = False  # restored, not yet claimed by its replacement
    ending: bool = False  # ended while a checkpoint was closed: unbound when admission reopens


@dataclass(frozen=True)
class _RestoredSession:
    session_id: str
    episode: EpisodeId  # the replacement attempt
    state: Any
    owner: str


class ResourcesRequest:
    """One admitted request. Use it only inside its :meth:`ResourcesParticipant.request` block."""

    def __init__(self, owner: ResourcesParticipant, request_id: int, episode: EpisodeId, route: Route,
                 session_id: str | None, blocking: bool, task: asyncio.Task[Any] | None) -> None:
        self._owner = owner
        self.request_id = request_id
        self.episode = episode
        self.route = route
        self.session_id = session_id
        #: Whether this request blocks a checkpoint while in flight.
        self.blocking = blocking
        self._task = task
        self._cancelled = False
        self._ended = asyncio.Event()

    def bind(self, session_id: str, *, verify_mode: VerifyMode | None = None) -> dict[str, str]:
        """A seed succeeded: bind ``session_id`` to this request's episode. Returns the seed-reply
        headers (the verify mode, plus the restart header in ``restart_only`` mode)."""
        self._owner.bind_session(session_id, self.episode, verify_mode=verify_mode)
        self.session_id = session_id
        return self._owner.seed_headers(session_id)


class ResourcesParticipant(Participant):
    """The resources server as a checkpoint participant (see the module docstring)."""

    kind = "resources"

    def __init__(self, instance: str, *, mode: ResourcesMode = "restart_only",
                 hooks: SessionStateHooks | None = None, verify_mode: VerifyMode = "wait") -> None:
        super().__init__(instance)
        if mode not in MODES:
            raise ValueError(f"resources mode must be one of {', '.join(MODES)}, not {mode!r}")
        if (mode == "exported") != (hooks is not None):
            raise ValueError("state hooks are required in exported mode, and only there")
        if verify_mode not in ("wait", "replay"):
            raise ValueError(f"verify_mode must be 'wait' or 'replay', not {verify_mode!r}")
        self.mode: ResourcesMode = mode
        self.hooks = hooks
        self.verify_mode: VerifyMode = verify_mode
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._ids = itertools.count(1)
        self._requests: dict[int, ResourcesRequest] = {}
        self._blocking: dict[int, str] = {}  # request id -> capture key
        self._sessions: dict[str, _Session] = {}
        self._by_episode: dict[str, str] = {}  # capture key -> session id
        self._retired: dict[str, str] = {}  # session id -> rollout id, refused until forget
        self._freeing: set[asyncio.Task[None]] = set()

    def _freed(self, task: asyncio.Task[None]) -> None:
        self._freeing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("freeing a replaced resources session failed: %r", task.exception())

    # -- data plane -----------------------------------------------------------------------------

    def request(self, episode: EpisodeId, route: Route = "data", *,
                session_id: str | None = None) -> AbstractAsyncContextManager[ResourcesRequest]:
        """Admit one request of ``episode`` (see the module docstring for the rules).

        A ``verify`` or ``close`` that exits normally ends its session. Cancelled by a
        retire, the block ends with ``stale_attempt``.
        """
        return self._request(episode, route, session_id)

    @asynccontextmanager
    async def _request(self, episode: EpisodeId, route: Route, session_id: str | None
                       ) -> AsyncIterator[ResourcesRequest]:
        if route != "close":
            self._check(episode, session_id)
        admitted_closed = not self._open
        if admitted_closed and route != "close":
            session = self._sessions.get(session_id) if session_id is not None else None
            mode = session.verify_mode if session is not None else self.verify_mode
            if route == "seed" and self.mode == "restart_only":
                while not self._open:
                    await self._opened.wait()
                admitted_closed = False
                self._check(episode, session_id)
            elif not (route == "verify" and mode == "replay"):
                raise ProtocolError(ErrorCode.ADMISSION_CLOSED,
                                    f"a checkpoint is open; {route} of {episode.capture_key!r} must be retried")
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is not None and session.episode == episode:
            session.restored = False  # claimed by its replacement
        replay = route == "verify" and (session.verify_mode if session is not None else self.verify_mode) == "replay"
        blocking = self.mode != "restart_only" and not replay and not admitted_closed
        task = asyncio.current_task()
        req = ResourcesRequest(self, next(self._ids), episode, route, session_id, blocking, task)
        self._requests[req.request_id] = req
        if blocking:
            self._blocking[req.request_id] = episode.capture_key
        ok = False
        try:
            yield req
            ok = True
        except asyncio.CancelledError:
            if req._cancelled and task is not None and task.uncancel() == 0:
                raise ProtocolError(ErrorCode.STALE_ATTEMPT,
                                    f"the {route} of {episode.capture_key!r} was retired") from None
            raise
        finally:
            del self._requests[req.request_id]
            if self._blocking.pop(req.request_id, None) is not None:
                self.notify()
            req._ended.set()
        if ok and route in ("verify", "close") and req.session_id is not None:
            await self.end_session(req.session_id)

    def _check(self, episode: EpisodeId, session_id: str | None) -> None:
        self.check_attempt(episode)
        if session_id is None:
            return
        if session_id in self._retired:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT,
                                f"session {session_id!r} was retired (refused until its rollout is forgotten)")
        session = self._sessions.get(session_id)
        if session is not None and session.episode != episode:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT,
                                f"session {session_id!r} belongs to {session.episode.capture_key!r}, "
                                f"not {episode.capture_key!r}")

    def bind_session(self, session_id: str, episode: EpisodeId, *, verify_mode: VerifyMode | None = None) -> None:
        """Bind ``session_id`` to ``episode`` (a seed succeeded; also for non-standard protocols)."""
        if not session_id:
            raise ValueError("a resources session needs a non-empty id")
        self._check(episode, session_id)
        mode = verify_mode if verify_mode is not None else self.verify_mode
        previous = self._by_episode.get(episode.capture_key)
        if previous is not None and previous != session_id:
            self._unbind(self._sessions[previous])
            if self.hooks is not None:
                # The replaced session (often restored state the replacement seeded over) ended:
                # its state is freed like any ended session's, in the background since binding
                # happens inside a seed request.
                task = asyncio.get_running_loop().create_task(self.hooks.retire_session_state(previous))
                self._freeing.add(task)
                task.add_done_callback(self._freed)
        self._sessions[session_id] = _Session(session_id, episode, mode, self.instance)
        self._by_episode[episode.capture_key] = session_id

    def seed_headers(self, session_id: str) -> dict[str, str]:
        """The seed-reply headers of a bound session."""
        headers = verify_headers(self._sessions[session_id].verify_mode)
        if self.mode == "restart_only":
            headers[RESTART_HEADER] = "1"
        return headers

    async def end_session(self, session_id: str) -> None:
        """The session ended (verify or close; also for non-standard protocols). While a checkpoint
        is closed it stays bound and exported until admission reopens."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        if not self._open:
            session.ending = True
            return
        self._unbind(session)
        if self.hooks is not None:
            await self.hooks.retire_session_state(session_id)

    def _unbind(self, session: _Session) -> None:
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]
        if self._by_episode.get(session.episode.capture_key) == session.session_id:
            del self._by_episode[session.episode.capture_key]

    # -- admission and readiness ----------------------------------------------------------------

    async def close_admission(self) -> None:
        self._open = False
        self._opened.clear()

    async def open_admission(self) -> None:
        self._open = True
        self._opened.set()
        for session in [s for s in self._sessions.values() if s.ending]:
            await self.end_session(session.session_id)

    def ready(self) -> bool:
        return not self._blocking

    def restarts(self) -> list[str]:
        if self.mode != "restart_only":
            return []
        return sorted(self._by_episode)

    def readiness(self) -> PrepareReport:
        blockers = heapq.nsmallest(MAX_BLOCKERS_LISTED, set(self._blocking.values()))
        return PrepareReport(ready=not self._blocking, blockers=blockers, blocker_count=len(self._blocking),
                             restarts=self.restarts(),
                             counts={"inflight": len(self._requests), "sessions": len(self._sessions)})

    # -- commit ---------------------------------------------------------------------------------

    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        if self.mode == "restart_only":
            return []
        sessions = sorted((s for s in self._sessions.values() if scope is None or s.episode.capture_key in scope),
                          key=lambda s: s.episode.capture_key)
        states: Mapping[str, Any] = {}
        if self.hooks is not None and sessions:
            states = await self.hooks.export_session_states([s.session_id for s in sessions])
        records: list[ExportRecord] = []
        for session in sessions:
            key = session.episode.capture_key
            state: Any = None
            if self.hooks is not None:
                if session.session_id not in states:
                    raise ValueError(f"export_session_states returned no state for session "
                                     f"{session.session_id!r} (episode {key!r})")
                state = states[session.session_id]
                try:
                    check_payload(state)
                except ValueError as exc:
                    raise ValueError(f"resources session of episode {key!r}: {exc}") from None
            records.append((key, {"episode_id": session.episode.model_dump(), "session_id": session.session_id,
                                  "state": state, "owner": session.owner}))
        return records

    def restored_pending(self) -> list[EpisodeId]:
        return sorted((s.episode for s in self._sessions.values() if s.restored), key=lambda e: e.capture_key)

    async def delete_restored(self, episode: EpisodeId) -> None:
        # Only unclaimed restored state; nothing is fenced, the attempt may still start.
        session_id = self._by_episode.get(episode.capture_key)
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is None or not session.restored:
            return
        self._unbind(session)
        if self.hooks is not None:
            await self.hooks.retire_session_state(session.session_id)

    # -- restore --------------------------------------------------------------------------------

    def check_restorable(self) -> None:
        if self._sessions or self._requests:
            raise ProtocolError(ErrorCode.INVALID_PHASE, "a resources restore requires no live sessions or "
                                f"requests ({len(self._sessions)} sessions, {len(self._requests)} requests)")

    def decode(self, record: dict[str, Any]) -> _RestoredSession:
        if self.mode == "restart_only":
            raise ValueError("a restart_only resources server cannot restore sessions")
        unknown = set(record) - _RECORD_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        episode = EpisodeId.model_validate(record["episode_id"])
        session_id = record.get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id is not a non-empty string")
        if "state" not in record:
            raise ValueError("the record has no state")
        if self.mode == "stateless" and record["state"] is not None:
            raise ValueError("a stateless resources server cannot restore a session state")
        owner = record.get("owner")
        if not isinstance(owner, str):
            raise ValueError("owner is not a string")
        return _RestoredSession(session_id, episode.next_attempt(), record["state"], owner)

    async def install(self, records: Sequence[Any], scope: Sequence[EpisodeId]) -> None:
        self.check_restorable()
        restored: list[_RestoredSession] = list(records)
        for name, values in (("session", [r.session_id for r in restored]),
                             ("episode", [r.episode.capture_key for r in restored])):
            if len(set(values)) != len(values):
                raise ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, f"the checkpoint holds a {name} twice")
        if self.hooks is not None and restored:
            await self.hooks.restore_session_states({r.session_id: r.state for r in restored})
        for item in restored:
            self._sessions[item.session_id] = _Session(item.session_id, item.episode, self.verify_mode,
                                                       item.owner, restored=True)
            self._by_episode[item.episode.capture_key] = item.session_id
        self.notify()

    # -- retire and forget ----------------------------------------------------------------------

    async def retire(self, episode: EpisodeId) -> None:
        def covered(e: EpisodeId) -> bool:
            return e.rollout_id == episode.rollout_id and e.attempt <= episode.attempt
        sessions = [s for s in self._sessions.values() if covered(s.episode)]
        for session in sessions:
            self._retired[session.session_id] = episode.rollout_id
        requests = [r for r in self._requests.values() if covered(r.episode)]
        for req in requests:
            if not req._cancelled and req._task is not None:
                req._cancelled = True
                req._task.cancel()
        # Cut short, the sessions stay bound (and refused); a retry waits again without cancelling.
        await asyncio.gather(*(r._ended.wait() for r in requests))
        for session in sessions:
            if self._sessions.get(session.session_id) is not session:
                continue
            if self.hooks is not None:
                await self.hooks.retire_session_state(session.session_id)
            self._unbind(session)

    def forget(self, rollout_ids: Iterable[str]) -> None:
        gone = set(rollout_ids)
        for session_id in [s for s, r in self._retired.items() if r in gone]:
            del self._retired[session_id]

    def status_extra(self) -> dict[str, Any]:
        return {"mode": self.mode, "sessions": len(self._sessions), "retired_sessions": len(self._retired)}
