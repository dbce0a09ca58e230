"""Commit-gated publication of a trained job's weights to every inference engine of a deployment.

The training controller hands a job to :class:`Publisher` from ``CHECKPOINT`` on. Each step
is a durable transition; every engine call is safe to repeat (pausing a paused engine, loading
the same version again), so a step interrupted by a crash is simply done again.

1. ``CHECKPOINT``: record the pause intent (``pause_intent_at``, a self-transition before the first
   pause call: from then on the engine gate pauses every engine it looks at, a replacement too),
   then pause every engine (a pause that fails is said in ``detail`` by a self-transition
   and the step is tried again after ``retry_after_s``: nothing is allocated until every engine
   paused); then, in one transaction, allocate the target runtime
   load id (the next sequence of the committed head's incarnation that no version of the
   deployment has used yet, so a rejected candidate's id is never given to other weights; a
   deployment's first publication registers the weights the engines started with as
   ``<new incarnation>:0``, committed), create its ``weight_versions`` row (``target``) and move
   the job to ``UPDATING_WEIGHTS`` with it. The target is durable before any byte of weights is
   sent, so every retry uses the same id.
2. ``UPDATING_WEIGHTS``: have the trainer write the job's weights as the target version (it
   loads the job's checkpoint first if its latest step is not this job), load them on every
   engine from disk (after resuming its weights, should a colocated step have released them), and
   check that every engine reports the target; then resume the KV cache and CUDA graphs. Then, in one
   transaction, ``READY_TO_COMMIT`` with ``runtime_load_id`` and the version ``loaded`` with the
   engines that confirmed it. The engines stay paused. A failure records why, counts the
   attempt, and the step is tried again later in full (engines paused again, weights written
   and loaded again).
3. ``READY_TO_COMMIT``: the commit gate (:mod:`engine.workflows.training.commit_gate`) gives its
   verdict, or says how long to wait for one (engines still paused). ``commit``: the head commit —
   the version ``committed`` and the job ``HEAD_COMMITTED`` with ``commit_acknowledged`` and the
   verdict — in one transaction; ``reject``: ``REJECTING`` with the verdict (step 5).
4. ``HEAD_COMMITTED``: every engine must report the committed version (one that does not, such
   as an engine restarted meanwhile, is paused and loads it from disk again); only then, with
   every memory region resident again, does generation continue on every engine; ``COMPLETE``.
5. ``REJECTING`` (an operator's ``reject``): put the committed head back on every engine that
   serves another version and check it, put the trainer back on the head's checkpoint if it
   holds the rejected step, continue generation, and ``REJECTED``, the target ``rejected``.
   Engines never serve an uncommitted version with generation running.

A step that fails in ``HEAD_COMMITTED`` or ``REJECTING`` is recorded in ``detail`` by a
self-transition (only when the reason changed) and tried again after ``retry_after_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from journal import Create, Transition, WriteTx, models
from journal.readiness import deployment_held
from journal.writes import Row, to_row
from workers.inference.engine import InferenceEngine

from engine.runtime.reconciler import Context, Result
from engine.workflows.training.commit_gate import (CommitGate, CommitGateSettings, Wait, candidate_info,
                                                   incumbent_info)
from engine.workflows.training.colocated import KV_AND_GRAPHS
from engine.workflows.training.engine_gate import engine_transition, held_uncommitted
from engine.workflows.training.identity import LoadId

log = logging.getLogger("tidelog.publication")

KIND = "training_jobs"
VERSIONS = "weight_versions"
TrainerCall = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class PublicationSettings:
    deployment: str
    #: Weights are written to ``<weights_dir>/<load id>/`` (a weights directory, workers/policy.py).
    weights_dir: str
    pause_mode: str = "retract"
    #: How soon a failed transfer is tried again.
    retry_after_s: float = 2.0
    #: The weights directory the engines started with: recorded as the first committed version's
    #: ``weights_path``, so an engine can be put back on it (None: it cannot be).
    initial_weights: str | None = None
    #: Who decides that a READY_TO_COMMIT candidate becomes the head (``training.commit``).
    gate: CommitGateSettings = CommitGateSettings()
    #: Colocated training: the steps that give memory back also record the engines rows they leave.
    colocated: bool = False


class Publisher:
    """Moves a job from ``CHECKPOINT`` to ``COMPLETE`` (or ``REJECTED``); see the module docs."""

    STATES = ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "REJECTING")

    def __init__(self, trainer: TrainerCall, engines: Sequence[InferenceEngine] | Mapping[str, InferenceEngine],
                 settings: PublicationSettings, *, ensure_trainer: Callable[[], Awaitable[Any]] | None = None,
                 fresh_trainer: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self._trainer = trainer
        # Starts a trainer if the one there died: only at the start of a step that then asks the
        # trainer what it holds before acting on it (a fresh trainer holds its initial weights).
        self._ensure_trainer = ensure_trainer
        # Replaces the trainer with a fresh one on its initial weights (False: it cannot be replaced).
        self._fresh_trainer = fresh_trainer
        # By engine id, recorded in ``confirmed_by`` (a plain sequence: their positions). A mapping is
        # kept as given, not copied: the engine gate replaces an uncertain engine's adapter in it.
        self._engines: Mapping[str, InferenceEngine] = (
            engines if isinstance(engines, Mapping) else {str(i): e for i, e in enumerate(engines)})
        self.settings = settings
        self.gate = CommitGate(settings.gate)
        #: Held by every publication step and by the engine gate (engine/workflows/training/engine_gate.py).
        self.lock = asyncio.Lock()

    @property
    def names(self) -> list[str]:
        """The engine ids, in engine order."""
        return list(self._engines)

    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines' current adapters, in engine order."""
        return list(self._engines.values())

    def weights_path(self, load_id: str) -> str:
        return str(Path(self.settings.weights_dir) / load_id.replace(":", "-"))

    async def step(self, ctx: Context, row: Row) -> Result:
        if row.state == "CHECKPOINT":
            async with ctx.journal.read() as conn:
                held = await deployment_held(conn, engines=False)
            if held is not None:
                # No engine is paused for a publication while the stack is rebuilt or down.
                return await self._again(ctx, row, f"publication held: {held}")
            return await self._start(ctx, row)
        if row.state == "UPDATING_WEIGHTS":
            if row["detail"] is not None:
                # The last attempt failed (its commit woke us at once): wait out the retry delay.
                wait = self.settings.retry_after_s - (ctx.clock.now() - row["updated_at"]).total_seconds()
                if wait > 0:
                    return Result(requeue_after=wait)
            return await self._transfer(ctx, row)
        if row.state == "READY_TO_COMMIT":
            return await self._commit(ctx, row)
        if row.state == "HEAD_COMMITTED":
            return await self._retrying(ctx, row, self._resume(ctx, row))
        if row.state == "REJECTING":
            return await self._retrying(ctx, row, self._reject(ctx, row))
        return Result()

    async def _retrying(self, ctx: Context, row: Row, work: Awaitable[Result]) -> Result:
        """Run a step whose engine or trainer calls may fail: a failure is recorded in ``detail``
        (a self-transition, written only when the reason changed) and tried again later."""
        try:
            return await work
        except Exception as exc:  # noqa: BLE001 - recorded in the journal, and tried again
            return await self._again(ctx, row, f"{row.state} step failed ({type(exc).__name__}: {exc}); trying again")

    async def _again(self, ctx: Context, row: Row, why: str) -> Result:
        """A step that could not be taken now: ``why`` goes to ``detail`` (a self-transition, written
        only when the words changed) and the job is looked at again after ``retry_after_s``."""
        log.warning("job %s: %s", row.id[:12], why)
        if row["detail"] != why:
            await ctx.apply(Transition(KIND, row.id, row.state, row.version, row.state, why[:200], {"detail": why}))
        return Result(requeue_after=self.settings.retry_after_s)

    async def _each(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> list[Any]:
        """``call`` on every engine at once; the results in engine order, or the first engine's failure.

        Every call is let finish before a failure is raised: each is safe to repeat, and the step's
        retry repeats all of them, so no engine is left with a call of this attempt still running.
        """
        results = await asyncio.gather(*(call(engine) for engine in self.engines), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def _engine_rows(self, ctx: Context, state: str, changes: dict[str, Any]) -> list[Transition]:
        """Colocated training: each engine's row as this step leaves the engine, with its memory as
        acknowledged, written in the step's own transaction (the gate owns the rows, and would
        otherwise show the memory a step released until its next look; it then finds them as it
        would write them, and writes nothing). A row the gate has not looked at since an election
        or a relaunch is left to it; nothing is written without colocated training."""
        ops: list[Transition] = []
        if not self.settings.colocated:
            return ops
        for name, engine in zip(self.names, self.engines, strict=True):
            found = await ctx.get("engines", name)
            if found is not None and found.state not in ("uncertain", "retired", "registered", "unverified"):
                move = engine_transition(found, engine, state, changes)
                if move is not None:
                    ops.append(move)
        return ops

    async def head(self, ctx: Context) -> Row | None:
        """The deployment's committed version with the highest sequence."""
        async with ctx.journal.read() as conn:
            found = (await conn.execute(self._head_stmt())).first()
        return None if found is None else to_row(VERSIONS, found._mapping)

    def _head_stmt(self) -> sa.Select[Any]:
        t = models.weight_versions
        return (sa.select(t).where(t.c.deployment == self.settings.deployment, t.c.state == "committed")
                .order_by(t.c.sequence.desc()).limit(1))

    async def _start(self, ctx: Context, row: Row) -> Result:
        if row["detail"] is not None:
            # The last pause failed, or the trainer lost a live step (its commit woke us at once): wait
            # out the retry delay. (Every other move into CHECKPOINT clears detail.)
            wait = self.settings.retry_after_s - (ctx.clock.now() - row["updated_at"]).total_seconds()
            if wait > 0:
                return Result(requeue_after=wait)
        if row["checkpoint_path"] is None:
            # A trainer that writes no checkpoint: its live step is the only copy. One that lost it is
            # found before any engine is paused, and the job is rejected (nothing can publish it).
            try:
                if self._ensure_trainer is not None:
                    await self._ensure_trainer()
                health = await self._trainer("health")
            except Exception as exc:  # noqa: BLE001 - an unreachable trainer decides nothing; tried again
                return await self._again(ctx, row, f"the trainer did not answer ({type(exc).__name__}: {exc}); "
                                                   f"trying again")
            if health.get("last_job_id") != row.id or health.get("in_doubt") is not None:
                return await self._lost(ctx, row)
        if row["pause_intent_at"] is None:
            # Pause intent is durable before the first pause call: after a crash or a partial pause
            # failure, the engine gate pauses every engine it looks at (a replacement too) until
            # this step succeeds, so no engine generates across the barrier while it is retried.
            await ctx.apply(Transition(KIND, row.id, "CHECKPOINT", row.version, "CHECKPOINT",
                                       "pause intent recorded: pausing every engine",
                                       {"pause_intent_at": ctx.clock.now()}))
            again = await ctx.get(KIND, row.id)
            if again is None or again.state != "CHECKPOINT":
                return Result()
            row = again
        try:
            await self._each(lambda e: e.pause_generation(self.settings.pause_mode))
        except Exception as exc:  # noqa: BLE001 - the job stays CHECKPOINT, nothing allocated; tried again
            return await self._again(ctx, row, f"pausing the engines failed ({type(exc).__name__}: {exc}); "
                                               f"trying again")
        initial: LoadId | None = None
        target = ""

        async def write(tx: WriteTx) -> None:
            nonlocal initial, target
            found = (await tx.execute(self._head_stmt())).first()
            initial = None
            if found is None:
                # The first publication: the weights the engines started with become the committed head.
                initial = LoadId.first()
                base = initial
            else:
                base = LoadId.parse(found.id)
            # The next sequence of the incarnation that no version used: a rejected candidate keeps its id.
            t = models.weight_versions
            top = (await tx.execute(sa.select(sa.func.max(t.c.sequence)).where(
                t.c.deployment == self.settings.deployment, t.c.incarnation == base.incarnation))).scalar()
            nxt = LoadId(base.incarnation, max(base.sequence, int(top) if top is not None else 0) + 1)
            target = str(nxt)
            if initial is not None:
                await tx.apply([Create(VERSIONS, str(initial), "the weights the engines started with", {
                    "deployment": self.settings.deployment, "incarnation": initial.incarnation,
                    "sequence": initial.sequence, "weights_path": self.settings.initial_weights}, "committed")])
            await tx.apply([
                Create(VERSIONS, target, f"target of job {row.id[:12]}", {
                    "deployment": self.settings.deployment, "incarnation": nxt.incarnation,
                    "sequence": nxt.sequence, "job_id": row.id, "weights_path": self.weights_path(target)},
                    "target"),
                Transition(KIND, row.id, "CHECKPOINT", row.version, "UPDATING_WEIGHTS",
                           f"engines paused; publishing as {target}"[:200],
                           {"target_load_id": target, "publish_attempts": 1, "detail": None})])
        await ctx.write(write)
        if initial is not None:
            # Name what the engines serve by the id it was just registered under (only a label).
            label = str(initial)
            await self._each(lambda e: e.set_weight_version(label))
        after = await ctx.get(KIND, row.id)
        return await self._transfer(ctx, after, first=True) if after is not None else Result()

    async def _lost(self, ctx: Context, row: Row) -> Result:
        """A trainer that writes no checkpoint no longer holds the job's step (its process was
        replaced): nothing can publish it, so it is rejected at once, which serves the head again and
        puts the trainer back on it (an operator could decide nothing else)."""
        why = lost_step(row.id)
        log.warning("job %s: %s", row.id[:12], why)
        verdict = {"decision": "reject", "by": "orchestrator", "reason": why, "metrics": {},
                   "at": ctx.clock.now().isoformat()}
        await ctx.apply(Transition(KIND, row.id, row.state, row.version, "REJECTING", why[:200],
                                   {"detail": why, "verdict": verdict}))
        return Result()

    async def _transfer(self, ctx: Context, row: Row, *, first: bool = False) -> Result:
        target: str = row["target_load_id"]
        path = self.weights_path(target)
        try:
            if not first:
                # A retry: whatever happened to the engines, pause them again and send everything.
                await self._each(lambda e: e.pause_generation(self.settings.pause_mode))
            if self._ensure_trainer is not None:
                await self._ensure_trainer()
            health = await self._trainer("health")
            if health.get("last_job_id") != row.id or health.get("in_doubt") is not None:
                if row["checkpoint_path"] is None:
                    return await self._lost(ctx, row)
                await self._trainer("load_checkpoint", row["checkpoint_path"])
            await self._trainer("prepare_weights", {"version": target, "directory": path})
            # Colocated training released the engines' memory: the weights come back before the new
            # ones are loaded, the KV cache and graphs once every engine serves the target (each a
            # no-op, sending nothing, for regions already resident).
            await self._each(lambda e: e.resume_memory(("weights",)))
            await self._each(lambda e: e.update_weights_from_disk(path, target))
            served = await self._each(lambda e: e.weight_version())
            wrong = {i: v for i, v in enumerate(served) if v != target}
            if wrong:
                raise RuntimeError(f"engines {sorted(wrong)} serve {sorted(set(map(str, wrong.values())))}, "
                                   f"not {target}")
            await self._each(lambda e: e.resume_memory(KV_AND_GRAPHS))
        except Exception as exc:  # noqa: BLE001 - recorded, and the whole transfer is tried again
            why = f"transfer of {target} failed ({type(exc).__name__}: {exc}); trying again in full"
            log.warning("job %s: %s", row.id[:12], why)
            await ctx.apply(Transition(KIND, row.id, "UPDATING_WEIGHTS", row.version, "UPDATING_WEIGHTS", why[:200],
                                       {"detail": why, "publish_attempts": int(row["publish_attempts"]) + 1}))
            return Result(requeue_after=self.settings.retry_after_s)
        version = await ctx.get(VERSIONS, target)
        ops: list[Transition] = [Transition(KIND, row.id, "UPDATING_WEIGHTS", row.version, "READY_TO_COMMIT",
                                            f"every engine serves {target}; still paused",
                                            {"runtime_load_id": target, "detail": None,
                                             "ready_at": ctx.clock.now(), "verdict": None})]
        if version is not None and version.state == "target":
            ops.append(Transition(VERSIONS, target, "target", version.version, "loaded",
                                  f"loaded by {len(self.engines)} engines",
                                  {"confirmed_by": list(self.names)}))
        ops += await self._engine_rows(ctx, "paused", {"health": "ok", "paused": True, "serving_version": target,
                                                       "detail": held_uncommitted(row.id, "READY_TO_COMMIT")})
        await ctx.apply(*ops)
        return Result()

    async def _commit(self, ctx: Context, row: Row) -> Result:
        target: str = row["runtime_load_id"]

        async def describe() -> tuple[dict[str, Any], dict[str, Any] | None]:
            head = await self.head(ctx)
            job = await ctx.get(KIND, head["job_id"]) if head is not None and head["job_id"] else None
            return candidate_info(row, self.weights_path(target)), incumbent_info(head, job)
        verdict = await self.gate.decide(ctx, row, describe)
        if isinstance(verdict, Wait):
            if verdict.say is not None and row["detail"] != verdict.say:
                await ctx.apply(Transition(KIND, row.id, "READY_TO_COMMIT", row.version, "READY_TO_COMMIT",
                                           verdict.say[:200], {"detail": verdict.say}))
            return Result(requeue_after=verdict.after)
        if verdict["decision"] == "reject":
            why = f"rejected by {verdict['by']}: {verdict['reason']}"
            await ctx.apply(Transition(KIND, row.id, "READY_TO_COMMIT", row.version, "REJECTING", why[:200],
                                       {"verdict": verdict, "detail": why}))
            return Result()
        version = await ctx.get(VERSIONS, target)
        ops = [Transition(KIND, row.id, "READY_TO_COMMIT", row.version, "HEAD_COMMITTED",
                          f"head committed at {target} ({verdict['by']})",
                          {"commit_acknowledged": True, "verdict": verdict, "detail": None})]
        if version is not None and version.state == "loaded":
            ops.append(Transition(VERSIONS, target, "loaded", version.version, "committed", f"head of job {row.id[:12]}"))
        await ctx.apply(*ops)  # one transaction: the head commit is the job's
        return Result()

    async def _serve(self, version: str, weights_path: str | None) -> None:
        """Make every engine report ``version``: one that does not is paused and loads it from disk.

        Raises when an engine cannot be brought to it; generation is not continued here.
        """
        served = await self._each(lambda e: e.weight_version())
        stale = [e for e, v in zip(self.engines, served) if v != version]
        if not stale:
            return
        if weights_path is None:
            raise RuntimeError(f"cannot restore {version} on engines serving {sorted(set(map(str, served)))}: its "
                               f"weights are the ones the engines started with and are not on disk; an operator "
                               f"must restart them")
        for engine in stale:
            await engine.pause_generation(self.settings.pause_mode)
            await engine.resume_memory(("weights",))
            await engine.update_weights_from_disk(weights_path, version)
        served = await self._each(lambda e: e.weight_version())
        wrong = sorted({str(v) for v in served if v != version})
        if wrong:
            raise RuntimeError(f"engines serve {wrong} after loading {version}")

    async def _resume(self, ctx: Context, row: Row) -> Result:
        """HEAD_COMMITTED: generation continues only once every engine serves the committed version."""
        target: str = row["runtime_load_id"]
        version = await ctx.get(VERSIONS, target)
        await self._serve(target, None if version is None else version["weights_path"])
        await self._each(lambda e: e.resume_memory())
        await self._each(lambda e: e.continue_generation())
        await ctx.apply(Transition(KIND, row.id, "HEAD_COMMITTED", row.version, "COMPLETE",
                                   f"serving {target}", {"commit_acknowledged": True, "detail": None}),
                        *await self._engine_rows(ctx, "serving", {"health": "ok", "paused": False,
                                                                  "serving_version": target, "detail": None}))
        return Result()

    async def _reject(self, ctx: Context, row: Row) -> Result:
        head = await self.head(ctx)
        if head is not None:
            await self._serve(head.id, head["weights_path"])
        # Every engine serves the committed head (or nothing was ever published): safe to generate,
        # once a colocated step's released memory is back.
        await self._each(lambda e: e.resume_memory())
        await self._each(lambda e: e.continue_generation())
        # The trainer must not carry the rejected step into the next job: back to the head's checkpoint.
        if self._ensure_trainer is not None:
            await self._ensure_trainer()
        health = await self._trainer("health")
        if health.get("last_job_id") == row.id:
            restore = None if head is None or head["job_id"] is None else await ctx.get(KIND, head["job_id"])
            if restore is None and self._fresh_trainer is not None and (head is None or head["job_id"] is None):
                # The head is the deployment's initial weights: a fresh trainer holds exactly those.
                if not await self._fresh_trainer(f"it holds rejected job {row.id[:12]}'s step and the head is the "
                                                 f"initial weights"):
                    raise RuntimeError("the trainer holds the rejected step and cannot be started again on its "
                                       "initial weights; an operator must restart it")
            elif restore is not None and restore["checkpoint_path"] is None and head is not None \
                    and head["weights_path"] is not None and health.get("writes_checkpoint") is False:
                # A trainer that writes no checkpoint: the head's published weights are its step.
                await self._trainer("load_weights", head["weights_path"], restore.id,
                                    int(restore["trainer_step"] or 0) + 1)
            elif restore is None or restore["checkpoint_path"] is None:
                raise RuntimeError(f"the trainer holds the rejected step and the head "
                                   f"{head.id if head else '(none)'} has no checkpoint to put back; an operator "
                                   f"must restart the trainer on the head's weights")
            else:
                await self._trainer("load_checkpoint", restore["checkpoint_path"])
        ops = [Transition(KIND, row.id, "REJECTING", row.version, "REJECTED",
                          f"incumbent {head.id if head else '(none)'} serving again", {"detail": None})]
        if head is not None:
            ops += await self._engine_rows(ctx, "serving", {"health": "ok", "paused": False,
                                                            "serving_version": head.id, "detail": None})
        target = row["target_load_id"]
        version = await ctx.get(VERSIONS, target) if target else None
        if version is not None and version.state in ("target", "loaded"):
            ops.append(Transition(VERSIONS, version.id, version.state, version.version, "rejected",
                                  f"job {row.id[:12]} rejected"))
        await ctx.apply(*ops)
        return Result()


def lost_step(job_id: str) -> str:
    """Why a job of a trainer that writes no checkpoint cannot be published any more."""
    return (f"the trainer no longer holds job {job_id[:12]}'s step (it writes no checkpoint, and its process "
            f"was replaced): nothing can publish it, so it is rejected")


__all__ = ["PublicationSettings", "Publisher", "lost_step"]
