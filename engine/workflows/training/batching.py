"""Rollouts become training jobs: the batch machine (``journal.machines.TRAINING_BATCHES``).

A deployment with ``training.batching.enabled`` has one ``open`` batch row, ``<deployment>.b<n>``,
ensured at every election, and a committed head from the start (its ``initial_weights`` registered
then, :func:`ensure_head`, rather than at the first publication), so every rollout records the
version it ran on.
:class:`BatchController` looks at it whenever a rollout finishes, a job ends or a version is
committed (and at every resync), and in one write transaction:

- takes the finished rollouts no batch has taken yet (``rollouts.batch_id`` null), oldest first, and
  judges each (:class:`~engine.workflows.training.samples.BatchRules`: labels, reward, staleness
  against the committed head, the sample function);
- records every excluded one at once: its ``finished -> finished`` self-edge sets ``batch_id`` to the
  open batch, and the batch's ``open -> open`` self-edge adds it to ``excluded`` with the reason;
- once ``size`` rollouts qualify and the deployment has no job in flight: sets their ``batch_id``,
  submits the job (:func:`~engine.workflows.training.jobs.submit_job`; its payload is the batch's id,
  number and base version and the samples in rollout-id order), moves the batch ``open ->
  submitted`` (members, job, base version) and creates the next ``open`` batch — all in the same
  write. Grouping and submission are one commit, so a crash leaves either all of it or none of it:
  no rollout is lost between them or taken twice, and the database refuses a second open batch
  (``ux_training_batches_open``) or a second job in flight.

Each rollout is taken by exactly one batch (the compare-and-set of its row refuses a second). A
``submitted`` batch follows its job: ``trained`` (``COMPLETE``), ``rejected`` or ``failed``. A job in
flight holds grouping (its publication moves the head, so a batch formed now could be stale by the
time it trains); exclusions go on meanwhile (a rollout stale against today's head stays stale).

Finished rollouts wait for a batch before they are forgotten (the rollout controller holds them),
so a rollout's result is in the journal until a job holds it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from journal import Committed, Create, StaleRow, Transition, WriteTx, models
from journal.machines import TRAINING_JOBS
from journal.writes import Row, to_row

from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.training.identity import LoadId
from engine.workflows.training.jobs import JobConflict, in_flight, submit_job
from engine.workflows.training.samples import BatchRules

log = logging.getLogger("tidelog.batching")

KIND = "training_batches"
ROLLOUTS = "rollouts"
VERSIONS = "weight_versions"
#: A job's end -> the batch's.
ENDS = {"COMPLETE": "trained", "REJECTED": "rejected", "FAILED": "failed"}


@dataclass(frozen=True)
class BatchingSettings:
    """``training.batching`` for one deployment (docs/training.md, "Batching rollouts into jobs")."""

    deployment: str
    size: int
    rules: BatchRules
    #: Most finished rollouts one pass reads (a pass that read this many runs again at once).
    scan: int = 0

    @property
    def scan_limit(self) -> int:
        return self.scan or max(4 * self.size, 64)


#: Most exclusions a batch row lists (each excluded rollout's own finished -> finished event says why).
EXCLUDED_LISTED = 1000


def _capped(excluded: dict[str, str]) -> dict[str, str]:
    """The first :data:`EXCLUDED_LISTED` exclusions: the row (and each event's copy of it) stays bounded."""
    return excluded if len(excluded) <= EXCLUDED_LISTED else dict(list(excluded.items())[:EXCLUDED_LISTED])


async def in_flight_id(conn: Any, deployment: str) -> str | None:
    """The deployment's job in flight, if any (a read outside a write)."""
    j = models.training_jobs
    found: str | None = (await conn.execute(sa.select(j.c.id).where(
        j.c.deployment == deployment, j.c.state.in_(models.TRAINING_IN_FLIGHT)).limit(1))).scalar()
    return found


class _Again(Exception):
    """What a pass judged against changed before its write: the pass runs again."""


def batch_id(deployment: str, number: int) -> str:
    """``<deployment>.b<number>`` (URL-safe: it is a path segment of ``GET /v1/batches/{id}``); a deployment
    name longer than 200 characters is hashed."""
    name = deployment if len(deployment) <= 200 else hashlib.sha256(deployment.encode()).hexdigest()[:32]
    return f"{name}.b{number}"


async def head_of(conn: Any, deployment: str) -> str | None:
    """The deployment's committed head (the newest committed weight version), if any."""
    v = models.weight_versions
    head: str | None = (await conn.execute(sa.select(v.c.id).where(
        v.c.deployment == deployment, v.c.state == "committed").order_by(v.c.sequence.desc()).limit(1))).scalar()
    return head


async def ensure_head(tx: WriteTx, deployment: str, initial_weights: str | None) -> str | None:
    """The deployment's committed head; with none yet, its ``initial_weights`` registered as the
    committed head (``<new incarnation>:0``) so the very first rollouts record the version they ran
    on (the engine gate then puts every engine on it before it serves). ``None`` without either."""
    head = await head_of(tx, deployment)
    if head is not None or initial_weights is None:
        return head
    first = LoadId.first()
    await tx.apply([Create(VERSIONS, str(first), "the weights the engines started with (registered for batching)",
                           {"deployment": deployment, "incarnation": first.incarnation, "sequence": first.sequence,
                            "weights_path": initial_weights}, "committed")])
    return str(first)


async def ensure_open(tx: WriteTx, deployment: str) -> str:
    """The deployment's open batch, created (numbered after its last) if it has none; its id."""
    b = models.training_batches
    found = (await tx.execute(sa.select(b.c.id).where(b.c.deployment == deployment, b.c.state == "open"))).scalar()
    if found is not None:
        return str(found)
    last = (await tx.execute(sa.select(sa.func.max(b.c.number)).where(b.c.deployment == deployment))).scalar()
    number = 0 if last is None else int(last) + 1
    entity = batch_id(deployment, number)
    await tx.create(KIND, entity, reason=f"batch {number} of {deployment} opened",
                    values={"deployment": deployment, "number": number})
    return entity


class BatchController(BaseController):
    """Groups a deployment's finished rollouts into training jobs (see the module docs)."""

    kind = KIND

    def __init__(self, settings: BatchingSettings) -> None:
        self.settings = settings
        self._enqueue: Any = None
        # The open batch's id and each submitted batch's job: wake-up lists only (resync covers both).
        self._open: str | None = None
        self._jobs: dict[str, str] = {}

    def attach(self, enqueue: Any) -> None:
        self._enqueue = enqueue

    def on_commit(self, committed: Sequence[Committed]) -> None:
        look = False
        for c in committed:
            if c.kind == ROLLOUTS and c.to_state == "finished" and c.from_state != "finished":
                look = True
            elif c.kind == "training_jobs" and c.to_state in TRAINING_JOBS.terminal:
                look = True
                batch = self._jobs.pop(c.entity_id, None)
                if batch is not None and self._enqueue is not None:
                    self._enqueue(KIND, batch)
            elif c.kind == "weight_versions" and c.to_state == "committed":
                look = True
            elif c.kind == KIND and c.to_state == "open":
                self._open = c.entity_id
        if look and self._open is not None and self._enqueue is not None:
            self._enqueue(KIND, self._open)

    async def lost(self) -> None:
        self._open = None
        self._jobs.clear()

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row["deployment"] != self.settings.deployment:
            return Result()
        if row.state == "submitted":
            return await self._follow(ctx, row)
        if row.state != "open":
            return Result()
        self._open = row.id
        try:
            return await self._pass(ctx, row)
        except (StaleRow, _Again):
            return Result(requeue_after=0.0)  # a rollout, the batch or the head moved under this pass: again

    # -- submitted: follow the job --------------------------------------------------------------------

    async def _follow(self, ctx: Context, row: Row) -> Result:
        job = await ctx.get("training_jobs", row["job_id"])
        if job is None or job.state not in ENDS:
            self._jobs[row["job_id"]] = row.id
            return Result()
        await ctx.apply(Transition(KIND, row.id, "submitted", row.version, ENDS[job.state],
                                   f"job {job.id[:12]} ended {job.state}",
                                   {"detail": None if job.state == "COMPLETE" else
                                    (job["detail"] or (job["verdict"] or {}).get("reason") or "")[:500] or None}))
        return Result()

    # -- open: exclude, group, submit -----------------------------------------------------------------

    async def _pass(self, ctx: Context, row: Row) -> Result:
        s, t, v = self.settings, models.rollouts, models.weight_versions
        async with ctx.journal.read() as conn:
            head = await head_of(conn, s.deployment)
            found = (await conn.execute(sa.select(t).where(t.c.state == "finished", t.c.batch_id.is_(None))
                                        .order_by(t.c.ended_at, t.c.id).limit(s.scan_limit))).all()
            busy = await in_flight_id(conn, s.deployment)
            # Staleness counts publications, not sequence numbers (a rejected candidate uses one up).
            committed = [] if head is None else sorted((await conn.execute(sa.select(v.c.sequence).where(
                v.c.deployment == s.deployment, v.c.incarnation == LoadId.parse(head).incarnation,
                v.c.state == "committed"))).scalars())
        if not found:
            return Result()
        if head is None and s.rules.needs_head:
            return Result()  # no committed version to measure staleness by: its commit wakes this
        candidates = [to_row(ROLLOUTS, f._mapping) for f in found]
        members: list[tuple[Row, dict[str, Any]]] = []
        excluded: dict[str, str] = {}
        for r in candidates:
            rollout = {**r.values, "id": r.id}
            why = s.rules.exclusion(rollout, head, committed)
            if why is None and busy is None and len(members) < s.size:
                # Samples are built only for a batch that can be submitted now.
                sample, why = s.rules.sample_of(rollout)
                if sample is not None:
                    members.append((r, sample))
            if why is not None:
                excluded[r.id] = why
        full = len(members) == s.size
        if not full and not excluded:
            return Result()  # a batch not full yet, or a job in flight (its end wakes this)
        try:
            submitted = await ctx.write(lambda tx: self._write(tx, row, head, members if full else [], excluded,
                                                               candidates))
        except JobConflict as exc:
            log.info("batch %s waits: %s", row.id, exc)
            if not excluded:
                return Result()
            submitted = await ctx.write(lambda tx: self._write(tx, row, head, [], excluded, candidates))
        if submitted is not None:
            self._jobs[submitted] = row.id
            return Result(requeue_after=0.0)  # more may wait than one batch holds
        # Only exclusions were written: more may wait than one pass read.
        return Result(requeue_after=0.0) if len(found) == s.scan_limit else Result()

    async def _write(self, tx: WriteTx, row: Row, head: str | None, members: list[tuple[Row, dict[str, Any]]],
                     excluded: dict[str, str], candidates: list[Row]) -> str | None:
        """Record ``excluded`` and, with ``members``, submit the batch; the job's id if it was submitted.
        Raises :class:`StaleRow` if a rollout or the batch moved since they were read."""
        s = self.settings
        if await head_of(tx, s.deployment) != head:
            raise _Again(f"the head of {s.deployment} moved")  # staleness was judged against the old one
        if members and await in_flight(tx, s.deployment) is not None:
            members = []  # a job went out meanwhile: only the exclusions now
        if not members and not excluded:
            return None
        by_id = {r.id: r for r in candidates}
        taken = sorted(members, key=lambda m: m[0].id)
        ops = [Transition(ROLLOUTS, rid, "finished", by_id[rid].version, "finished",
                          f"excluded from batch {row.id}: {why}"[:500], {"batch_id": row.id})
               for rid, why in sorted(excluded.items())]
        ops += [Transition(ROLLOUTS, r.id, "finished", r.version, "finished", f"taken by batch {row.id}",
                           {"batch_id": row.id}) for r, _ in taken]
        await tx.apply(ops)
        merged = _capped({**(row["excluded"] or {}), **excluded}) or None
        if not members:
            await tx.apply([Transition(KIND, row.id, "open", row.version, "open",
                                       f"{len(excluded)} finished rollout(s) excluded", {"excluded": merged})])
            return None
        number = int(row["number"])
        payload = {"batch_id": row.id, "scenario_step": number, "batch_number": number, "base_version": head,
                   "rollouts": [sample for _, sample in taken]}
        submission = await submit_job(tx, s.deployment, payload)
        if submission.disposition != "new":
            # A batch id names its job; only a journal edited by hand holds it already.
            raise RuntimeError(f"batch {row.id}: its job {submission.job_id} is already {submission.row.state}")
        await tx.apply([Transition(KIND, row.id, "open", row.version, "submitted",
                                   f"{len(taken)} rollouts submitted as job {submission.job_id[:12]}",
                                   {"rollout_ids": [r.id for r, _ in taken], "excluded": merged,
                                    "base_version": head, "job_id": submission.job_id, "submitted_at": tx.now})])
        await ensure_open(tx, s.deployment)
        return submission.job_id


__all__ = ["BatchController", "BatchingSettings", "KIND", "batch_id", "ensure_head", "ensure_open", "head_of"]
