"""Commit-gated publication of a trained job's weights to every inference engine of a deployment.

The training controller hands a job to :class:`Publisher` from ``CHECKPOINT`` on. Each step
is a durable transition; every engine call is safe to repeat (pausing a paused engine, loading
the same version again), so a step interrupted by a crash is simply done again.

1. ``CHECKPOINT``: pause every engine; then, in one transaction, allocate the target runtime
   load id (the committed head's next; a deployment's first publication registers the weights
   the engines started with as ``<new incarnation>:0``, committed), create its
   ``weight_versions`` row (``target``) and move the job to ``UPDATING_WEIGHTS`` with it. The
   target is durable before any byte of weights is sent, so every retry uses the same id.
2. ``UPDATING_WEIGHTS``: have the trainer write the job's weights as the target version (it
   loads the job's checkpoint first if its latest step is not this job), load them on every
   engine from disk, and check that every engine reports the target. Then, in one
   transaction, ``READY_TO_COMMIT`` with ``runtime_load_id`` and the version ``loaded`` with the
   engines that confirmed it. The engines stay paused. A failure records why, counts the
   attempt, and the step is tried again later in full (engines paused again, weights written
   and loaded again).
3. ``READY_TO_COMMIT``: the head commit — the version ``committed`` and the job
   ``HEAD_COMMITTED`` with ``commit_acknowledged`` — in one transaction.
4. ``HEAD_COMMITTED``: continue generation on every engine; ``COMPLETE``.
5. ``REJECTING`` (an operator's ``reject``): put the committed head back on every engine that
   serves another version, continue generation, and ``REJECTED``, the target ``rejected``.
   Engines never serve an uncommitted version with generation running.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from journal import Create, Transition, WriteTx, models
from journal.writes import Row, to_row
from workers.inference.engine import InferenceEngine

from ..reconciler import Context, Result
from ..training.identity import LoadId

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


class Publisher:
    """Moves a job from ``CHECKPOINT`` to ``COMPLETE`` (or ``REJECTED``); see the module docs."""

    STATES = ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "REJECTING")

    def __init__(self, trainer: TrainerCall, engines: Sequence[InferenceEngine],
                 settings: PublicationSettings) -> None:
        self._trainer = trainer
        self.engines = list(engines)
        self.settings = settings

    def weights_path(self, load_id: str) -> str:
        return str(Path(self.settings.weights_dir) / load_id.replace(":", "-"))

    async def step(self, ctx: Context, row: Row) -> Result:
        if row.state == "CHECKPOINT":
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
            await self._each(lambda e: e.continue_generation())
            await ctx.apply(Transition(KIND, row.id, "HEAD_COMMITTED", row.version, "COMPLETE",
                                       f"serving {row['runtime_load_id']}", {"commit_acknowledged": True}))
            return Result()
        if row.state == "REJECTING":
            return await self._reject(ctx, row)
        return Result()

    async def _each(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> list[Any]:
        """``call`` on every engine, in order; the first failure is raised."""
        return [await call(engine) for engine in self.engines]

    async def head(self, ctx: Context) -> Row | None:
        """The deployment's committed version with the highest sequence."""
        t = models.weight_versions
        async with ctx.journal.read() as conn:
            found = (await conn.execute(sa.select(t).where(t.c.deployment == self.settings.deployment,
                                                           t.c.state == "committed")
                                        .order_by(t.c.sequence.desc()).limit(1))).first()
        return None if found is None else to_row(VERSIONS, found._mapping)

    async def _start(self, ctx: Context, row: Row) -> Result:
        await self._each(lambda e: e.pause_generation(self.settings.pause_mode))
        head = await self.head(ctx)
        initial = None
        if head is None:
            # The first publication: the weights the engines started with become the committed head.
            initial = LoadId.first()
            base = initial
        else:
            base = LoadId.parse(head.id)
        target = str(base.next())

        async def write(tx: WriteTx) -> None:
            if initial is not None:
                await tx.apply([Create(VERSIONS, str(initial), "the weights the engines started with", {
                    "deployment": self.settings.deployment, "incarnation": initial.incarnation,
                    "sequence": initial.sequence}, "committed")])
            await tx.apply([
                Create(VERSIONS, target, f"target of job {row.id[:12]}", {
                    "deployment": self.settings.deployment, "incarnation": base.incarnation,
                    "sequence": base.sequence + 1, "job_id": row.id, "weights_path": self.weights_path(target)},
                    "target"),
                Transition(KIND, row.id, "CHECKPOINT", row.version, "UPDATING_WEIGHTS",
                           f"engines paused; publishing as {target}", {"target_load_id": target,
                                                                        "publish_attempts": 1})])
        await ctx.write(write)
        if initial is not None:
            # Name what the engines serve by the id it was just registered under (only a label).
            await self._each(lambda e: e.set_weight_version(str(initial)))
        after = await ctx.get(KIND, row.id)
        return await self._transfer(ctx, after, first=True) if after is not None else Result()

    async def _transfer(self, ctx: Context, row: Row, *, first: bool = False) -> Result:
        target: str = row["target_load_id"]
        path = self.weights_path(target)
        try:
            if not first:
                # A retry: whatever happened to the engines, pause them again and send everything.
                await self._each(lambda e: e.pause_generation(self.settings.pause_mode))
            health = await self._trainer("health")
            if health.get("last_job_id") != row.id:
                await self._trainer("load_checkpoint", row["checkpoint_path"])
            await self._trainer("prepare_weights", {"version": target, "directory": path})
            await self._each(lambda e: e.update_weights_from_disk(path, target))
            served = await self._each(lambda e: e.weight_version())
            wrong = {i: v for i, v in enumerate(served) if v != target}
            if wrong:
                raise RuntimeError(f"engines {sorted(wrong)} serve {sorted(set(map(str, wrong.values())))}, "
                                   f"not {target}")
        except Exception as exc:  # noqa: BLE001 - recorded, and the whole transfer is tried again
            why = f"transfer of {target} failed ({type(exc).__name__}: {exc}); trying again in full"
            log.warning("job %s: %s", row.id[:12], why)
            await ctx.apply(Transition(KIND, row.id, "UPDATING_WEIGHTS", row.version, "UPDATING_WEIGHTS", why[:200],
                                       {"detail": why, "publish_attempts": int(row["publish_attempts"]) + 1}))
            return Result(requeue_after=self.settings.retry_after_s)
        version = await ctx.get(VERSIONS, target)
        ops: list[Transition] = [Transition(KIND, row.id, "UPDATING_WEIGHTS", row.version, "READY_TO_COMMIT",
                                            f"every engine serves {target}; still paused",
                                            {"runtime_load_id": target, "detail": None})]
        if version is not None and version.state == "target":
            ops.append(Transition(VERSIONS, target, "target", version.version, "loaded",
                                  f"loaded by {len(self.engines)} engines",
                                  {"confirmed_by": [str(i) for i in range(len(self.engines))]}))
        await ctx.apply(*ops)
        return Result()

    async def _commit(self, ctx: Context, row: Row) -> Result:
        target: str = row["runtime_load_id"]
        version = await ctx.get(VERSIONS, target)
        ops = [Transition(KIND, row.id, "READY_TO_COMMIT", row.version, "HEAD_COMMITTED",
                          f"head committed at {target}", {"commit_acknowledged": True})]
        if version is not None and version.state == "loaded":
            ops.append(Transition(VERSIONS, target, "loaded", version.version, "committed", f"head of job {row.id[:12]}"))
        await ctx.apply(*ops)  # one transaction: the head commit is the job's
        return Result()

    async def _reject(self, ctx: Context, row: Row) -> Result:
        head = await self.head(ctx)
        served = await self._each(lambda e: e.weight_version())
        if head is not None and any(v != head.id for v in served):
            if head["weights_path"] is None:
                why = (f"cannot restore {head.id} on engines serving {sorted(set(map(str, served)))}: its weights "
                       f"are the ones the engines started with and are not on disk; an operator must restart them")
                if row["detail"] != why:
                    await ctx.apply(Transition(KIND, row.id, "REJECTING", row.version, "REJECTING", why[:200],
                                               {"detail": why}))
                return Result(requeue_after=self.settings.retry_after_s)
            await self._each(lambda e: e.pause_generation(self.settings.pause_mode))
            await self._each(lambda e: e.update_weights_from_disk(head["weights_path"], head.id))
        await self._each(lambda e: e.continue_generation())
        ops = [Transition(KIND, row.id, "REJECTING", row.version, "REJECTED",
                          f"incumbent {head.id if head else '(none)'} serving again")]
        target = row["target_load_id"]
        version = await ctx.get(VERSIONS, target) if target else None
        if version is not None and version.state in ("target", "loaded"):
            ops.append(Transition(VERSIONS, version.id, version.state, version.version, "rejected",
                                  f"job {row.id[:12]} rejected"))
        await ctx.apply(*ops)
        return Result()


__all__ = ["PublicationSettings", "Publisher"]
