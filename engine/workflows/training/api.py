"""The training routes (split from :mod:`engine.http.app`): jobs, publications, engines.

- ``POST /v1/jobs`` ``{"payload": {...}, "deployment"?}`` -> 201 ``{"job", "disposition": "new"}`` for a
  new job, 200 with ``replay``, ``resume`` or ``in_progress`` for one already recorded (nothing trains
  again); 409 ``job_conflict`` (another job of the deployment is in flight: both ids named, also as
  ``in_flight_job`` and ``refused_job``), 409 ``job_closed`` (the job was rejected or failed), 422
  ``invalid_body`` (a bad payload, by field; a ``deployment`` other than the configured one).
- ``GET /v1/jobs[?state=&limit=&before=]`` newest first (``next_before`` pages; no payloads), and
  ``GET /v1/jobs/{id}``: the row with its payload and ``ambiguity``, its ``phases`` and ``history`` (its
  events; past 1000, the first and latest 500, ``history_omitted`` counting the rest) and its
  ``publication`` (the ``weight_versions`` row of its ``target_load_id``, or null).
- ``POST /v1/jobs/{id}/resolve`` ``{"decision": "ran"|"not_run"|"abandon", "reason", "checkpoint_path"?}``
  -> 202 for an ``AMBIGUOUS`` job. For ``ran`` the trainer first verifies the checkpoint and that it
  carries the job's id: 422 ``checkpoint_unverified`` (naming the path and why) otherwise, and nothing
  is written.
- ``POST /v1/jobs/{id}/reject`` ``{"reason"}`` -> 202 for a job in ``CHECKPOINT``, ``UPDATING_WEIGHTS``
  or ``READY_TO_COMMIT``.
- ``POST /v1/jobs/{id}/acknowledge`` ``{"reason"}`` -> 202 for a ``READY_TO_COMMIT`` job without a
  verdict: the operator's commit verdict is recorded and the head is committed next (``training.commit:
  acknowledge``; in the other modes too, where it wins over the gate); 409 ``verdict_recorded`` when
  the job already has one (naming it, also as ``verdict``). For the three: 404 ``not_found``, 409
  ``job_state`` (naming the job's state and the allowed ones, also as ``state`` and ``allowed``), 422
  ``invalid_body``.
- ``GET /v1/publications[?state=&limit=&before=]`` (``weight_versions``, newest first) and
  ``GET /v1/publications/{load_id}``: the version, its ``job`` (summary, null for initial weights) and
  the engines that report serving it (``served_by``).
- ``GET /v1/engines``: every engine row (state, serving_version, paused, health, detail).
- ``GET /v1/batches[?state=&limit=&before=]`` (``training_batches``, newest first) and
  ``GET /v1/batches/{id}``: the batch (its members, the rollouts it excluded and why, its base version)
  with its ``job`` (summary, null while it is open).

Reads come from the journal, so any replica answers them, with or without training configured. The
POSTs need the token and the leader (the API's ``mutating`` guard) and a training-enabled
orchestrator: 503 ``training_disabled`` otherwise, and 503 ``trainer_unavailable`` when a ``ran``
resolution cannot reach the trainer to verify its checkpoint.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

import sqlalchemy as sa
from aiohttp import web
from pydantic import AfterValidator, StringConstraints

from journal import StaleRow, WriteTx, audit, models
from journal.audit import EventFilter

from engine.http.listing import lister as list_rows
from engine.http.query import no_query
from engine.http.shell import ApiError, Body, Directory, Handler, Refusals, phases, read_body, row_json, shown, typed
from engine.workflows.training import (InvalidDecision, JobClosed, JobConflict, JobNotFound, JobStateRefused,
                                      TrainingPayloadError, VerdictRecorded, acknowledge_job, reject_job, resolve_job,
                                      submit_job)
from engine.workflows.training.wiring import TrainingParts

if TYPE_CHECKING:  # annotations only: the service builds the families
    from engine.runtime.service import Orchestrator

JOBS, VERSIONS, ENGINES, BATCHES = "training_jobs", "weight_versions", "engines", "training_batches"


def _said(v: str) -> str:
    if not v.strip():
        raise ValueError("must say why (not only spaces)")
    return v


Reason = Annotated[str, StringConstraints(min_length=1, max_length=500), AfterValidator(_said)]


class SubmitJob(Body):
    """``POST /v1/jobs``: the job's payload (its batch; the job id is derived from it) and, if given,
    the deployment, which must be the configured one."""

    payload: dict[str, Any]
    deployment: Annotated[str, StringConstraints(min_length=1, max_length=255)] | None = None


class ResolveJob(Body):
    """``POST /v1/jobs/{id}/resolve``: the operator's decision on an ``AMBIGUOUS`` job."""

    decision: Literal["ran", "not_run", "abandon"]
    reason: Reason
    checkpoint_path: Directory | None = None


