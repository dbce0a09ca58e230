"""Episode steps: where each live episode of a server stands relative to a checkpoint.

An environment server (or a restart-only agent) runs each episode in its own task and
reports it here: ``begin``/``end``, ``async with step(key, mode)`` around each step,
``await boundary(key, state)`` after each completed one. A step in flight when a
checkpoint closes is a ``"wait"`` step (the checkpoint waits for it) or a ``"replay"``
step (the boundary before it is exported; it runs again after a crash). While a
checkpoint is closed, a boundary *parks* the episode until the checkpoint opens.

States: ``running``, ``wait_step``, ``replay_step``, ``parked``. An episode **blocks**
iff it is retired, or it is not a restart and is ``running`` or ``wait_step``. The
blocker count is a running counter (``ready()`` is O(1)), and listeners hear of its
changes only while a checkpoint is closed, so a step costs nothing extra outside one.
Restarts never block, park or export; a retiring episode blocks until its task ends.
Time parked, or in a replay step during a checkpoint, does not count against the
episode's :meth:`~EpisodeSteps.deadline`. One event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..protocol import MAX_BLOCKERS_LISTED

__all__ = ["EpisodeInfo", "EpisodeState", "EpisodeSteps", "StepMode"]

StepMode = Literal["wait", "replay"]
EpisodeState = Literal["running", "wait_step", "replay_step", "parked"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeInfo:
    """A snapshot of one tracked episode (for status pages, logs and tests)."""

    key: str
    state: EpisodeState
    boundary: Any
    restart: bool
    retired: bool


@dataclass(eq=False)
class _Episode:
    key: str
    task: asyncio.Task[Any]
    boundary: Any
    restart: bool
    state: EpisodeState = "running"
    retired: bool = False
    cancelled: bool = False  # retire has cancelled the task (it does so once)
    in_step: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    timeout: asyncio.Timeout | None = None  # the deadline's timeout, while inside deadline()
    suspended: bool = False
    remaining: float | None = None  # seconds of deadline left while suspended

    def blocks(self) -> bool:
        return self.retired or (not self.restart and self.state in ("running", "wait_step"))


class EpisodeSteps:
    """The live episodes of one server, with a running count of those blocking a checkpoint."""

    def __init__(self) -> None:
        self._episodes: dict[str, _Episode] = {}
        self._blocking = 0
        self._closed = False
        self._opened = asyncio.Event()  # set while no checkpoint is closed
        self._opened.set()
        self._listeners: list[Callable[[], None]] = []

    # -- lifecycle (called by the episode's own task) ----------------------------------------

    def begin(self, key: str, *, continuation: Any = None, restart: bool = False) -> None:
        """Track episode ``key``, run by the current task, as ``running`` at boundary ``continuation``.

        ``continuation`` is the boundary a restored episode resumes from (``None``: from its
        input); ``restart`` marks one that cannot be captured. ``ValueError`` if ``key`` is
        still tracked (live, or retiring), refusing a duplicate start; ``RuntimeError`` outside a task.
        """
        if key in self._episodes:
            raise ValueError(f"episode {key!r} is already running")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("EpisodeSteps.begin() must be called from an asyncio task")
        episode = _Episode(key, task, continuation, restart)
        self._episodes[key] = episode
        if episode.blocks():
            self._count(+1)

    def end(self, key: str) -> None:
        """Forget episode ``key`` after it completed; no-op if unknown or retired (retire forgets it)."""
        episode = self._episodes.get(key)
        if episode is not None and not episode.retired:
            self._forget(episode)

    def deadline(self, key: str, seconds: float | None) -> contextlib.AbstractAsyncContextManager[None]:
        """An ``asyncio.timeout(seconds)`` for episode ``key`` (``None``: none) that pauses for checkpoints.

        Enter it in the episode's task after :meth:`begin`. While the episode is parked, or
        in a replay step during a checkpoint, it is suspended; when the checkpoint opens it
        is rescheduled with the time it had left. Expiry raises ``TimeoutError``. One at a
        time per episode (``RuntimeError``); ``KeyError`` if ``key`` is not tracked.
        """
        return self._deadline(self._get(key), seconds)

    async def boundary(self, key: str, state: Any) -> None:
        """Record ``state`` as episode ``key``'s boundary (what it resumes from after a crash).

        Call it between steps, from the episode's task. With no checkpoint closed, or for a
        restart, it returns at once (``running``). Otherwise the episode parks (not blocking,
        exported at ``state``, deadline suspended) until the checkpoint opens, and stays
        parked if another one has closed by the time it wakes. ``asyncio.CancelledError``
        if the episode is or becomes retired; ``KeyError`` if ``key`` is not tracked.
        """
        episode = self._get(key)
        if episode.retired:
            raise asyncio.CancelledError(f"episode {key!r} is retired")
        episode.boundary = state
        if not self._closed or episode.restart:
            self._set_state(episode, "running")
            self._resume(episode)
            return
        self._set_state(episode, "parked")
        self._suspend(episode)
        try:
            while self._closed and not episode.retired:
                episode.wake.clear()
                await episode.wake.wait()
        finally:
            if self._tracked(episode):
                self._set_state(episode, "running")
                self._resume(episode)
        if episode.retired:
            raise asyncio.CancelledError(f"episode {key!r} is retired")

    def step(self, key: str, mode: StepMode) -> contextlib.AbstractAsyncContextManager[None]:
        """Around one step of episode ``key`` (steps do not nest).

        ``"wait"``: ``wait_step``, blocking until the step ends. ``"replay"``: ``replay_step``,
        not blocking, exported at the previous boundary, deadline suspended while closed. A
        replay step that ends while closed leaves the episode there until its next
        :meth:`boundary` parks it with the step's result (or the checkpoint opens); any
        other end returns it to ``running``. ``KeyError`` / ``ValueError`` for a bad key / mode.
        """
        if mode not in ("wait", "replay"):
            raise ValueError(f"step mode must be 'wait' or 'replay', not {mode!r}")
        return self._step(self._get(key), mode)

    async def mark_restart(self, key: str) -> None:
        """Mark episode ``key`` as a restart, first waiting while a checkpoint is closed.

        Waiting keeps the restarts a prepare reported unchanged until its commit.
        Raises ``KeyError`` if ``key`` is not tracked (before or after the wait).
        """
        self._get(key)
        while self._closed:
            await self._opened.wait()
        episode = self._get(key)
        before = episode.blocks()
        episode.restart = True
        self._recount(episode, before)

    async def retire(self, key: str) -> bool:
        """Stop episode ``key``: mark it retired, cancel its task once, wait for it, forget it.

        From the mark on it blocks whatever its state and is never exported. If this call's
        wait is cut short (cancelled, timed out), the episode stays tracked and blocking and
        :meth:`begin` still refuses the key; a retry waits again without cancelling again.
        Returns whether ``key`` was tracked; ``RuntimeError`` from the episode's own task.
        """
        episode = self._episodes.get(key)
        if episode is None:
            return False
        if episode.task is asyncio.current_task():
            raise RuntimeError(f"episode {key!r} cannot retire itself")
        before = episode.blocks()
        episode.retired = True
        self._recount(episode, before)
        episode.wake.set()
        if not episode.cancelled:
            episode.cancelled = True
            episode.task.cancel()
        await asyncio.wait({episode.task})  # a cancelled caller does not cancel the task
        if self._tracked(episode):
            self._forget(episode)
        return True

    # -- checkpoint hooks (called by the control plane) --------------------------------------

    @property
    def closed(self) -> bool:
        """Whether a checkpoint is closed (between :meth:`close` and :meth:`open`)."""
        return self._closed

    def close(self) -> None:
        """A checkpoint closes: episodes park at their next boundary; replay steps stop the clock."""
        if self._closed:
            return
        self._closed = True
        self._opened.clear()
        for episode in self._episodes.values():
            if episode.state == "replay_step" and not episode.restart:
                self._suspend(episode)

    def open(self) -> None:
        """The checkpoint opens: parked episodes wake, suspended deadlines resume."""
        if not self._closed:
            return
        self._closed = False
        self._opened.set()
        for episode in self._episodes.values():
            if episode.state == "parked":
                episode.wake.set()  # the task itself leaves ``parked`` and resumes its deadline
            elif episode.state == "replay_step":
                if not episode.in_step:  # its replay step ended during the checkpoint
                    self._set_state(episode, "running")
                self._resume(episode)

    def ready(self) -> bool:
        """Whether nothing blocks the checkpoint (O(1))."""
        return self._blocking == 0

    def blocker_count(self) -> int:
        """The exact number of blocking episodes (a running counter)."""
        return self._blocking

    def blockers(self, limit: int = MAX_BLOCKERS_LISTED) -> list[str]:
        """The smallest ``limit`` keys of blocking episodes, sorted; no scan when none blocks."""
        if self._blocking == 0 or limit <= 0:
            return []
        return heapq.nsmallest(limit, (k for k, e in self._episodes.items() if e.blocks()))

    def restarts(self) -> list[str]:
        """Sorted keys of every restart episode that is not retired (never capped)."""
        return sorted(k for k, e in self._episodes.items() if e.restart and not e.retired)

    def exported(self) -> dict[str, Any]:
        """``{key: boundary}``, by key, of parked and replay-step episodes, not retired nor restarts.

        ``None``: no boundary recorded yet, so the episode starts over from its input; a
        restored episode that has not moved on is exported at its restored boundary.
        """
        return {
            k: e.boundary
            for k, e in sorted(self._episodes.items())
            if e.state in ("parked", "replay_step") and not e.retired and not e.restart
        }

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each change of the blocker count made while a checkpoint is closed."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` (no-op if it was not added)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    # -- inspection --------------------------------------------------------------------------

    def live(self) -> list[str]:
        """Sorted keys of every tracked episode (retiring ones included)."""
        return sorted(self._episodes)

    def info(self, key: str) -> EpisodeInfo | None:
        """A snapshot of episode ``key``, or ``None`` if it is not tracked."""
        e = self._episodes.get(key)
        return None if e is None else EpisodeInfo(e.key, e.state, e.boundary, e.restart, e.retired)

    def __contains__(self, key: object) -> bool:
        return key in self._episodes

    def __len__(self) -> int:
        return len(self._episodes)

    # -- internals ---------------------------------------------------------------------------

    def _get(self, key: str) -> _Episode:
        episode = self._episodes.get(key)
        if episode is None:
            raise KeyError(f"episode {key!r} is not running")
        return episode

    def _tracked(self, episode: _Episode) -> bool:
        return self._episodes.get(episode.key) is episode

    def _forget(self, episode: _Episode) -> None:
        del self._episodes[episode.key]
        if episode.blocks():
            self._count(-1)

    def _set_state(self, episode: _Episode, state: EpisodeState) -> None:
        before = episode.blocks()
        episode.state = state
        self._recount(episode, before)

    def _recount(self, episode: _Episode, before: bool) -> None:
        after = episode.blocks()
        if after != before:
            self._count(+1 if after else -1)

    def _count(self, delta: int) -> None:
        self._blocking += delta
        if self._closed:
            for callback in list(self._listeners):
                try:
                    callback()
                except Exception:  # a listener must not break an episode's transition
                    log.exception("episode steps listener failed")

    def _suspend(self, episode: _Episode) -> None:
        if episode.suspended:
            return
        episode.suspended = True
        timeout = episode.timeout
        if timeout is not None and not timeout.expired() and (when := timeout.when()) is not None:
            episode.remaining = max(0.0, when - asyncio.get_running_loop().time())
            timeout.reschedule(None)

    def _resume(self, episode: _Episode) -> None:
        if not episode.suspended:
            return
        episode.suspended = False
        timeout, remaining = episode.timeout, episode.remaining
        episode.remaining = None
        if timeout is not None and remaining is not None and not timeout.expired():
            timeout.reschedule(asyncio.get_running_loop().time() + remaining)

    @contextlib.asynccontextmanager
    async def _deadline(self, episode: _Episode, seconds: float | None) -> AsyncIterator[None]:
        if episode.timeout is not None:
            raise RuntimeError(f"episode {episode.key!r} already has a deadline")
        if seconds is None:
            yield
            return
        when: float | None = asyncio.get_running_loop().time() + seconds
        if episode.suspended:  # entered inside a replay step during a checkpoint
            episode.remaining, when = seconds, None
        async with asyncio.timeout_at(when) as timeout:
            episode.timeout = timeout
            try:
                yield
            finally:
                episode.timeout = None
                episode.remaining = None

    @contextlib.asynccontextmanager
    async def _step(self, episode: _Episode, mode: StepMode) -> AsyncIterator[None]:
        replay = mode == "replay"
        self._set_state(episode, "replay_step" if replay else "wait_step")
        if replay and self._closed and not episode.restart:
            self._suspend(episode)
        else:
            self._resume(episode)
        episode.in_step = True
        try:
            yield
        finally:
            episode.in_step = False
            if self._tracked(episode) and not (replay and self._closed and not episode.restart):
                self._set_state(episode, "running")
                self._resume(episode)
