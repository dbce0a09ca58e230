"""The participant's control plane: the phase machine behind the checkpoint routes.

One :class:`ControlPlane` per server owns the phase (``idle``, ``preparing``,
``prepared``, ``committed``, ``restored``), the active checkpoint id and its
lease, the fence of the last 64 resumed ids, the recorded results of completed
prepare/commit/restore calls, the per-checkpoint export, write and cleanup
tasks, and the retire marks. It calls the :class:`~.base.Participant` hooks and
never lets a hook see a protocol detail.

Invariants:

- One asyncio lock serializes every transition. Work that may take long (the
  readiness wait, an export, the records write, an install, stopping retired
  episodes) runs outside it and re-checks, under the lock, that the checkpoint
  it worked for is still the active one.
- Admission is open whenever the phase is ``idle`` and no reopen is pending.
- A checkpoint id exports at most once; a failed export (or readiness that
  regressed before the export) is final for that id (``export_failed``).
- The export, the write and the cleanup of unscoped restored state are tasks
  the control plane owns: a deadline or a dropped connection ends the *call*,
  never the work, and a retry awaits the same task.
- After :meth:`resume` returns, no manifest of the resumed checkpoint appears.
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

from ..protocol import (MAX_DEADLINE_AHEAD_S, CheckpointRequest, CommitReply, CommitRequest, EpisodeId, ErrorCode, ForgetReply, ForgetRequest, Phase,
                        PrepareReply, PrepareRequest, ProtocolError, RenewReply, RenewRequest, RestoreReply,
                        RestoreRequest, ResumeReply, ResumeRequest, RetireReply, RetireRequest, StatusReply,
                        scope_keys)
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


class ControlPlane:
    """The checkpoint control plane of one participant (see the module docstring)."""

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

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> StatusReply:
        return StatusReply(kind=self.participant.kind, instance=self.participant.instance, phase=self.phase,
                           checkpoint_id=self.checkpoint_id, lease_expires_at=self.lease_expires_at,
                           retired_rollouts=len(self.marks), epochs=self.marks.epochs(),
                           stale_epochs_refused=self.marks.stale_epochs_refused,
                           report=self.participant.readiness(), **self.participant.status_extra())

    # -- prepare --------------------------------------------------------------------------------

    async def prepare(self, req: PrepareRequest) -> PrepareReply:
        self.check_deadline(req, "prepare")
        cid = req.checkpoint_id
        async with self._lock:
            if cid not in self._fenced and (done := self._recorded(cid, "prepare", None)) is not None:
                return PrepareReply.model_validate(done)
            self._admit(cid, ("idle", "preparing"), "prepare")
            self._remaining(req.deadline_ts, "prepare")
            if self.phase == "idle":
                self.checkpoint_id, self.phase = cid, "preparing"
                self._renew(req.deadline_ts)
                try:
                    await self._close()
                except BaseException:
                    await self._reopen(None, fence=False)
                    raise
            else:
                self._renew(req.deadline_ts)
        try:
            await self._wait_ready(cid, req.deadline_ts)
        except BaseException:
            async with self._lock:
                if self.checkpoint_id == cid and self.phase == "preparing":
                    await self._reopen(None, fence=False)
            raise
        async with self._lock:
            if self.checkpoint_id != cid:
                # A resume or lease expiry ended this checkpoint while we waited: for this id the
                # participant went back to idle, whatever checkpoint may be active by now.
                return PrepareReply(phase="idle", report=self.participant.readiness())
            if self.phase == "preparing" and self.participant.ready():
                self.phase = "prepared"
            reply = PrepareReply(phase=self.phase, report=self.participant.readiness())
            if self.phase == "prepared":
                self._results[(cid, "prepare")] = (None, reply.model_dump())
            return reply

    async def _wait_ready(self, cid: str, deadline_ts: float) -> None:
        """Poll the cheap ``ready()`` on every wake-up (or once a second) until ready or deadline."""
        while self.checkpoint_id == cid and self.phase == "preparing" and not self.participant.ready():
            remaining = deadline_ts - self.clock()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass

    # -- renew ----------------------------------------------------------------------------------

    async def renew(self, req: RenewRequest) -> RenewReply:
        self.check_deadline(req, "renew")
        async with self._lock:
            self._admit(req.checkpoint_id, ("preparing", "prepared", "committed", "restored"), "renew")
            if self.checkpoint_id is None:
                raise _err(ErrorCode.INVALID_PHASE, "renew needs an active checkpoint")
            return RenewReply(lease_expires_at=self._renew(req.deadline_ts))

    # -- retire and forget ----------------------------------------------------------------------

    async def retire(self, req: RetireRequest) -> RetireReply:
        self.check_deadline(req, "retire")
        async with self._lock:
            self._admit(req.checkpoint_id, ("idle", "restored"), "retire")
            if self.phase == "restored":
                self._renew(req.deadline_ts)
            # The mark comes first and stays whatever happens next, even past the deadline.
            self.marks.mark(req.episode_ids)
            latest: dict[str, EpisodeId] = {}
            for episode in req.episode_ids:
                if episode.attempt >= latest.get(episode.rollout_id, episode).attempt:
                    latest[episode.rollout_id] = episode
            install = self._install
        if install is not None and not install.done():
            await self._within(req.deadline_ts, "retire (waiting for an install)", asyncio.wait({install}))
        await self._within(req.deadline_ts, "retire", self._stop_all(list(latest.values()),
                                                                     self.participant.retire))
        self.notify()
        return RetireReply(retired_count=len({e.capture_key for e in req.episode_ids}))

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

    async def forget(self, req: ForgetRequest) -> ForgetReply:
        self.check_deadline(req, "forget")
        async with self._lock:
            self._admit(req.checkpoint_id, ("idle", "restored"), "forget")
            if self.phase == "restored":
                self._renew(req.deadline_ts)
            ids = sorted(set(req.rollout_ids))
            self.marks.forget(ids)
            self.participant.forget(ids)
            return ForgetReply(forgotten_count=len(ids))

    # -- commit ---------------------------------------------------------------------------------

    async def commit(self, req: CommitRequest) -> CommitReply:
        self.check_deadline(req, "commit")
        root = await self._confined(req.checkpoint_dir)
        cid = req.checkpoint_id
        scope = scope_keys(req.episode_ids)
        args = (req.checkpoint_dir, scope)
        async with self._lock:
            if cid not in self._fenced and (done := self._recorded(cid, "commit", args)) is not None:
                return CommitReply.model_validate(done)
            self._admit(cid, ("prepared",), "commit")
            state = self._checkpoints.setdefault(cid, _Checkpoint())
            if state.failed is not None:
                raise _err(ErrorCode.EXPORT_FAILED, f"checkpoint {cid!r} cannot be committed: {state.failed}; "
                                                    "resume, then prepare again under a new id")
            if state.args is not None and state.args != args:
                raise _err(ErrorCode.CHECKPOINT_CONFLICT,
                           f"a commit of {cid!r} into another directory or scope is under way")
            self._remaining(req.deadline_ts, "commit")
            self._renew(req.deadline_ts)
            if scope is not None:
                restarts = set(self.participant.restarts()) & set(scope)
                if restarts:
                    raise _err(ErrorCode.RESTART_IN_SCOPE,
                               f"the scope names restarts, which are never exported: {sorted(restarts)[:10]}")
            if state.export is None:
                self.participant.check_commit(None if scope is None else frozenset(scope))
                if not self.participant.ready():
                    state.failed = "readiness regressed after prepare"
                    raise _err(ErrorCode.EXPORT_FAILED, f"checkpoint {cid!r}: {state.failed}; "
                                                        "resume, then prepare again under a new id")
                state.args = args
                state.export = self._spawn(self.participant.export(None if scope is None else frozenset(scope)),
                                           f"export-{cid}")
        assert state.export is not None
        try:
            return await self._commit_work(req, state, state.export, args, root)
        except (asyncio.CancelledError, storage.WriteStopped):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this call itself is being cancelled
            # A resume (or lease expiry) cancelled the export or stopped the write under us.
            raise _err(ErrorCode.STALE_CHECKPOINT, f"checkpoint {cid!r} was resumed while its commit ran"
                       ) from None

    async def _commit_work(self, req: CommitRequest, state: _Checkpoint,
                           export: asyncio.Task[list[ExportRecord]],
                           args: tuple[str, tuple[str, ...] | None], root: Path) -> CommitReply:
        """Await the export, then the write, then the cleanup — each a task this checkpoint owns —
        re-checking under the lock between them that the checkpoint is still the active one."""
        cid = req.checkpoint_id
        scope = args[1]
        try:
            records = await self._within(req.deadline_ts, "commit (export)", asyncio.shield(export))
        except ProtocolError:
            raise
        except Exception as exc:
            async with self._lock:
                state.failed = f"its export failed ({type(exc).__name__}: {exc})"
            raise _err(ErrorCode.EXPORT_FAILED, f"checkpoint {cid!r}: {state.failed}; "
                                                "resume, then prepare again under a new id") from None
        async with self._lock:
            self._admit(cid, ("prepared",), "commit")
            if state.write is None or (state.write.done() and state.write.exception() is not None):
                state.write = self._spawn(self._run_storage(
                    storage.write_records, req.checkpoint_dir, self.participant.kind, self.participant.instance,
                    cid, records, stop=state.stop, root=root), f"write-{cid}")
            write = state.write
        manifest = await self._within(req.deadline_ts, "commit (write)", asyncio.shield(write))
        async with self._lock:
            self._admit(cid, ("prepared",), "commit")
            if state.cleanup is None or (state.cleanup.done() and state.cleanup.exception() is not None):
                keep = set(scope or ())
                unscoped = [e for e in self.participant.restored_pending() if e.capture_key not in keep]
                state.cleanup = self._spawn(self._stop_all(unscoped, self.participant.delete_restored),
                                            f"cleanup-{cid}")
            cleanup = state.cleanup
        await self._within(req.deadline_ts, "commit (deleting unscoped restored state)", asyncio.shield(cleanup))
        async with self._lock:
            self._admit(cid, ("prepared",), "commit")
            reply = CommitReply(phase="committed", manifest=manifest, episode_ids=sorted(k for k, _ in records),
                                **self.participant.commit_extra(records))
            self.phase = "committed"
            self._results[(cid, "commit")] = (args, reply.model_dump())
        if req.stop:
            try:
                await self.participant.park_exported(records)
            except Exception:
                log.exception("park_exported failed after commit %s (the commit stands)", cid)
        return reply

    # -- restore --------------------------------------------------------------------------------

    async def restore(self, req: RestoreRequest) -> RestoreReply:
        self.check_deadline(req, "restore")
        root = await self._confined(req.checkpoint_dir)
        cid = req.checkpoint_id
        scope = scope_keys(req.episode_ids) or ()
        args = (req.checkpoint_dir, scope)
        async with self._lock:
            if cid not in self._fenced and (done := self._recorded(cid, "restore", args)) is not None:
                return RestoreReply.model_validate(done)
            self._admit(cid, ("idle",), "restore")
            if self.checkpoint_id is not None or self._reopen_pending:
                raise _err(ErrorCode.INVALID_PHASE, "restore needs an idle participant with admission open")
            if self._restoring:
                raise _err(ErrorCode.CHECKPOINT_CONFLICT, "another restore is under way on this participant")
            self.participant.check_restorable()
            # The replaced attempts are refused before any work the deadline limits.
            self.marks.mark(req.episode_ids)
            self._remaining(req.deadline_ts, "restore")
            self._restoring = True
            self._restore_serial += 1
            serial = self._restore_serial
        try:
            return await self._restore_work(req, args, serial, root)
        finally:
            self._restoring = False

    async def _restore_work(self, req: RestoreRequest, args: tuple[str, tuple[str, ...]], serial: int,
                            root: Path) -> RestoreReply:
        """Read and verify (in a thread), wait for an earlier install, close admission, install."""
        cid = req.checkpoint_id
        wanted = frozenset(args[1])
        participant = self.participant

        def select(record: dict[str, Any]) -> Any | None:
            try:
                key = EpisodeId.model_validate(record.get("episode_id")).capture_key
            except ValueError:
                raise storage.invalid("a checkpoint record has no valid episode_id") from None
            if key not in wanted:
                return None
            try:
                return participant.decode(record)
            except ValueError as exc:
                raise storage.invalid(f"checkpoint record of episode {key!r} is invalid: {exc}") from None

        # The read stops by itself at the deadline too, so a timed-out restore leaves no thread behind.
        read_until = time.monotonic() + self._remaining(req.deadline_ts, "restore (read)")
        manifest, records = await self._within(req.deadline_ts, "restore (read)", self._run_storage(
            storage.read_records, req.checkpoint_dir, participant.kind, participant.instance, select, keys=wanted,
            root=root, deadline=read_until))
        previous_install = self._install
        if previous_install is not None and not previous_install.done():
            # Only wait: the earlier install's own failure is not this restore's.
            await self._within(req.deadline_ts, "restore (waiting for an earlier install)",
                               asyncio.wait({previous_install}))
        async with self._lock:
            self._admit(cid, ("idle",), "restore")
            try:
                await self._close()
            except BaseException:
                await self._open_or_pend()
                raise
            install = self._install = self._spawn(participant.install(records, list(req.episode_ids)),
                                                   f"install-{cid}")
        try:
            await self._within(req.deadline_ts, "restore (install)", asyncio.shield(install))
        except BaseException:
            if install.done():
                async with self._lock:
                    await self._open_or_pend()
            else:
                # Admission reopens once the install that outlived its restore has finished,
                # unless a later restore has taken over by then.
                install.add_done_callback(lambda _t: self._spawn(self._reopen_after_install(serial),
                                                                 "reopen-after-install"))
            raise
        async with self._lock:
            self.checkpoint_id, self.phase = cid, "restored"
            self._renew(req.deadline_ts)
            reply = RestoreReply(phase="restored", source_checkpoint_id=manifest["checkpoint_id"],
                                 restored=sorted(e.next_attempt().capture_key for e in req.episode_ids))
            self._results[(cid, "restore")] = (args, reply.model_dump())
            return reply

    async def _reopen_after_install(self, serial: int) -> None:
        async with self._lock:
            if serial == self._restore_serial and self.checkpoint_id is None and self._admission_closed:
                await self._open_or_pend()

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

    # -- resume ---------------------------------------------------------------------------------

    async def resume(self, req: ResumeRequest) -> ResumeReply:
        self.check_deadline(req, "resume")
        cid = req.checkpoint_id
        async with self._lock:
            if self.checkpoint_id is None:
                install = self._install
                if install is not None and not install.done():
                    # An install outlived its (failed) restore: admission reopens after it.
                    await self._within(req.deadline_ts, "resume (waiting for an install)", asyncio.wait({install}))
                if self._reopen_pending or self._admission_closed:
                    await self._open_or_pend()
                # Fence an id this participant never saw, so its late prepare is refused.
                self._fence(cid)
                return ResumeReply(phase="idle", idempotent=True)
            if cid in self._fenced:
                return ResumeReply(phase="idle", idempotent=True)
            if self.checkpoint_id != cid:
                raise _err(ErrorCode.CHECKPOINT_CONFLICT,
                           f"checkpoint {self.checkpoint_id!r} is active; resume of {cid!r} refused")
            await self._reopen(req.deadline_ts)
            return ResumeReply(phase="idle", idempotent=False)

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