class RejectJob(Body):
    """``POST /v1/jobs/{id}/reject``: why the candidate is rejected."""

    reason: Reason


class AcknowledgeJob(Body):
    """``POST /v1/jobs/{id}/acknowledge``: why the candidate may become the head."""

    reason: Reason


def _invalid(exc: TrainingPayloadError | InvalidDecision) -> ApiError:
    return ApiError(422, "invalid_body", f"{exc.field}={shown(exc.value)}: {exc.rule}", exc.field)


def _refused(exc: JobStateRefused) -> ApiError:
    return ApiError(409, "job_state", str(exc), state=exc.state, allowed=list(exc.allowed))


#: The training family's refusals (the shell answers the shared ones).
REFUSALS: Refusals = {
    JobNotFound: lambda exc: ApiError(404, "not_found", str(exc)),
    JobStateRefused: _refused,
    VerdictRecorded: lambda exc: ApiError(409, "verdict_recorded", str(exc), verdict=exc.verdict),
    InvalidDecision: _invalid,
    TrainingPayloadError: _invalid,
}


def job_json(mapping: Mapping[Any, Any], terminal: frozenset[str], *, payload: bool = True) -> dict[str, Any]:
    out = row_json(mapping)
    if not payload:
        out.pop("payload", None)
    out["terminal"] = mapping["state"] in terminal
    return out


def history_json(ev: Mapping[str, Any]) -> dict[str, Any]:
    """One event of a job, without the values it set (the create event would repeat the payload)."""
    return {"seq": ev["seq"], "at": ev["ts"].isoformat(), "from_state": ev["from_state"],
            "to_state": ev["to_state"], "reason": ev["reason"], "actor": ev["actor"], "epoch": ev["epoch"]}


async def job_history(conn: Any, job_id: str) -> tuple[list[dict[str, Any]], int]:
    """The job's events, and how many were left out: a job with more than a page of them (a long
    run of retried publication attempts) shows its first and its latest half page."""
    history = await audit.query_events(conn, EventFilter(entity_kind=JOBS, entity_id=job_id, limit=audit.MAX_PAGE))
    if len(history) < audit.MAX_PAGE:
        return history, 0
    e, half = models.events, audit.MAX_PAGE // 2
    mine = sa.and_(e.c.entity_kind == JOBS, e.c.entity_id == job_id)
    total = int((await conn.execute(sa.select(sa.func.count()).select_from(e).where(mine))).scalar_one())
    if total == len(history):
        return history, 0
    tail = (await conn.execute(sa.select(e).where(mine).order_by(e.c.seq.desc()).limit(half))).all()
    return history[:half] + [dict(r._mapping) for r in reversed(tail)], total - 2 * half


