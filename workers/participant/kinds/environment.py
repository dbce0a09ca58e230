"""The environment participant: episodes with step boundaries, exported at their last boundary.

An environment server owns the episode protocol. It runs each episode inside
:meth:`EnvironmentParticipant.episode`, records a boundary after each completed
step (:meth:`Episode.boundary`) and wraps each step in :meth:`Episode.step` with
its mode: ``wait`` (a checkpoint waits for the step) or ``replay`` (the
checkpoint exports the boundary before the step, and the step runs again after
a crash). While a checkpoint is open an episode parks at its next boundary, and
its deadline does not run while it is parked.

A record is ``{"episode_id", "task_digest", "boundary"}``; ``task_digest`` is the
SHA-256 of the task's compact, key-sorted JSON, and a replacement attempt that
arrives with a different task is refused. Restored episodes wait in
:meth:`restored_pending` until their replacement begins; they are exported
again, at their restored boundary, while unclaimed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ...protocol import MAX_BLOCKERS_LISTED, EpisodeId, ErrorCode, PrepareReport, ProtocolError
from ..base import ExportRecord, Participant
from ..steps import EpisodeSteps, StepMode
from ..storage import check_payload

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def task_digest(task: Any) -> str:
    """SHA-256 of the task's compact, key-sorted JSON: what a replacement must match."""
    return hashlib.sha256(json.dumps(task, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class RestoredEpisode:
    """An episode restored here, waiting for its replacement attempt to begin."""

    episode: EpisodeId  # the replacement attempt
    task_digest: str
    boundary: Any


class Episode:
    """The handle an episode's task uses: its identity, where it resumes from, and its steps."""

    def __init__(self, owner: EnvironmentParticipant, episode: EpisodeId, continuation: Any) -> None:
        self._owner = owner
        self.id = episode
        self.key = episode.capture_key
        #: The boundary a restored episode continues from (``None``: start from the task).
        self.continuation = continuation

    async def boundary(self, state: Any) -> None:
        """Record ``state`` as the boundary after a completed step (a JSON payload, checked now);
        parks here while a checkpoint is open."""
        check_payload(state)
        await self._owner.steps.boundary(self.key, state)

    def step(self, mode: StepMode = "wait") -> AbstractAsyncContextManager[None]:
        """The next step, in ``wait`` or ``replay`` mode."""
        return self._owner.steps.step(self.key, mode)

    async def mark_restart(self) -> None:
        """This episode cannot be saved (a downstream server said so): never block, never export."""
        await self._owner.steps.mark_restart(self.key)


class EnvironmentParticipant(Participant):
    """Episode steps of an environment server as a checkpoint participant."""

    kind = "environment"

    def __init__(self, instance: str) -> None:
        super().__init__(instance)
        self.steps = EpisodeSteps()
        self.steps.add_listener(lambda: self.notify())
        self._open = True
        self._restored: dict[str, RestoredEpisode] = {}
        self._live: dict[str, tuple[EpisodeId, str]] = {}  # key -> (episode, task digest)
        self._by_rollout: dict[str, set[str]] = {}
        self.started = 0

    # -- data plane -----------------------------------------------------------------------------

    @asynccontextmanager
    async def episode(self, episode: EpisodeId, task: Any, *, deadline_s: float | None = None,
                      restart: bool = False) -> AsyncIterator[Episode]:
        """Run one attempt of an episode in the current task.

        Refuses a retired attempt (``stale_attempt``), a second start of a live attempt, a
        replacement whose task differs from the checkpointed one (``checkpoint_conflict``), and a
        new episode while a checkpoint holds admission closed (``checkpoint_parked``). A restored
        attempt may begin while closed: it sits at its restored boundary. An episode a retire
        stops ends with ``stale_attempt`` (not a bare cancellation).
        """
        self.check_attempt(episode)
        key = episode.capture_key
        digest = task_digest(task)
        restored = self._restored.get(key)
        if restored is not None and restored.task_digest != digest:
            raise ProtocolError(ErrorCode.CHECKPOINT_CONFLICT,
                                f"episode {key!r} was restored for another task (digest {restored.task_digest[:12]}…)")
        if not self._open and restored is None:
            raise ProtocolError(ErrorCode.CHECKPOINT_PARKED, f"a checkpoint is open; episode {key!r} must wait")
        continuation = restored.boundary if restored is not None else None
        self.steps.begin(key, continuation=continuation, restart=restart)
        self._restored.pop(key, None)
        self._live[key] = (episode, digest)
        self._by_rollout.setdefault(episode.rollout_id, set()).add(key)
        self.started += 1
        try:
            async with self.steps.deadline(key, deadline_s):
                yield Episode(self, episode, continuation)
        except asyncio.CancelledError:
            # Cancelled by a retire: the caller gets a typed answer, not a dropped connection.
            info = self.steps.info(key)
            task = asyncio.current_task()
            if info is not None and info.retired and task is not None and task.uncancel() == 0:
                raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"episode {key!r} was retired") from None
            raise
        finally:
            self.steps.end(key)
            # A retired episode stays tracked (and blocking) until a retire has waited for it;
            # that retire, maybe a retry after this task ended, finds it through the index.
            if key not in self.steps:
                self._drop_live(key, episode.rollout_id)

    def _drop_live(self, key: str, rollout_id: str) -> None:
        self._live.pop(key, None)
        keys = self._by_rollout.get(rollout_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_rollout[rollout_id]

    # -- checkpoint hooks -----------------------------------------------------------------------

    async def close_admission(self) -> None:
        self._open = False
        self.steps.close()

    async def open_admission(self) -> None:
        self._open = True
        self.steps.open()

    def ready(self) -> bool:
        return self.steps.ready()

    def readiness(self) -> PrepareReport:
        return PrepareReport(ready=self.steps.ready(), blockers=self.steps.blockers(MAX_BLOCKERS_LISTED),
                             blocker_count=self.steps.blocker_count(), restarts=self.steps.restarts(),
                             counts={"episodes": len(self._live), "restored_pending": len(self._restored)})

    def restarts(self) -> list[str]:
        return self.steps.restarts()

    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        records: list[ExportRecord] = []
        for key, boundary in self.steps.exported().items():
            if scope is not None and key not in scope:
                continue
            episode, digest = self._live[key]
            records.append((key, {"episode_id": episode.model_dump(), "task_digest": digest, "boundary": boundary}))
        for key, restored in self._restored.items():
            if scope is None or key in scope:
                records.append((key, {"episode_id": restored.episode.model_dump(),
                                      "task_digest": restored.task_digest, "boundary": restored.boundary}))
        return records

    def restored_pending(self) -> list[EpisodeId]:
        return [r.episode for r in self._restored.values()]

    def check_restorable(self) -> None:
        if self._live:
            raise ProtocolError(ErrorCode.INVALID_PHASE,
                                f"restore requires no live episodes; {len(self._live)} are running")

    def decode(self, record: dict[str, Any]) -> RestoredEpisode:
        episode = EpisodeId.model_validate(record["episode_id"])
        digest = record.get("task_digest")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise ValueError("task_digest is not a SHA-256 hex digest")
        if "boundary" not in record:
            raise ValueError("the record has no boundary")
        return RestoredEpisode(episode.next_attempt(), digest, record["boundary"])

    async def install(self, records: Sequence[Any], scope: Sequence[EpisodeId]) -> None:
        self.check_restorable()
        for restored in records:
            self._restored[restored.episode.capture_key] = restored
        self.notify()

    async def retire(self, episode: EpisodeId) -> None:
        for key, restored in list(self._restored.items()):
            if restored.episode.rollout_id == episode.rollout_id and restored.episode.attempt <= episode.attempt:
                del self._restored[key]
        keys = [k for k in self._by_rollout.get(episode.rollout_id, ())
                if self._live[k][0].attempt <= episode.attempt]
        await asyncio.gather(*(self.steps.retire(k) for k in keys))
        for key in keys:
            self._drop_live(key, episode.rollout_id)

    async def delete_restored(self, episode: EpisodeId) -> None:
        # Unclaimed restored state only: nothing is fenced, the attempt may still start over.
        self._restored.pop(episode.capture_key, None)

    def status_extra(self) -> dict[str, Any]:
        return {"episodes": len(self._live), "restored_pending": len(self._restored), "started": self.started}
