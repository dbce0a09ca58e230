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
import time
from pathlib import Path
from typing import Any

from ..protocol import (CommitReply, CommitRequest, EpisodeId, ErrorCode, ForgetReply, ForgetRequest, PrepareReply,
                        PrepareRequest, ProtocolError, RenewReply, RenewRequest, RestoreReply, RestoreRequest,
                        ResumeReply, ResumeRequest, RetireReply, RetireRequest, StatusReply, scope_keys)
from . import storage
from ._control_core import (FENCED_IDS, LEASE_RETRY_S, RETIRE_CONCURRENCY, STORAGE_THREADS, _Checkpoint,
                            _ControlCore, _err, log)
from .base import ExportRecord

__all__ = ["FENCED_IDS", "LEASE_RETRY_S", "RETIRE_CONCURRENCY", "STORAGE_THREADS", "ControlPlane"]


class ControlPlane(_ControlCore):
    """The checkpoint control plane of one participant (see the module docstring).

    Its state, its constructor and the pieces under the operations (deadlines, the storage pool,
    admission, fencing, the lease) are :class:`~._control_core._ControlCore`'s.
    """

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
