"""The commit gate over the deployment's inference engines, applied at start-up and on every resync.

One ``engines`` row per configured engine (``sync_engines`` at election). At each election every live
row that election did not just register moves to ``unverified`` in the same write: it claims no
version until the gate has looked at its engine under the new leader (a row from before a restart
is not the truth: the engine may have been restarted or given other weights meanwhile). Only a look
moves a row on (``serving``, ``paused``, ``unreachable``). Reconciling a row looks
at the engine and at the journal, under the publisher's lock (so it never interleaves with a
publication step), and applies the gate the publication workflow keeps:

- a publication between ``UPDATING_WEIGHTS`` and ``READY_TO_COMMIT`` holds an *uncommitted*
  candidate: the engine is paused (again, if it was restarted meanwhile) and stays paused;
- a publication in ``CHECKPOINT`` whose pause intent is recorded (``pause_intent_at``: the publisher
  began pausing the engines and has not got past the barrier, a partial pause failure included):
  the engine is paused, a replacement started meanwhile too, so the barrier holds on every retry;
- a publication in ``CHECKPOINT`` (no pause yet), ``HEAD_COMMITTED`` or ``REJECTING``: the
  publisher is about to act on every engine (pause, resume on the committed version, put the
  incumbent back); the gate only records what the engine reports (a ``registered`` or
  ``unverified`` row stays so until the publisher is done: nothing verified can be said of it
  meanwhile), except that such a row whose engine serves anything but the committed head is
  paused (and recorded ``paused``): a replacement never generates off the head meanwhile;
- no publication in flight: the engine must serve the committed head. One that serves anything
  else (an engine restarted on its start-up weights, one that loaded a candidate that was then
  rejected while the orchestrator was down) is paused, loads the head from disk and must report
  it; only then is generation continued. Every engine agreeing on the head is what lets the
  deployment serve.

An engine that does not answer is ``unreachable``; one that cannot be brought to the head stays
paused and the row says why (``detail``). Either is looked at again after ``retry_after_s``.
A row moves (with its event) only when what it records changed; every move records the memory
regions as the adapter last had them acknowledged (``memory``).

Memory (colocated training, :mod:`engine.workflows.training.colocated`): while a job of the
deployment is ``RUNNING`` the engines are held paused with their memory as the trainer's step left
it; otherwise whatever is still released is resumed before an engine is given the head or let
generate. An engine whose region call failed is ``uncertain``: its adapter refuses every call, and
the row stays ``uncertain`` (an election leaves it so: a new process's adapter would not know
either) until the engine is replaced. With the deployment's stack running it (``replace``), its
service is killed so that managed recovery rebuilds the stack; the relaunch makes the row
``unverified`` (``engine.workflows.deployment.rows.gate_again``) and only then is a fresh adapter
built (``fresh``), gated like any new engine. Without a stack the row stays ``uncertain`` for an
operator, who replaces the engine under a new URL or name in ``training.engines``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from journal import Transition, WriteTx, models
from journal.writes import Row, to_row
from workers.inference.engine import REGIONS, InferenceEngine, RegionState

from engine.runtime.reconciler import BaseController, Context, Result

log = logging.getLogger("tidelog.engines")

KIND = "engines"
#: Publication states with an uncommitted candidate on (some) engines: they stay paused.
UNCOMMITTED = ("UPDATING_WEIGHTS", "READY_TO_COMMIT")
#: Publication states whose next step acts on every engine itself.
PUBLISHER_ACTS = ("CHECKPOINT", "HEAD_COMMITTED", "REJECTING")
#: The state of every live row from its election until the gate has looked at its engine: it claims
#: no version (``serving_version`` is null). Readers take it, like ``registered``, as not yet known.
UNVERIFIED = "unverified"
#: States whose row says nothing this leader has seen about the engine.
NOT_YET_KNOWN = ("registered", UNVERIFIED)
#: An engine whose memory-region call failed: never used again, replaced (see the module docs).
UNCERTAIN = "uncertain"
#: Makes a fresh adapter for an engine row id (the replacement of an uncertain one's).
Fresh = Callable[[str], InferenceEngine]
#: Asks the deployment to replace the process serving an engine row (id, why); False: it cannot now.
Replace = Callable[[str, str], Awaitable[bool]]


def engine_id(deployment: str, name: str) -> str:
    """An engine's row id: ``<deployment>/<name>`` (names are unique within a deployment only)."""
    return f"{deployment}/{name}"


