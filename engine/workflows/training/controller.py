"""The training controller: one optimizer step per job, exactly once, with evidence for every doubt.

A job is recorded ``RUNNING`` (``engine.workflows.training.submit_job``) before the trainer is called.
This controller then, for a ``RUNNING`` job whose ``RUNNING`` commit it saw in this process:

0. brings the trainer onto the deployment's latest verified step if it holds another (a trainer
   process started again after a crash loads the newest job's checkpoint; a fresh one of a new
   deployment declares its initial weights) — see ``_sync_trainer``;
   With ``training.colocated``, it then pauses every engine and releases its memory
   (:mod:`engine.workflows.training.colocated`); until every engine has, ``train`` is not called:
   the job stays ``RUNNING`` with why in ``detail`` and is tried again;
1. calls ``train`` on the trainer rank (through an executor: uni, mp or Ray);
2. saves the checkpoint tagged with the job id (``<checkpoint_dir>/<job id>.ckpt``) and
   verifies it;
3. moves the job to ``CHECKPOINT`` with the checkpoint path and the metrics, in one transition.

A failure of any of these leaves the job ``AMBIGUOUS`` (the step may or may not have run),
except a refusal the trainer makes before any step (a malformed job): ``FAILED``.

A ``RUNNING`` job this process did not record — found after a restart or a take-over — may
have been trained by a process that died: it becomes ``AMBIGUOUS``, never trained on sight.
An ``AMBIGUOUS`` job is settled only from durable evidence (after the same bringing-on of the
trainer, which leaves alone a trainer whose latest step is the job), in this order:

- a checkpoint at its path that verifies and carries its job id: ``CHECKPOINT``;
- the live trainer's latest step is this job (the orchestrator died between ``train`` and the
  checkpoint): the checkpoint is saved and verified now, then ``CHECKPOINT``;
- the trainer's persisted step record does not name the job, so its step never started on the
  trainer that holds the weights: ``RUNNING`` again, and it is trained (once). A trainer with no
  record at all counts only if it never took a step: one that stepped without keeping a record
  (no ``state_dir``) proves nothing;
- otherwise it stays ``AMBIGUOUS`` with what is known in ``ambiguity``, for an operator.

The trainer being unreachable, or a checkpoint that cannot be saved, decides nothing: what
happened is written to ``ambiguity`` (when it changed) and the job is looked at again later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from journal import Committed, Transition, models
from journal.readiness import deployment_held
from journal.writes import Row, to_row

from workers.inference.engine import InferenceEngine, RegionState

from engine.runtime.clock import Clock, SystemClock
from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.training.colocated import ColocatedSettings, release_for_training
from engine.workflows.training.engine_gate import held_for_training, record_engine
from engine.workflows.training.publication import PublicationSettings, Publisher
from engine.workflows.training.trainer_host import TrainerRestartPending

log = logging.getLogger("tidelog.training")

KIND = "training_jobs"
#: States whose job's step is verified (a checkpoint) and stays in the trainer's lineage.
KEPT = ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE")
#: States whose next step calls the trainer (besides RUNNING): they wait while it is down for good.
NEEDS_TRAINER = ("AMBIGUOUS", "CHECKPOINT", "UPDATING_WEIGHTS", "REJECTING")
#: The job id a trainer's step record names when it holds its initial weights (workers.trainer.steps).
INITIAL = "initial"


#: The calls that change what a rank holds: with several ranks every rank gets them, sent to all
#: before any reply is awaited (a data-parallel group steps, loads and declares together); rank 0's
#: reply is the group's. A refusal counts as one (``JobError``: nothing stepped) only when every rank
#: refused; any other mix of failures is the group's failure, and the step may have run somewhere.
GROUP_CALLS = frozenset({"train", "load_checkpoint", "load_weights", "declare_initial"})


class TrainerRanks(Protocol):
    """What the controller needs of an executor (``workers.executor.Executor``)."""

    def rpc(self, rank: int, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
            timeout: float | None = None) -> Any: ...


@dataclass(frozen=True)
class TrainingSettings:
    checkpoint_dir: str
    #: The deployment whose jobs this controller trains (None: every job it is given; tests).
    deployment: str | None = None
    #: The trainer rank that answers for the group: every call but :data:`GROUP_CALLS` goes to it alone.
    rank: int = 0
    #: How many ranks the executor runs; with more than one, :data:`GROUP_CALLS` go to every rank.
    ranks: int = 1
    train_timeout_s: float = 3600.0
    call_timeout_s: float = 120.0
    #: How soon an unsettled AMBIGUOUS job (or an unreachable trainer) is looked at again.
    retry_after_s: float = 5.0


class TrainingController(BaseController):
    kind = KIND

    def __init__(self, executor: TrainerRanks, settings: TrainingSettings,
                 publication: tuple[Sequence[InferenceEngine] | Mapping[str, InferenceEngine],
                                    PublicationSettings] | None = None, clock: Clock | None = None,
                 colocated: ColocatedSettings | None = None) -> None:
        self._executor = executor
        self._clock: Clock = clock or SystemClock()
        self.settings = settings
        #: Colocated training: the engines' memory is released before each step (``colocated.py``).
        self.colocated = colocated or ColocatedSettings()
        # From CHECKPOINT on, the job's weights are published (when engines are given).
        self.publisher = None if publication is None else Publisher(self._call, *publication,
                                                                      ensure_trainer=self._ensure_trainer,
                                                                      fresh_trainer=self._fresh_trainer)
        # Job id -> the version of the RUNNING row this process committed: the only RUNNING
        # records it may act on by calling train (once each).
        self._recorded: dict[str, int] = {}
        self._busy: set[str] = set()  # jobs whose trainer calls are running now

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """Journal commit listener: note the RUNNING records this process made."""
        for c in committed:
            if c.kind == KIND and c.to_state == "RUNNING":
                self._recorded[c.entity_id] = c.version

    def checkpoint_path(self, job_id: str) -> str:
        return str(Path(self.settings.checkpoint_dir) / f"{job_id}.ckpt")

    async def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        limit = timeout if timeout is not None else self.settings.call_timeout_s
        try:
            if self.settings.ranks > 1 and method in GROUP_CALLS:
                return await self._group(method, args, limit)
            return await asyncio.to_thread(self._executor.rpc, self.settings.rank, method, args, None, limit)
        except TimeoutError:
            # A trainer that does not answer a cheap call is stuck: calls would only queue behind it.
            # Stopping it loses nothing durable; the next sync point starts a fresh one.
            release = getattr(self._executor, "release", None)
            if method != "train" and release is not None:
                await asyncio.to_thread(release, f"{method} did not answer within {limit:g} s")
            raise

    async def _group(self, method: str, args: tuple[Any, ...], limit: float) -> Any:
        """``method`` on every rank at once (see :data:`GROUP_CALLS`); rank 0's reply."""
        replies = await self._every_rank(method, args, limit)
        failed = {rank: r for rank, r in enumerate(replies) if isinstance(r, BaseException)}
        if not failed:
            return replies[self.settings.rank]
        if len(failed) == len(replies) and all(_refused_before_any_step(e) for e in failed.values()):
            raise failed[0]
        if len(failed) == len(replies) and all(isinstance(e, TimeoutError) for e in failed.values()):
            raise failed[0]
        said = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failed.items()))
        raise RuntimeError(f"{method} failed on {len(failed)} of {len(replies)} ranks ({said}); "
                           f"the others answered")

    async def _every_rank(self, method: str, args: tuple[Any, ...], limit: float) -> list[Any]:
        """``method`` sent to every rank before any reply is awaited: replies (or exceptions) in rank order."""
        return await asyncio.gather(*(asyncio.to_thread(self._executor.rpc, rank, method, args, None, limit)
                                      for rank in range(self.settings.ranks)), return_exceptions=True)

    async def _health(self) -> dict[str, Any]:
        """The trainer's health as rank 0 reports it. With several ranks every rank is asked, and ranks
        that disagree on their step, latest job or step in doubt make the report ``in_doubt`` (so the
        group is put back on the latest checkpoint, or started again, before anything trusts it)."""
        if self.settings.ranks <= 1:
            health: dict[str, Any] = await self._call("health")
            return health
        reports = await self._every_rank("health", (), self.settings.call_timeout_s)
        failed = [r for r in reports if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        report: dict[str, Any] = dict(reports[self.settings.rank])
        views = {(r.get("step"), r.get("last_job_id"), r.get("in_doubt")) for r in reports}
        if len(views) > 1 and report.get("in_doubt") is None:
            report["in_doubt"] = f"ranks disagree: {sorted(map(str, views))}"[:300]
        return report

    # -- the machine ----------------------------------------------------------------------

    async def reconcile(self, ctx: Context, job_id: str) -> Result:
        row = await ctx.get(KIND, job_id)
        if row is None or row.state not in ("RUNNING", "AMBIGUOUS", *Publisher.STATES):
            self._recorded.pop(job_id, None)
            return Result()
        if self.settings.deployment is not None and row["deployment"] != self.settings.deployment:
            return Result()  # another deployment's job: its trainer and engines are not these
        if job_id in self._busy:
            return Result()  # the calls' end writes the outcome and wakes it
        gave_up: str | None = getattr(self._executor, "gave_up", None)
        if gave_up is not None and row.state in NEEDS_TRAINER:
            # Past training.recovery the trainer is not started again: a step that needs it waits,
            # with the reason in its row (once), until the orchestrator is restarted. (RUNNING says
            # it through its own not-ready path, which keeps the job ours to train.)
            if row["detail"] != gave_up:
                await ctx.apply(Transition(KIND, row.id, row.state, row.version, row.state, gave_up[:200],
                                           {"detail": gave_up}))
            return Result()
        if row.state in Publisher.STATES:
            if self.publisher is None:
                return Result()  # no engines to publish to: the job waits in its state
            self._busy.add(job_id)
            try:
                async with self.publisher.lock:
                    return await self.publisher.step(ctx, row)
            finally:
                self._busy.discard(job_id)
        if row.state == "RUNNING":
            if self._recorded.pop(job_id, None) != row.version:
                await ctx.apply(self._ambiguous(row, "found RUNNING without having recorded it here (a restart or "
                                                     "a take-over): its step may have run"))
                return Result()
            try:
                health = await self._sync_trainer(ctx, row)
            except Exception as exc:  # noqa: BLE001 - train was not called: the job stays RUNNING, ours to train
                return await self._not_trained(ctx, row, f"the trainer is not ready ({type(exc).__name__}: {exc}); "
                                                         f"train not called, trying again")
            if self.colocated.enabled and self.publisher is not None:
                try:
                    why = await self._release_engines(ctx, row)
                except Exception as exc:  # noqa: BLE001 - train was not called: the job stays RUNNING, ours to train
                    why = f"colocated training: {type(exc).__name__}: {exc}; train not called, trying again"[:500]
                if why is not None:
                    return await self._not_trained(ctx, row, why)
            return await self._train(ctx, row, health)
        return await self._settle(ctx, row)

    async def _not_trained(self, ctx: Context, row: Row, why: str) -> Result:
        """``train`` was not called: the job stays ``RUNNING``, ours to train, and is tried again."""
        log.warning("training job %s: %s", row.id[:12], why)
        self._recorded[row.id] = row.version
        if row["detail"] != why:
            # Said in the journal (the commit listener notes the new version as ours to train).
            await ctx.apply(Transition(KIND, row.id, "RUNNING", row.version, "RUNNING", why[:200], {"detail": why}))
        return Result(requeue_after=self.settings.retry_after_s)

    async def _release_engines(self, ctx: Context, row: Row) -> str | None:
        """Colocated training: pause every engine and release its memory before the step, each
        engine's row recording what it acknowledged (``None``: every engine released; else why not,
        and the step waits). Under the publisher's lock, so no gate look interleaves."""
        assert self.publisher is not None
        publisher = self.publisher
        async with ctx.journal.read() as conn:
            held = await deployment_held(conn)
        if held is not None:
            # No engine's memory is taken while the stack is rebuilt or down, nor before the gate
            # has looked at a relaunched engine (and given it a fresh adapter: the new process
            # holds every region resident, whatever the old adapter knew).
            return f"colocated training held: {held}; train not called"[:500]
        async with publisher.lock:
            try:
                await release_for_training(publisher.engines, self.colocated, publisher.settings.pause_mode)
                failed = None
            except Exception as exc:  # noqa: BLE001 - said in the job's row; an uncertain engine is replaced
                failed = f"{type(exc).__name__}: {exc}"
            regions = list(self.colocated.training_regions)
            for name, engine in zip(publisher.names, publisher.engines, strict=True):
                found = await ctx.get("engines", name)
                if found is None or found.state == "uncertain":
                    continue  # recorded so already (by the gate, or by an earlier attempt or leader)
                if engine.uncertain is not None:
                    # The gate records it uncertain and has it replaced (woken by this write).
                    await record_engine(ctx, found, engine, "uncertain", {
                        "health": None, "detail": f"memory state unknown since {engine.uncertain}; never used "
                                                  f"again until it is replaced"[:500]})
                elif all(engine.memory[r] is RegionState.RELEASED for r in regions):
                    await record_engine(ctx, found, engine, "paused", {
                        "health": "ok", "paused": True, "detail": held_for_training(row.id, engine)})
        if failed is not None:
            return (f"colocated training: releasing the engines' memory failed ({failed}); train not called, "
                    f"trying again")[:500]
        return None

    async def _sync_trainer(self, ctx: Context, row: Row) -> dict[str, Any]:
        """Put the trainer on the deployment's latest verified step before trusting what it holds.

        The one place (with the publisher's transfer and rejection) where a trainer that died is
        started again (``TrainerHost.ensure``): a fresh one holds its initial weights.

        - A trainer whose latest step is ``row``'s job, finished, is left alone: that is evidence
          for settling it.
        - When the deployment has a job with a verified checkpoint (``CHECKPOINT`` or later, not
          rejected) and the trainer's latest step is another one, or a step began and did not
          finish (``in_doubt``: the weights may hold part of it), that checkpoint is loaded: a
          trainer started again after a crash continues from it, bit for bit.
        - With no such job the trainer must hold its initial weights. A fresh one declares them,
          so a step record a dead trainer process left naming a job no longer reads as that
          job's step being held (it died with that process's memory). One that holds steps or
          part of a step no kept job accounts for (a job abandoned by an operator, a step that
          raised part-way) is stopped and started again, then declares them. An executor a
          caller handed in cannot be started again: its trainer is trusted as it is.

        Returns the trainer's health (step and latest job as they are after this).
        """
        await self._ensure_trainer()
        health: dict[str, Any] = await self._health()
        last, doubt = health.get("last_job_id"), health.get("in_doubt")
        if last == row.id and doubt is None:
            return health
        if health.get("writes_checkpoint") is False:
            head = await self._head_job(ctx, row)
            if head is not None:
                job, weights = head
                if last != job.id or doubt is not None:
                    step = int(job["trainer_step"] or 0) + 1
                    log.info("training job %s: the trainer (no checkpoints) holds %r; loading the head's weights "
                             "%s (job %s, step %d)", row.id[:12], last, weights, job.id[:12], step)
                    await self._call("load_weights", weights, job.id, step)
                    health = {**health, "step": step, "last_job_id": job.id, "in_doubt": None}
                return health
            latest = None
        else:
            latest = await self._latest_step(ctx, row)
        if latest is not None:
            if last != latest.id or doubt is not None:
                log.info("training job %s: the trainer's latest step is %r (in doubt: %r); loading job %s's "
                         "checkpoint first", row.id[:12], last, doubt, latest.id[:12])
                info = await self._call("load_checkpoint", latest["checkpoint_path"])
                health = {**health, "step": info["step"], "last_job_id": info["job_id"], "in_doubt": None}
            return health
        if last is not None or health.get("step") or doubt is not None:
            why = (f"it holds steps no kept job of the deployment accounts for (latest job {last!r}, step "
                   f"{health.get('step')}, in doubt {doubt!r})")
            if not await self._restart_trainer(why):
                return health
            health = await self._health()
        return await self._declare_initial(health)

    async def _declare_initial(self, health: dict[str, Any]) -> dict[str, Any]:
        """Have a trainer on its initial weights say so in its step record (unless it already does)."""
        record = health.get("step_record")
        if record is not None and record.get("job_id") != INITIAL:
            await self._call("declare_initial")
            health = await self._health()
        return health

    async def _fresh_trainer(self, why: str) -> bool:
        """Replace the trainer by a fresh one on its initial weights, which it declares (False: cannot)."""
        if not await self._restart_trainer(why):
            return False
        await self._declare_initial(await self._health())
        return True

    async def _ensure_trainer(self) -> bool:
        """Start a trainer if the host has none live (True when a fresh one was started).

        A restart the host's policy delays is waited out here, on the orchestrator's clock (a
        cancellable sleep): the step that needed the trainer goes on as it would have after an
        immediate restart, so a delay changes when the journal's next row is written, not which."""
        ensure = getattr(self._executor, "ensure", None)
        if ensure is None:
            return False
        while True:
            try:
                return bool(await asyncio.to_thread(ensure))
            except TrainerRestartPending as pending:
                log.warning("%s", pending)
                await self._clock.sleep(pending.delay_s)

    async def _restart_trainer(self, why: str) -> bool:
        """Stop the trainer and start a fresh one (False: the executor cannot be restarted)."""
        release = getattr(self._executor, "release", None)
        if release is None:
            return False
        log.warning("restarting the trainer: %s", why)
        await asyncio.to_thread(release, why)
        await self._ensure_trainer()
        return True

    async def _latest_step(self, ctx: Context, row: Row) -> Row | None:
        """The deployment's newest other job whose step is verified and kept (its checkpoint)."""
        t = models.training_jobs
        async with ctx.journal.read() as conn:
            found = (await conn.execute(
                sa.select(t).where(t.c.deployment == row["deployment"], t.c.id != row.id,
                                   t.c.state.in_(KEPT), t.c.checkpoint_path.is_not(None))
                .order_by(t.c.created_at.desc()).limit(1))).first()
        return None if found is None else to_row(KIND, found._mapping)

    async def _head_job(self, ctx: Context, row: Row) -> tuple[Row, str] | None:
        """For a trainer that writes no checkpoint: the job whose published weights are the
        deployment's committed head, and their directory (``None``: the head is the initial weights,
        or nothing is committed yet)."""
        v, t = models.weight_versions, models.training_jobs
        async with ctx.journal.read() as conn:
            head = (await conn.execute(sa.select(v.c.job_id, v.c.weights_path).where(
                v.c.deployment == row["deployment"], v.c.state == "committed")
                .order_by(v.c.sequence.desc()).limit(1))).first()
            if head is None or head.job_id is None or head.weights_path is None:
                return None
            job = (await conn.execute(sa.select(t).where(t.c.id == head.job_id))).first()
        return None if job is None else (to_row(KIND, job._mapping), str(head.weights_path))

    def _ambiguous(self, row: Row, why: str, extra: dict[str, Any] | None = None) -> Transition:
        return Transition(KIND, row.id, row.state, row.version, "AMBIGUOUS", why[:200],
                          {"ambiguity": why, **(extra or {})})

    async def _train(self, ctx: Context, row: Row, health: dict[str, Any]) -> Result:
        """Call train, save and verify the checkpoint, record CHECKPOINT (or what went wrong).

        Every outcome records ``trainer_step``, the trainer's step just before ``train`` was called:
        what an operator compares with the trainer's step record when the outcome is ambiguous.
        """
        before = {"trainer_step": health.get("step")}
        self._busy.add(row.id)
        try:
            try:
                metrics = await self._call("train", {**row["payload"], "job_id": row.id},
                                           timeout=self.settings.train_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the trainer's own exception, kept intact by the executor
                if _refused_before_any_step(exc):
                    await ctx.apply(Transition(KIND, row.id, "RUNNING", row.version, "FAILED",
                                               f"the trainer refused the job: {exc}"[:200],
                                               {"detail": str(exc), **before}))
                else:
                    await ctx.apply(self._ambiguous(row, f"train failed ({type(exc).__name__}: {exc}); the step "
                                                         f"may have run", before))
                return Result()
            if health.get("writes_checkpoint") is False:
                # Its live weights are the step's only copy until they are published (docs/training.md).
                await ctx.apply(Transition(KIND, row.id, "RUNNING", row.version, "CHECKPOINT",
                                           f"step {int(health.get('step') or 0) + 1} trained (the trainer writes no "
                                           f"checkpoint: its live weights are published)",
                                           {"checkpoint_path": None, "metrics": metrics, "detail": None, **before}))
                return Result()
            path = self.checkpoint_path(row.id)
            try:
                info = await self._save_and_verify(path, row.id)
            except Exception as exc:  # noqa: BLE001 - the step ran, but no durable evidence of it yet
                await ctx.apply(self._ambiguous(row, f"trained, but the checkpoint failed ({type(exc).__name__}: "
                                                     f"{exc})", before))
                return Result()
            await ctx.apply(Transition(KIND, row.id, "RUNNING", row.version, "CHECKPOINT",
                                       f"step {info['step']} trained and its checkpoint verified",
                                       {"checkpoint_path": path, "metrics": metrics, "detail": None, **before}))
        finally:
            self._busy.discard(row.id)
        return Result()

    async def _save_and_verify(self, path: str, job_id: str) -> dict[str, Any]:
        await self._call("save_checkpoint", path, job_id)
        info: dict[str, Any] = await self._call("verify_checkpoint", path)
        if info.get("job_id") != job_id:
            raise ValueError(f"checkpoint {path} carries job {info.get('job_id')!r}, not {job_id!r}")
        return info

    async def verify_checkpoint_of(self, job_id: str, path: str) -> dict[str, Any]:
        """Have the trainer verify the checkpoint at ``path`` and check it carries ``job_id`` (the
        operator's ``resolve ran``); its info. A checkpoint that does not verify or carries another
        job raises a :class:`ValueError` (the trainer's ``CheckpointError`` is one); an unreachable
        trainer raises the executor's error."""
        info: dict[str, Any] = await self._call("verify_checkpoint", path)
        if info.get("job_id") != job_id:
            raise ValueError(f"checkpoint {path} carries job {info.get('job_id')!r}, not {job_id!r}")
        return info

    async def _settle(self, ctx: Context, row: Row) -> Result:
        """An AMBIGUOUS job: settle it from durable evidence, or say what is known."""
        path = self.checkpoint_path(row.id)
        self._busy.add(row.id)
        try:
            synced: dict[str, Any] = {}
            try:
                synced = await self._sync_trainer(ctx, row)
            except Exception as exc:  # noqa: BLE001 - an unreachable trainer proves nothing
                log.warning("training job %s: could not bring the trainer onto the latest step (%s)", row.id, exc)
            info: dict[str, Any] | None = None
            if synced.get("writes_checkpoint") is not False:  # a trainer without checkpoints is never asked
                try:
                    info = await self._call("verify_checkpoint", path)
                except Exception:  # noqa: BLE001 - no checkpoint there (or a damaged one): not evidence
                    info = None
            if info is not None and info.get("job_id") == row.id:
                await ctx.apply(Transition(KIND, row.id, "AMBIGUOUS", row.version, "CHECKPOINT",
                                           f"settled: checkpoint {path} verifies and carries the job",
                                           {"checkpoint_path": path, "ambiguity": None, "detail": None,
                                            "metrics": _settled(info, "verified checkpoint")}))
                return Result()
            try:
                health: dict[str, Any] = await self._health()
            except Exception as exc:  # noqa: BLE001 - an unreachable trainer proves nothing
                log.warning("training job %s: the trainer did not answer (%s); looking again later", row.id, exc)
                return await self._still_ambiguous(ctx, row, f"the trainer's health did not answer "
                                                             f"({type(exc).__name__}: {exc}); looking again later")
            if (health.get("last_job_id") == row.id and health.get("in_doubt") is None
                    and health.get("writes_checkpoint") is False):
                await ctx.apply(Transition(KIND, row.id, "AMBIGUOUS", row.version, "CHECKPOINT",
                                           f"settled: the live trainer's latest step {health.get('step')} is this job "
                                           f"(it writes no checkpoint)",
                                           {"checkpoint_path": None, "ambiguity": None, "detail": None,
                                            # The step before it, as _train records: load_weights resumes after it.
                                            "trainer_step": int(health.get("step") or 1) - 1,
                                            "metrics": {"settled_from": "live trainer", "step": health.get("step")}}))
                return Result()
            if health.get("last_job_id") == row.id and health.get("in_doubt") is None:
                # The live trainer's latest step is this job: make the evidence durable now.
                try:
                    info = await self._save_and_verify(path, row.id)
                except Exception as exc:  # noqa: BLE001 - still the live trainer's step; said, and tried again
                    return await self._still_ambiguous(ctx, row, f"the live trainer's latest step is this job, but "
                                                                 f"its checkpoint failed ({type(exc).__name__}: "
                                                                 f"{exc}); trying again")
                await ctx.apply(Transition(KIND, row.id, "AMBIGUOUS", row.version, "CHECKPOINT",
                                           f"settled: the trainer's latest step {info['step']} is this job; "
                                           f"checkpoint saved and verified",
                                           {"checkpoint_path": path, "ambiguity": None, "detail": None,
                                            "metrics": _settled(info, "live trainer")}))
                return Result()
            record = health.get("step_record")
            # No record proves nothing from a trainer that took steps without keeping one (no state_dir):
            # only a trainer that never stepped, or whose durable record names another job, is evidence.
            kept = record is not None or not health.get("step")
            if kept and (record is None or record.get("job_id") != row.id):
                seen = "no step record" if record is None else f"its step record names job {record.get('job_id')}"
                await ctx.apply(Transition(KIND, row.id, "AMBIGUOUS", row.version, "RUNNING",
                                           f"settled: the trainer ({seen}, step {health.get('step')}) never "
                                           f"started this job's step; training it", {"ambiguity": None}))
                return Result()
            if record is None:
                why = (f"the trainer keeps no step record (it is at step {health.get('step')} without one), no "
                       f"checkpoint at {path} carries this job and the live trainer's latest job is "
                       f"{health.get('last_job_id')!r}: an operator must decide")
            else:
                why = (f"the trainer's step record names this job ({record.get('phase')}, step {record.get('step')}) "
                       f"but no checkpoint at {path} carries it and the live trainer's latest job is "
                       f"{health.get('last_job_id')!r}: an operator must decide")
            return await self._still_ambiguous(ctx, row, why)
        finally:
            self._busy.discard(row.id)

    async def _still_ambiguous(self, ctx: Context, row: Row, why: str) -> Result:
        """Say in the journal what is known (only when it changed), and look again later."""
        if row["ambiguity"] != why:
            await ctx.apply(Transition(KIND, row.id, "AMBIGUOUS", row.version, "AMBIGUOUS",
                                       "still ambiguous: " + why[:180], {"ambiguity": why}))
        return Result(requeue_after=self.settings.retry_after_s)


def _settled(info: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A settled job's metrics: the step's training metrics its checkpoint kept (the trainer contract's
    ``verify_checkpoint`` reply, when it has them), with where the settlement came from."""
    kept = info.get("metrics")
    return {**(kept if isinstance(kept, Mapping) else {}), "settled_from": source, "step": info["step"]}


JOB_ERROR = "workers.trainer.errors.JobError"


def _refused_before_any_step(exc: BaseException) -> bool:
    """The trainer validated the job and refused it before any step: a ``workers.trainer.errors.JobError``,
    or a subclass of it (the contract of docs/training.md, for any trainer class)."""
    # By name: importing workers.trainer would import torch into the orchestrator. A served trainer's
    # exception (the http executor) names its remote classes instead.
    local = (f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__)
    return JOB_ERROR in (*local, *getattr(exc, "remote_mro", ()))


__all__ = ["GROUP_CALLS", "KIND", "TrainerRanks", "TrainingController", "TrainingSettings"]