def add_training_routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    """Register the training routes; ``mutating`` is the API's token-and-leader guard."""
    kinds = orch.journal.kinds
    job_end = kinds.get(JOBS).machine.terminal
    t, v, g = models.training_jobs, models.weight_versions, models.engines

    def handled(handler: Handler) -> Handler:
        return typed(handler, REFUSALS)

    def training() -> TrainingParts:
        parts = orch.handle("training")
        if not isinstance(parts, TrainingParts):
            raise ApiError(503, "training_disabled", "training is not enabled in this orchestrator "
                                                     "(training.enabled); nothing was written")
        return parts

    async def job_summary(conn: Any, job_id: str) -> dict[str, Any] | None:
        row = (await conn.execute(sa.select(t).where(t.c.id == job_id))).first()
        return None if row is None else job_json(row._mapping, job_end, payload=False)

    async def submit(request: web.Request) -> web.Response:
        body = await read_body(request, SubmitJob)
        training()
        deployment = orch.settings.training.deployment
        if body.deployment is not None and body.deployment != deployment:
            raise ApiError(422, "invalid_body", f"deployment={shown(body.deployment)}: this orchestrator "
                                                f"trains deployment {deployment!r} only", "deployment")

        async def write(tx: WriteTx) -> tuple[str, str]:
            s = await submit_job(tx, deployment, body.payload)
            return s.job_id, s.disposition
        try:
            job_id, disposition = await orch.committer.run(write)
        except JobConflict as exc:
            raise ApiError(409, "job_conflict", str(exc), deployment=exc.deployment,
                                   in_flight_job=exc.in_flight, in_flight_state=exc.state,
                                   refused_job=exc.submitted) from None
        except JobClosed as exc:
            raise ApiError(409, "job_closed", str(exc), job_id=exc.job_id, state=exc.state) from None
        async with orch.journal.read() as conn:
            job = await job_summary(conn, job_id)
        return web.json_response({"job": job, "disposition": disposition},
                                 status=201 if disposition == "new" else 200,
                                 headers={"Location": f"/v1/jobs/{job_id}"})

    async def operate(write: Callable[[WriteTx], Awaitable[str]], job_id: str) -> str:
        """Run an operator's compare-and-set, looking again if a controller moved the job meanwhile."""
        try:
            return await orch.committer.run_fresh(write)
        except StaleRow:
            raise ApiError(409, "job_state", f"job {job_id} kept changing; look at it and try again") from None

    async def resolve(request: web.Request) -> web.Response:
        body = await read_body(request, ResolveJob)
        parts = training()
        job_id = request.match_info["id"]
        # Refused before the trainer is asked anything: a job that is not there or not AMBIGUOUS.
        async with orch.journal.read() as conn:
            found = (await conn.execute(sa.select(t.c.state, t.c.trainer_step).where(t.c.id == job_id))).first()
        if found is None:
            raise JobNotFound(job_id)
        if found.state != "AMBIGUOUS":
            raise JobStateRefused(job_id, "resolve", found.state, ("AMBIGUOUS",))
        verified: dict[str, Any] | None = None
        if body.decision == "ran" and body.checkpoint_path is not None:
            path = body.checkpoint_path
            try:
                verified = await parts.controller.verify_checkpoint_of(job_id, path)
            except ValueError as exc:  # the trainer's CheckpointError, or a checkpoint of another job
                raise ApiError(422, "checkpoint_unverified", f"checkpoint_path={shown(path)}: the trainer did not "
                                                             f"verify it as job {job_id}'s step ({exc}); nothing "
                                                             f"was written", "checkpoint_path") from None
            except Exception as exc:  # noqa: BLE001 - the trainer could not be asked: say so, write nothing
                raise ApiError(503, "trainer_unavailable", f"could not have the trainer verify {path!r} "
                                                           f"({type(exc).__name__}: {exc}); nothing was "
                                                           f"written") from None
            # The job's step comes right after the one the trainer was at when it was called: a
            # checkpoint at another step (trained on another base) is not this job's step.
            if found.trainer_step is not None and verified.get("step") != found.trainer_step + 1:
                raise ApiError(422, "checkpoint_unverified", f"checkpoint_path={shown(path)}: it holds step "
                                                             f"{verified.get('step')}, but job {job_id}'s step is "
                                                             f"{found.trainer_step + 1} (the trainer was at "
                                                             f"{found.trainer_step} when it was called); nothing "
                                                             f"was written", "checkpoint_path")

        async def write(tx: WriteTx) -> str:
            row = await resolve_job(tx, job_id, body.decision, reason=body.reason,
                                    checkpoint_path=body.checkpoint_path,
                                    verified_step=None if verified is None else verified.get("step"))
            return row.state
        was = await operate(write, job_id)
        state = {"ran": "CHECKPOINT", "not_run": "RUNNING", "abandon": "FAILED"}[body.decision]
        return web.json_response({"job_id": job_id, "decision": body.decision, "state": state, "was": was,
                                  "checkpoint": verified}, status=202)

    async def reject(request: web.Request) -> web.Response:
        body = await read_body(request, RejectJob)
        training()
        job_id = request.match_info["id"]

        async def write(tx: WriteTx) -> str:
            return (await reject_job(tx, job_id, reason=body.reason)).state
        was = await operate(write, job_id)
        return web.json_response({"job_id": job_id, "state": "REJECTING", "was": was}, status=202)

    async def acknowledge(request: web.Request) -> web.Response:
        body = await read_body(request, AcknowledgeJob)
        training()
        job_id = request.match_info["id"]

        async def write(tx: WriteTx) -> str:
            return (await acknowledge_job(tx, job_id, reason=body.reason)).state
        was = await operate(write, job_id)
        return web.json_response({"job_id": job_id, "state": "READY_TO_COMMIT", "verdict": "commit", "was": was},
                                 status=202)

    def lister(kind: str, key: str, order: tuple[str, ...], shape: Callable[[Mapping[Any, Any]], dict[str, Any]]
               ) -> Handler:
        return list_rows(orch.journal, kind, key, lambda row, _now: shape(row), orch.clock.now, order=order)

    async def job_get(request: web.Request) -> web.Response:
        no_query(request.query)
        job_id = request.match_info["id"]
        async with orch.journal.read(snapshot=True) as conn:
            row = (await conn.execute(sa.select(t).where(t.c.id == job_id))).first()
            if row is None:
                raise ApiError(404, "not_found", f"no training job {job_id!r}")
            history, omitted = await job_history(conn, job_id)
            target = row._mapping["target_load_id"]
            version = None if target is None else (await conn.execute(sa.select(v).where(v.c.id == target))).first()
        out = job_json(row._mapping, job_end)
        out["phases"] = phases(history, job_end, orch.clock.now())
        out["history"] = [history_json(ev) for ev in history]
        out["history_omitted"] = omitted
        out["publication"] = None if version is None else row_json(version._mapping)
        return web.json_response(out)

    async def publication_get(request: web.Request) -> web.Response:
        no_query(request.query)
        load_id = request.match_info["load_id"]
        async with orch.journal.read(snapshot=True) as conn:
            row = (await conn.execute(sa.select(v).where(v.c.id == load_id))).first()
            if row is None:
                raise ApiError(404, "not_found", f"no published version {load_id!r}")
            job_id = row._mapping["job_id"]
            job = None if job_id is None else await job_summary(conn, job_id)
            served = (await conn.execute(sa.select(g.c.id).where(
                g.c.deployment == row._mapping["deployment"], g.c.serving_version == load_id,
                g.c.state != "retired").order_by(g.c.id))).scalars().all()
        out = row_json(row._mapping)
        out["job"] = job
        out["served_by"] = list(served)
        return web.json_response(out)

    async def batch_get(request: web.Request) -> web.Response:
        no_query(request.query)
        batch = request.match_info["id"]
        b = models.training_batches
        async with orch.journal.read(snapshot=True) as conn:
            row = (await conn.execute(sa.select(b).where(b.c.id == batch))).first()
            if row is None:
                raise ApiError(404, "not_found", f"no training batch {batch!r}")
            job_id = row._mapping["job_id"]
            job = None if job_id is None else await job_summary(conn, job_id)
        out = row_json(row._mapping)
        out["job"] = job
        return web.json_response(out)

    async def engines(request: web.Request) -> web.Response:
        no_query(request.query)
        async with orch.journal.read() as conn:
            rows = (await conn.execute(sa.select(g).order_by(g.c.deployment, g.c.id))).all()
        return web.json_response({"engines": [row_json(r._mapping) for r in rows]})

    def summary(m: Mapping[Any, Any]) -> dict[str, Any]:
        return job_json(m, job_end, payload=False)

    app.router.add_post("/v1/jobs", mutating(handled(submit)))
    app.router.add_get("/v1/jobs", handled(lister(JOBS, "jobs", ("created_at", "id"), summary)))
    app.router.add_get("/v1/jobs/{id}", handled(job_get))
    app.router.add_post("/v1/jobs/{id}/resolve", mutating(handled(resolve)))
    app.router.add_post("/v1/jobs/{id}/reject", mutating(handled(reject)))
    app.router.add_post("/v1/jobs/{id}/acknowledge", mutating(handled(acknowledge)))
    app.router.add_get("/v1/publications", handled(lister(VERSIONS, "publications",
                                                        ("created_at", "sequence", "id"), row_json)))
    app.router.add_get("/v1/publications/{load_id}", handled(publication_get))
    app.router.add_get("/v1/engines", handled(engines))
    app.router.add_get("/v1/batches", handled(lister(BATCHES, "batches", ("created_at", "number", "id"), row_json)))
    app.router.add_get("/v1/batches/{id}", handled(batch_get))


__all__ = ["REFUSALS", "AcknowledgeJob", "RejectJob", "ResolveJob", "SubmitJob", "add_training_routes"]