async def sync_engines(tx: WriteTx, deployment: str, configured: Mapping[str, str]) -> list[str]:
    """Make the deployment's ``engines`` rows match the configuration (name -> url); returns the ids touched.

    Called at every election, in one write. A new name is created ``registered`` (id
    :func:`engine_id`); a changed URL retires the row and registers it again; a name no longer
    configured is ``retired`` (its history stays). Every other live row moves to ``unverified``: what
    it says was seen by an earlier leader, and the engine may have been restarted or given other
    weights since, so the row stops claiming a version (``serving_version`` and ``health`` cleared,
    what it said kept in ``detail``) until the gate has looked at the engine (:data:`UNVERIFIED`).
    """
    t = models.engines
    rows = {r.id: r for r in (await tx.execute(sa.select(
        t.c.id, t.c.state, t.c.version, t.c.url, t.c.serving_version, t.c.health).where(
        t.c.deployment == deployment))).all()}
    touched: list[str] = []
    ids = {engine_id(deployment, name): url for name, url in configured.items()}
    for name, url in ids.items():
        row = rows.get(name)
        if row is None:
            await tx.create(KIND, name, reason="configured", values={"deployment": deployment, "url": url})
        elif row.state == "retired":
            await tx.transition(KIND, name, from_state="retired", version=row.version, to_state="registered",
                                reason="configured again", changes={"url": url, "detail": None, "memory": None})
        elif row.url != url:
            await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state="retired",
                                reason=f"url changed to {url}")
            await tx.transition(KIND, name, from_state="retired", version=row.version + 1, to_state="registered",
                                reason="configured with a new url", changes={"url": url, "instance": None,
                                                                             "serving_version": None,
                                                                             "detail": None, "memory": None})
        elif row.state == UNCERTAIN:
            continue  # stays so until the engine is replaced: this leader knows no more of it
        elif row.state != UNVERIFIED:
            said = f"{row.state}, serving {row.serving_version or 'nothing known'}, health {row.health or '-'}"
            await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state=UNVERIFIED,
                                reason="elected: not verified until the gate looks at the engine",
                                changes={"serving_version": None, "health": None,
                                         "detail": f"not verified since this leader's election; an earlier "
                                                   f"leader recorded it {said}"[:500]})
        else:
            continue  # already unverified: the gate has not looked at it since an earlier election
        touched.append(name)
    for name, row in rows.items():
        if name not in ids and row.state != "retired":
            await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state="retired",
                                reason="no longer configured")
            touched.append(name)
    return touched


@dataclass(frozen=True)
class GateSettings:
    deployment: str
    pause_mode: str = "retract"
    retry_after_s: float = 5.0
    #: Colocated training: engines stay paused, their memory released, while a job is RUNNING.
    colocated: bool = False


