"""The state and the machinery under :class:`~.control.ControlPlane` (see :mod:`.control`).

:class:`_ControlCore` holds one participant's control-plane state (phase, active checkpoint id and
lease, the fence of resumed ids, recorded results, per-checkpoint tasks) and the pieces every
operation uses: deadline checks, the storage pool, admission and fencing, ending the active
checkpoint (:meth:`_ControlCore._reopen`) and the lease watch. The checkpoint operations themselves
(prepare, commit, restore, resume, ...) are :class:`~.control.ControlPlane`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..protocol import MAX_DEADLINE_AHEAD_S, CheckpointRequest, EpisodeId, ErrorCode, Phase, ProtocolError
from . import storage
from .base import ExportRecord, Participant
from .marks import RetiredMarks

log = logging.getLogger("tidelog.participant")
T = TypeVar("T")

FENCED_IDS = 64
#: Threads of the control plane's storage pool (records writes, restore reads, write stops). The
#: pool is its own: a read that blocks cannot take a thread the event loop's default executor (and
#: so every ``asyncio.to_thread`` of the server) needs.
STORAGE_THREADS = 4
#: How long an expired lease waits before it retries a reopen that failed.
LEASE_RETRY_S = 30.0
#: How many episodes a retire (or a cleanup) stops at once.
RETIRE_CONCURRENCY = 32


@dataclass
class _Checkpoint:
    """What one checkpoint id has started: its export, write and cleanup, and their arguments."""

    args: tuple[str, tuple[str, ...] | None] | None = None
    export: asyncio.Task[list[ExportRecord]] | None = None
    write: asyncio.Task[dict[str, Any]] | None = None
    cleanup: asyncio.Task[None] | None = None
    stop: storage.WriteStop = field(default_factory=storage.WriteStop)
    failed: str | None = None


def _err(code: ErrorCode, detail: str) -> ProtocolError:
    return ProtocolError(code, detail)


class _ControlCore:
    """A control plane's state and shared machinery; :class:`~.control.ControlPlane` adds the operations."""

    def __init__(self, participant: Participant, *, state_dir: str | Path, checkpoint_root: str | Path | None = None,
                 lease_grace_seconds: float = 600.0, lease_retry_seconds: float = LEASE_RETRY_S,
                 clock: Callable[[], float] = time.time, storage_threads: int = STORAGE_THREADS) -> None:
        """``checkpoint_root`` confines every commit and restore: its ``checkpoint_dir`` must be an
        absolute path under it, reached through no symbolic link (``checkpoint_dir_refused``
        otherwise). Without a root every commit and restore is refused — a participant writes
        nowhere it was not told it may. Storage work runs on ``storage_threads`` threads of the
        control plane's own pool, never on the event loop's default executor."""
        if not lease_grace_seconds > 0 or not math.isfinite(lease_grace_seconds):
            raise ValueError(f"lease_grace_seconds must be a finite number > 0, not {lease_grace_seconds}")
        if storage_threads < 1:
            raise ValueError(f"storage_threads must be >= 1, not {storage_threads}")
        self.participant = participant
        self.checkpoint_root = None if checkpoint_root is None else storage.resolve_root(checkpoint_root)
        self._storage = ThreadPoolExecutor(max_workers=storage_threads, thread_name_prefix="checkpoint-storage")
        self.marks = RetiredMarks(state_dir)
        self.lease_grace_seconds = lease_grace_seconds
        self.lease_retry_seconds = lease_retry_seconds
        self.clock = clock
        self.phase: Phase = "idle"
        self.checkpoint_id: str | None = None
        self.lease_expires_at: float | None = None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._fenced: OrderedDict[str, None] = OrderedDict()
        self._results: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        self._checkpoints: dict[str, _Checkpoint] = {}
        self._install: asyncio.Task[None] | None = None
        self._restore_serial = 0
        self._restoring = False
        self._admission_closed = False
        self._reopen_pending = False
        self._lease_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        participant.notify = self.notify
        participant.marks = self.marks

    # -- small pieces ---------------------------------------------------------------------------

    def notify(self) -> None:
        """Readiness may have changed: wake a waiting prepare."""
        self._wake.set()

    def check_deadline(self, req: CheckpointRequest, op: str) -> None:
        """Refuse a ``deadline_ts`` more than :data:`~workers.protocol.MAX_DEADLINE_AHEAD_S` past
        this participant's clock (422 ``invalid_request``): its lease would outlive any controller."""
        ahead = req.deadline_ts - self.clock()
        if ahead > MAX_DEADLINE_AHEAD_S:
            raise _err(ErrorCode.INVALID_REQUEST,
                       f"invalid {op} request: deadline_ts {req.deadline_ts!r} is {ahead:.0f} s past now; "
                       f"a deadline may lie at most {MAX_DEADLINE_AHEAD_S:.0f} s (7 days) ahead "
                       "(is it in milliseconds?)")

    def _run_storage(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run blocking storage work on the control plane's own pool (see :data:`STORAGE_THREADS`)."""
        return asyncio.get_running_loop().run_in_executor(self._storage, functools.partial(call, *args, **kwargs))

    async def _confined(self, checkpoint_dir: str) -> Path:
        """The root ``checkpoint_dir`` must lie under, refusing it now — before anything is marked,
        pinned or written — if it does not, or if an existing directory on its way is a link."""
        if self.checkpoint_root is None:
            raise storage.refused(f"checkpoint_dir {checkpoint_dir!r} refused: this participant has no "
                                  "checkpoint root configured, so it writes and reads no checkpoint")
        storage.confine(self.checkpoint_root, checkpoint_dir)
        await self._run_storage(storage.check_dir, self.checkpoint_root, checkpoint_dir, self.participant.kind,
                                self.participant.instance)
        return self.checkpoint_root

    def _remaining(self, deadline_ts: float, what: str) -> float:
        remaining = deadline_ts - self.clock()
        if remaining <= 0:
            raise _err(ErrorCode.DEADLINE_EXCEEDED, f"the deadline of {what} has passed")
        return remaining

    async def _within(self, deadline_ts: float, what: str, work: Awaitable[T]) -> T:
        """Await ``work`` until the deadline; a timeout is ``deadline_exceeded`` (the work is not
        cancelled when it is a shielded task the caller keeps)."""
        try:
            async with asyncio.timeout(self._remaining(deadline_ts, what)):
                return await work
        except TimeoutError:
            raise _err(ErrorCode.DEADLINE_EXCEEDED, f"{what} did not finish before its deadline") from None

    def _admit(self, checkpoint_id: str, allowed: Sequence[str], op: str) -> None:
        if checkpoint_id in self._fenced:
            raise _err(ErrorCode.STALE_CHECKPOINT, f"checkpoint {checkpoint_id!r} was resumed; {op} refused")
        if self.checkpoint_id is not None and self.checkpoint_id != checkpoint_id:
            raise _err(ErrorCode.CHECKPOINT_CONFLICT,
                       f"checkpoint {self.checkpoint_id!r} is active; {op} of {checkpoint_id!r} refused")
        if self.phase not in allowed:
            raise _err(ErrorCode.INVALID_PHASE, f"{op} is not allowed in phase {self.phase!r}")

    def _recorded(self, checkpoint_id: str, op: str, args: Any) -> dict[str, Any] | None:
        entry = self._results.get((checkpoint_id, op))
        if entry is None:
            return None
        if entry[0] != args:
            raise _err(ErrorCode.CHECKPOINT_CONFLICT,
                       f"{op} of {checkpoint_id!r} already completed with another directory or scope")
        return entry[1]

    def _renew(self, deadline_ts: float) -> float:
        lease = deadline_ts + self.lease_grace_seconds
        self.lease_expires_at = lease if self.lease_expires_at is None else max(self.lease_expires_at, lease)
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = asyncio.get_running_loop().create_task(self._watch_lease(), name="lease-watch")
        return self.lease_expires_at

    def _spawn(self, work: Awaitable[T], name: str) -> asyncio.Task[T]:
        async def run() -> T:
            return await work
        task = asyncio.get_running_loop().create_task(run(), name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    async def _stop_all(episodes: list[EpisodeId], stop: Callable[[EpisodeId], Awaitable[None]]) -> None:
        """Run ``stop`` on every episode, at most :data:`RETIRE_CONCURRENCY` at once.

        One failure does not cancel the others (each must still stop); after all have ended the
        first failure is raised as it is, so a typed error stays typed.
        """
        gate = asyncio.Semaphore(RETIRE_CONCURRENCY)

        async def one(episode: EpisodeId) -> None:
            async with gate:
                await stop(episode)
        outcomes = await asyncio.gather(*(one(e) for e in episodes), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    # -- admission, and ending a checkpoint -----------------------------------------------------

    async def _close(self) -> None:
        self._admission_closed = True
        await self.participant.close_admission()

    async def _open_or_pend(self) -> None:
        """Open admission; if that fails, remember it so the next resume retries."""
        try:
            await self.participant.open_admission()
            self._reopen_pending = self._admission_closed = False
        except BaseException:
            self._reopen_pending = True
            raise
        finally:
            self.notify()

    def _fence(self, cid: str) -> None:
        self._fenced[cid] = None
        self._fenced.move_to_end(cid)
        while len(self._fenced) > FENCED_IDS:
            self._fenced.popitem(last=False)

    async def _reopen(self, deadline_ts: float | None, *, fence: bool = True) -> None:
        """End the active checkpoint (caller holds the lock): stop its write, cancel its export,
        wait for its cleanup, open admission, fence the id. A timeout keeps the phase.

        ``fence=False`` is a prepare that failed to close admission (or whose wait failed):
        nothing was exported, and the controller may retry the same id."""
        cid = self.checkpoint_id
        state = self._checkpoints.get(cid) if cid is not None else None
        if state is not None:
            # Waits only for a manifest publication under way; after it, none can appear.
            await self._run_storage(state.stop.stop)
            if state.export is not None and not state.export.done():
                state.export.cancel()
            if state.cleanup is not None and not state.cleanup.done():
                if deadline_ts is None:
                    await asyncio.shield(state.cleanup)
                else:
                    await self._within(deadline_ts, "resume (waiting for restored-state cleanup)",
                                       asyncio.shield(state.cleanup))
        await self._open_or_pend()
        if cid is not None:
            if fence:
                self._fence(cid)
            self._checkpoints.pop(cid, None)
            for op in ("prepare", "commit", "restore"):
                self._results.pop((cid, op), None)
        self.phase, self.checkpoint_id, self.lease_expires_at = "idle", None, None
        lease = self._lease_task
        self._lease_task = None
        if lease is not None and lease is not asyncio.current_task():
            lease.cancel()

    # -- lease ----------------------------------------------------------------------------------

    async def _watch_lease(self) -> None:
        """Resume by ourselves once the lease passes; retry a failed reopen every 30 s."""
        while True:
            expires = self.lease_expires_at
            if expires is None:
                return
            delay = expires - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            async with self._lock:
                if self.lease_expires_at is None or self.lease_expires_at > self.clock():
                    continue
                cid = self.checkpoint_id
                log.warning("lease of checkpoint %s expired; resuming by ourselves", cid)
                try:
                    await self._reopen(self.clock() + self.lease_retry_seconds)
                    return
                except Exception as exc:
                    log.warning("reopen after lease expiry of %s failed (%s); retrying in %.0f s",
                                cid, exc, self.lease_retry_seconds)
            await asyncio.sleep(self.lease_retry_seconds)

    async def aclose(self) -> None:
        """Stop background tasks and close the marks file (server shutdown)."""
        tasks = [t for t in (*self._background, self._lease_task) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._storage.shutdown(wait=False, cancel_futures=True)
        self.marks.close()