class EngineGateController(BaseController):
    """Reconciles ``engines`` rows: the start-up (and standing) commit gate; see the module docs."""

    kind = KIND

    def __init__(self, engines: MutableMapping[str, InferenceEngine], settings: GateSettings, lock: asyncio.Lock,
                 *, fresh: Fresh | None = None, replace: Replace | None = None) -> None:
        #: Shared with the publisher (the same mapping): a replaced adapter is replaced for both.
        self.engines = engines
        self.settings = settings
        #: Shared with the publisher: a gate look and a publication step never interleave.
        self.lock = lock
        self.fresh = fresh
        #: Set after build (the deployment family is built after this one): see :data:`Replace`.
        self.replace = replace
        # Uncertain engines whose wait for a replacement this process has logged (once each).
        self._waiting: set[str] = set()
        # Replaced adapters being closed (kept referenced until they are).
        self._closing: set[asyncio.Task[None]] = set()
        # Engines this process has already resumed on the head: a later look that finds the same
        # version and no pause recorded needs no call. The first look of a process always resumes,
        # since a crash can leave an engine paused without the row saying so.
        self._resumed: set[str] = set()

    async def reconcile(self, ctx: Context, engine_id: str) -> Result:
        row = await ctx.get(KIND, engine_id)
        engine = self.engines.get(engine_id)
        if row is None or row.state == "retired" or engine is None or row["deployment"] != self.settings.deployment:
            return Result()
        if self.lock.locked():
            # A publication step holds the engines (a transfer may take minutes): come back later
            # rather than hold one of the reconciler's slots waiting.
            return Result(requeue_after=self.settings.retry_after_s)
        async with self.lock:  # free: taken at once, no other coroutine runs in between
            return await self._gate(ctx, row, self._adapter(row, engine))

    async def adopt(self, tx: WriteTx) -> None:
        """On election, after ``sync_engines`` (so before any controller calls an engine): a fresh
        adapter for every engine (what one kept from an earlier term of this process may be stale:
        another leader may have replaced or resumed the engine since), told what its row recorded.
        An ``uncertain`` row's adapter refuses every call (a new adapter would not know the
        engine's state either); a relaunch of its engine gets a fresh one. Regions recorded
        released are taken as released (a crash may have left them so), except on an engine a
        service of the stack runs: the new leader's stack relaunches it, every region resident."""
        t, s = models.engines, models.services
        managed = {r.engine for r in (await tx.execute(sa.select(s.c.engine).where(
            s.c.engine.is_not(None), s.c.desired != "removed"))).all()}
        for r in (await tx.execute(sa.select(t.c.id, t.c.state, t.c.memory, t.c.detail).where(
                t.c.deployment == self.settings.deployment))).all():
            engine = self.engines.get(r.id)
            if engine is None or r.state == "retired":
                continue
            if self.fresh is not None:
                engine = self._swap(r.id, engine)
            if r.state == UNCERTAIN:
                engine.mark_uncertain(f"recorded uncertain by an earlier leader ({r.detail or 'no detail'})")
                continue
            memory = r.memory if isinstance(r.memory, Mapping) else {}
            released = [g for g in REGIONS if memory.get(g) == RegionState.RELEASED.value]
            if released and r.id not in managed:
                engine.note_released(released)

    def _swap(self, engine_id: str, old: InferenceEngine) -> InferenceEngine:
        """Put a fresh adapter in ``old``'s place (for the gate and the publisher) and close ``old``."""
        assert self.fresh is not None
        engine = self.fresh(engine_id)
        self.engines[engine_id] = engine
        self._resumed.discard(engine_id)
        self._waiting.discard(engine_id)
        closing = asyncio.ensure_future(old.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        return engine

    def _adapter(self, row: Row, engine: InferenceEngine) -> InferenceEngine:
        """The adapter to look with: a fresh one when the engine's process was relaunched (its
        row ``unverified`` with ``memory`` cleared) and the old adapter was uncertain or knew of
        released regions, which the new process does not have."""
        relaunched = row.state == UNVERIFIED and row["memory"] is None
        stale = engine.uncertain is not None or any(st is RegionState.RELEASED for st in engine.memory.values())
        if relaunched and stale and self.fresh is not None:
            log.info("engine %s: its process was relaunched; a fresh adapter for the new one", row.id)
            engine = self._swap(row.id, engine)
        return engine

    async def _gate(self, ctx: Context, row: Row, engine: InferenceEngine) -> Result:
        retry = Result(requeue_after=self.settings.retry_after_s)
        if row.state == UNCERTAIN or engine.uncertain is not None:
            return await self._uncertain(ctx, row, engine)
        try:
            version = await engine.weight_version()
        except Exception as exc:  # noqa: BLE001 - recorded on the row; looked at again
            self._resumed.discard(row.id)
            if engine.uncertain is not None:
                return await self._uncertain(ctx, row, engine)
            await self._record(ctx, row, "unreachable", {"health": "unreachable",
                                                         "detail": f"{type(exc).__name__}: {exc}"[:500]})
            return retry
        if self.settings.colocated:
            training = await self._training(ctx)
            if training is not None:
                await self._hold_paused(ctx, row, engine, version, held_for_training(training, engine))
                return retry  # looked at again once the step is over (its end does not wake this row)
        job, head = await self._publication(ctx)
        if job is not None and job.state in UNCOMMITTED:
            await self._hold_paused(ctx, row, engine, version, held_uncommitted(job.id, job.state))
            return Result()
        if job is not None and job.state == "CHECKPOINT" and job["pause_intent_at"] is not None:
            # The publisher began pausing every engine (its intent is durable) and has not yet got
            # past the barrier: an engine it has not paused, or a replacement started meanwhile, is
            # fenced now rather than left generating until the publisher's retry reaches it.
            await self._hold_paused(ctx, row, engine, version, f"job {job.id[:12]} is pausing every engine "
                                                               f"(pause intent recorded): held paused")
            return Result()
        if job is not None and job.state in PUBLISHER_ACTS:
            # The publisher's next step pauses, resumes or restores every engine itself.
            self._resumed.discard(row.id)
            if row.state in NOT_YET_KNOWN and head is not None and version != head.id:
                # A replacement (or an engine not yet looked at) serving something other than the
                # committed head must not generate until the publisher puts it on a version.
                await self._hold_paused(ctx, row, engine, version,
                                        f"job {job.id[:12]} {job.state}: serves {version!r}, not the committed "
                                        f"head {head.id}; held paused for the publisher")
                return retry
            if row.state in NOT_YET_KNOWN:
                # Nothing verified to say of it yet (the publisher is about to change what it serves
                # and whether it generates): looked at again once the publisher is done.
                return retry
            await self._record(ctx, row, row.state, {
                "health": "ok", "serving_version": version,
                "detail": f"job {job.id[:12]} {job.state}: the publisher acts on the engines"})
            return Result()
        if head is not None and version != head.id:
            if head["weights_path"] is None:
                await engine.pause_generation(self.settings.pause_mode)
                self._resumed.discard(row.id)
                await self._record(ctx, row, "paused", {
                    "health": "ok", "paused": True, "serving_version": version,
                    "detail": f"serves {version!r}, not the committed head {head.id}, whose weights are not on "
                              f"disk (set training.initial_weights); held paused for an operator"})
                return retry
            try:
                await engine.pause_generation(self.settings.pause_mode)
                await engine.resume_memory(("weights",))  # a load needs them resident
                await engine.update_weights_from_disk(head["weights_path"], head.id)
                version = await engine.weight_version()
                if version != head.id:
                    raise RuntimeError(f"reports {version!r} after loading {head.id}")
            except Exception as exc:  # noqa: BLE001 - held paused, recorded, looked at again
                self._resumed.discard(row.id)
                if engine.uncertain is not None:
                    return await self._uncertain(ctx, row, engine)
                await self._record(ctx, row, "paused", {
                    "health": "ok", "paused": True, "serving_version": version,
                    "detail": f"could not bring it to the committed head {head.id} "
                              f"({type(exc).__name__}: {exc}); held paused"[:500]})
                return retry
            log.info("engine %s: loaded the committed head %s", row.id, head.id)
            self._resumed.discard(row.id)
        if row.id not in self._resumed or row["paused"] or row.state != "serving":
            try:
                # Whatever a colocated step (or a crash during one) left released comes back first.
                await engine.resume_memory()
            except Exception:
                if engine.uncertain is None:
                    raise  # not a region call's failure (those make the adapter uncertain)
                return await self._uncertain(ctx, row, engine)
            await engine.continue_generation()
            self._resumed.add(row.id)
        await self._record(ctx, row, "serving", {"health": "ok", "paused": False, "serving_version": version,
                                                 "detail": None})
        return Result()

    async def _hold_paused(self, ctx: Context, row: Row, engine: InferenceEngine, version: str | None,
                           detail: str) -> None:
        """Pause the engine and record it ``paused`` with ``detail`` (not resumed by this process)."""
        await engine.pause_generation(self.settings.pause_mode)
        self._resumed.discard(row.id)
        await self._record(ctx, row, "paused", {"health": "ok", "paused": True, "serving_version": version,
                                                "detail": detail})

    async def _uncertain(self, ctx: Context, row: Row, engine: InferenceEngine) -> Result:
        """Record the engine ``uncertain`` (once) and ask for its replacement; looked at again after
        ``retry_after_s`` until its relaunch makes the row ``unverified`` (then a fresh adapter,
        :meth:`_adapter`)."""
        self._resumed.discard(row.id)
        why = engine.uncertain or "an earlier leader recorded it uncertain"
        if row.state != UNCERTAIN:
            await self._record(ctx, row, UNCERTAIN, {
                "health": None, "detail": f"memory state unknown since {why}; never used again until it is "
                                          f"replaced"[:500]})
        # Asked at each look until a family takes it on (a stack refuses while it is not ready: a
        # rebuild under way relaunches the engine anyway).
        if self.replace is None or not await self.replace(row.id, f"engine {row.id} is uncertain ({why})"):
            if row.id not in self._waiting:
                self._waiting.add(row.id)
                log.warning("engine %s is uncertain (%s): waiting for it to be replaced", row.id, why)
        return Result(requeue_after=self.settings.retry_after_s)

    async def _training(self, ctx: Context) -> str | None:
        """The deployment's job being trained now (``RUNNING``), if any."""
        j = models.training_jobs
        async with ctx.journal.read() as conn:
            found: str | None = (await conn.execute(sa.select(j.c.id).where(
                j.c.deployment == self.settings.deployment, j.c.state == "RUNNING").limit(1))).scalar()
        return found

    async def _publication(self, ctx: Context) -> tuple[Row | None, Row | None]:
        """The deployment's job in a publication state (if any) and its committed head (if any)."""
        j, v = models.training_jobs, models.weight_versions
        async with ctx.journal.read() as conn:
            job = (await conn.execute(sa.select(j).where(
                j.c.deployment == self.settings.deployment,
                j.c.state.in_((*UNCOMMITTED, *PUBLISHER_ACTS))).limit(1))).first()
            head = (await conn.execute(sa.select(v).where(
                v.c.deployment == self.settings.deployment, v.c.state == "committed")
                .order_by(v.c.sequence.desc()).limit(1))).first()
        return (None if job is None else to_row("training_jobs", job._mapping),
                None if head is None else to_row("weight_versions", head._mapping))

    async def _record(self, ctx: Context, row: Row, state: str, changes: dict[str, Any]) -> None:
        await record_engine(ctx, row, self.engines.get(row.id), state, changes)


def memory_of(engine: InferenceEngine) -> dict[str, str]:
    """The adapter's acknowledged state of each memory region (``resident`` or ``released``)."""
    return {region: str(getattr(st, "value", st)) for region, st in sorted(engine.memory.items())}


def held_for_training(job_id: str, engine: InferenceEngine) -> str:
    """An engine row's ``detail`` while a job's colocated step runs (the training controller's and
    the gate's words: the same, so that neither rewrites the row the other left)."""
    released = [r for r, st in engine.memory.items() if st is RegionState.RELEASED]
    return (f"job {job_id[:12]} RUNNING: held paused for its colocated training step; released: "
            f"{', '.join(sorted(released)) or 'nothing'}")


def held_uncommitted(job_id: str, state: str) -> str:
    """An engine row's ``detail`` while a job's candidate is uncommitted (the gate's and the
    publisher's words: the same, so that neither rewrites the row the other left)."""
    return f"job {job_id[:12]} {state}: held paused until its candidate is committed or rejected"


def engine_transition(row: Row, engine: InferenceEngine | None, state: str,
                      changes: dict[str, Any]) -> Transition | None:
    """The move of an ``engines`` row to ``state`` with ``changes`` and the engine's acknowledged
    memory; ``None`` when it would record nothing new (every resync looks again)."""
    if engine is not None:
        changes = {**changes, "memory": memory_of(engine)}
    if row.state == state and all(row[k] == v for k, v in changes.items()):
        return None
    said = changes.get("detail") or f"serving {changes.get('serving_version')}"
    return Transition(KIND, row.id, row.state, row.version, state, str(said)[:200], changes)


async def record_engine(ctx: Context, row: Row, engine: InferenceEngine | None, state: str,
                        changes: dict[str, Any]) -> None:
    """Apply :func:`engine_transition` (when it records anything)."""
    move = engine_transition(row, engine, state, changes)
    if move is not None:
        await ctx.apply(move)


__all__ = ["NOT_YET_KNOWN", "UNCERTAIN", "UNVERIFIED", "EngineGateController", "Fresh", "GateSettings", "Replace",
           "engine_id", "engine_transition", "held_for_training", "held_uncommitted", "memory_of", "record_engine", "sync_engines"]
