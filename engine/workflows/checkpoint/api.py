"""The checkpoint workflows' routes (split from :mod:`engine.http.app`): checkpoints, restores, retire, forget.

- ``POST /v1/checkpoints`` ``{"checkpoint_id"?, "directory"?}`` -> 202 ``{"checkpoint_id", "directory",
  "participants"}``; 409 ``checkpoint_open``/``restore_open`` naming the open one, ``already_exists``,
  ``no_participants``, ``membership_incomplete`` (a configured participant is not healthy: a
  checkpoint covers every one; ``missing`` names each with its state).
- ``GET /v1/checkpoints[?state=&limit=&before=]`` (newest first, paged by ``before``: ``next_before`` in
  the reply) and ``GET /v1/checkpoints/{id}`` (the row, ``members`` with state, report, blockers,
  manifest and detail, and ``timings``: seconds per state, in the current one, in all, and the
  ``phases`` the events show).
- ``POST /v1/checkpoints/{id}/abort`` ``{"reason"?}``: ``aborting`` from preparing, prepared, committing
  or committed (a compare-and-set from the row's state and version); 409 ``not_abortable`` otherwise.
- ``POST /v1/restores`` ``{"checkpoint_id"?, "directory"?}`` -> 202 ``{"restore_id", "checkpoint_id",
  ...}``; 404 when the checkpoint is not published there; 409 ``membership_mismatch`` unless the
  participants are the checkpoint's members by name and kind, each healthy (``missing``, ``extra``,
  ``kinds``). ``GET /v1/restores[/{id}]``.
- ``POST /v1/rollouts/{id}/retire`` ``{"attempt"}`` and ``POST /v1/rollouts/{id}/forget`` -> 202
  ``{"retirement_id", ...}``. ``GET /v1/retirements[/{id}]``.

A POST is one fenced write through the group committer that creates the row (or moves it); the
reconciler does the rest. Bodies are validated by pydantic models that forbid extra fields; a
refusal is a typed error naming the field, the value and the rule, and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import sqlalchemy as sa
from aiohttp import web
from pydantic import Field, StringConstraints, ValidationError

from journal import DuplicateEntity, StaleRow, WriteTx, audit, models
from journal.audit import EventFilter
from journal.writes import to_row
from workers.protocol import CheckpointId, EpisodeId

from engine.http.listing import lister as list_rows
from engine.http.query import no_query
from engine.http.shell import (ApiError, Body, Directory, Handler, Refusals, iso, new_id, phases, read_body,
                               row_json, shown, typed)
from engine.workflows.checkpoint.checkpoint import STAGES, start_checkpoint
from engine.workflows.checkpoint.confined import DirectoryRefused, confine, roots
from engine.workflows.checkpoint.confined import run as run_file_work
from engine.workflows.checkpoint.restore import CheckpointNotFound, read_latest, read_manifest, start_restore
from engine.workflows.checkpoint.retirement import InvalidRetirement, request_retirement
from engine.workflows.checkpoint.rules import (ABORTABLE, CheckpointMismatch, MembershipIncomplete, MembershipMismatch,
                                               NoSuchCheckpoint, NotAbortable, NotPublished, WorkflowOpen,
                                               abort_checkpoint, check_directory, check_manifest, checkpoint_members,
                                               published_checkpoint, refuse_while_open, restore_members)
from engine.workflows.checkpoint.names import STAGE_NAMES, TERMINAL

if TYPE_CHECKING:  # annotations only: the service builds the families
    from engine.runtime.service import Orchestrator



class StartCheckpoint(Body):
    """``POST /v1/checkpoints``: the id (default ``ck-<UTC time>-<4 hex>``) and the root directory
    (default ``checkpoint.directory``)."""

    checkpoint_id: CheckpointId | None = None
    directory: Directory | None = None


class StartRestore(Body):
    """``POST /v1/restores``: the checkpoint (default: the one ``LATEST`` names) and its root directory."""

    checkpoint_id: CheckpointId | None = None
    directory: Directory | None = None


#: The highest attempt number a request may name (a participant keeps attempts as 64-bit integers).
MAX_ATTEMPT = 2**31 - 1


class Retire(Body):
    """``POST /v1/rollouts/{id}/retire``: retire this attempt of the rollout (and every earlier one)."""

    attempt: int = Field(ge=0, le=MAX_ATTEMPT, strict=True)


class Forget(Body):
    """``POST /v1/rollouts/{id}/forget``: no fields (an empty body or ``{}``)."""


class Abort(Body):
    """``POST /v1/checkpoints/{id}/abort``: an optional reason, kept in the checkpoint's ``detail``."""

    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)] | None = None


#: The states in which a row's ``stage`` names where it is (checkpoints: preparing; retirements: running).
STAGED = ("preparing", "running")


def stage_name(kind: str, stage: int | None) -> str | None:
    """The name of a workflow's stage index (checkpoints: prepare stages; retirements: retire order)."""
    names = STAGE_NAMES.get(kind)
    if names is None or stage is None or not 0 <= stage < len(names):
        return None
    return names[stage]


def timings_json(kind: str, row: Mapping[Any, Any], now: datetime) -> dict[str, Any]:
    """Seconds per finished state (the row's ``timings``), in the current state, and in all."""
    terminal = row["state"] in TERMINAL[kind]
    end = row["updated_at"] if terminal else now
    return {"per_state_s": row.get("timings") or {}, "created_at": iso(row["created_at"]),
            "updated_at": iso(row["updated_at"]),
            "in_state_s": None if terminal else round((now - row["updated_at"]).total_seconds(), 3),
            "total_s": round((end - row["created_at"]).total_seconds(), 3)}


def phases_json(kind: str, history: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """Each state (and stage, while staged) the row passed through, from its events: when it began
    and for how long."""
    def stage(state: str, index: int | None) -> str | None:
        return stage_name(kind, index) if state in STAGED else None
    return phases(history, TERMINAL[kind], now, stage)


def workflow_json(kind: str, row: Mapping[Any, Any], now: datetime) -> dict[str, Any]:
    out = row_json(row)
    if "stage" in row:
        out["stage_name"] = stage_name(kind, row["stage"]) if row["state"] in STAGED else None
    out["terminal"] = row["state"] in TERMINAL[kind]
    out["timings"] = timings_json(kind, row, now)
    return out


#: The checkpoint family's refusals (the shell answers the shared ones).
REFUSALS: Refusals = {
    WorkflowOpen: lambda exc: ApiError(409, "checkpoint_open" if exc.kind == "checkpoints" else "restore_open",
                                       str(exc)),
    NoSuchCheckpoint: lambda exc: ApiError(404, "not_found", str(exc), exc.field),
    NotPublished: lambda exc: ApiError(409, "checkpoint_not_published", str(exc), "checkpoint_id"),
    CheckpointMismatch: lambda exc: ApiError(409, "checkpoint_mismatch", str(exc), exc.field),
    NotAbortable: lambda exc: ApiError(409, "not_abortable", str(exc)),
    MembershipIncomplete: lambda exc: ApiError(409, "membership_incomplete", str(exc), missing=exc.missing),
    MembershipMismatch: lambda exc: ApiError(409, "membership_mismatch", str(exc), "checkpoint_id",
                                             missing=exc.missing, extra=exc.extra,
                                             kinds={k: list(v) for k, v in exc.kinds.items()}),
    InvalidRetirement: lambda exc: ApiError(422, "invalid_body", str(exc), exc.field),
}


def member_json(mapping: Mapping[Any, Any]) -> dict[str, Any]:
    out = row_json(mapping)
    out["blockers"] = list(((mapping["report"] or {}).get("blockers")) or [])
    return out


def rollout_episode(rollout_id: str, attempt: int = 0) -> EpisodeId:
    try:
        return EpisodeId(rollout_id=rollout_id, attempt=attempt)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ApiError(422, "invalid_body", f"{where}={shown(err.get('input'))}: {err['msg']}", where) from None


def add_workflow_routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    """Register the workflow routes; ``mutating`` is the API's token-and-leader guard."""

    def controlled(kind: str) -> None:
        if kind not in orch.reconciler.controllers:
            raise ApiError(503, "workflow_unavailable", f"this orchestrator runs no {kind} controller, so nothing "
                                                        f"would advance the request; nothing was written")

    allowed = roots(orch.settings.checkpoint.directory, orch.settings.checkpoint.roots)

    def directory_of(given: str | None) -> str:
        """The real path of the directory a request names (default: ``checkpoint.directory``), confined
        to the configured roots. Absolute: participants and the orchestrator need not share a
        working directory."""
        if given is None:
            return allowed[0]
        try:
            return confine(given, allowed)
        except DirectoryRefused as exc:
            raise ApiError(422, "directory_refused", f"directory={exc}", "directory") from None

    async def checkpoints_start(request: web.Request) -> web.Response:
        body = await read_body(request, StartCheckpoint)
        controlled("checkpoints")
        cid = body.checkpoint_id or new_id("ck", orch.clock.now())
        directory = directory_of(body.directory)
        p = models.participants

        async def write(tx: WriteTx) -> list[str]:
            await refuse_while_open(tx)
            existing = await tx.get("checkpoints", cid)
            if existing is not None:
                raise ApiError(409, "already_exists", f"checkpoint {cid!r} already exists (state {existing.state}); "
                                                      f"give another checkpoint_id", "checkpoint_id")
            rows = [to_row("participants", r._mapping)
                    for r in (await tx.execute(sa.select(p).order_by(p.c.id))).all()]
            members = [r for r in rows if r.state == "healthy" and r["kind"] in STAGES]
            if members:
                await checkpoint_members(tx)
            if not members:
                seen = ", ".join(f"{r.id} is {r.state}" for r in rows if r.state != "removed")
                raise ApiError(409, "no_participants", "no healthy participant to checkpoint "
                                                       f"({seen or 'none is configured'})")
            await start_checkpoint(tx, cid, directory, members, max_tries=orch.settings.checkpoint.max_tries)
            return [m.id for m in members]
        try:
            members = await orch.committer.run(write)
        except DuplicateEntity:
            raise ApiError(409, "already_exists", f"checkpoint {cid!r} already exists", "checkpoint_id") from None
        return web.json_response({"checkpoint_id": cid, "directory": directory, "participants": members},
                                 status=202, headers={"Location": f"/v1/checkpoints/{cid}"})

    async def checkpoint_abort(request: web.Request) -> web.Response:
        body = await read_body(request, Abort)
        cid = request.match_info["id"]
        resume_s = orch.settings.checkpoint.resume_timeout_s

        async def write(tx: WriteTx) -> str:
            return await abort_checkpoint(tx, cid, reason=body.reason, resume_deadline_ts=orch.clock.time() + resume_s)
        try:
            was = await orch.committer.run_fresh(write)
        except StaleRow:  # the controller moved it each time we looked
            raise ApiError(409, "not_abortable", f"checkpoint {cid!r} kept changing; try again") from None
        return web.json_response({"checkpoint_id": cid, "state": "aborting", "was": was}, status=202)

    async def restores_start(request: web.Request) -> web.Response:
        body = await read_body(request, StartRestore)
        controlled("restores")
        given = None if body.directory is None else directory_of(body.directory)
        cid = body.checkpoint_id
        if cid is None:
            given = given or allowed[0]
            try:
                cid = await run_file_work(read_latest, given)
            except (CheckpointNotFound, TimeoutError):
                # One answer whatever is there (nothing, a FIFO, garbage): a refusal reveals no paths.
                raise ApiError(404, "not_found", "no published checkpoint is named by LATEST in the directory; "
                                                 "give checkpoint_id", "checkpoint_id") from None
        async with orch.journal.read(snapshot=True) as conn:
            published = await published_checkpoint(conn, cid)
        directory = directory_of(published.directory)
        check_directory(published, directory, given)
        try:
            manifest = await run_file_work(read_manifest, directory, cid)
        except (CheckpointNotFound, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, CheckpointNotFound) else "reading it timed out"
            raise CheckpointMismatch(f"checkpoint {cid!r} is published in the journal but its manifest cannot be "
                                     f"used: {reason}", "checkpoint_id") from None
        check_manifest(published, manifest)
        scope = list(manifest["scope"])
        rid = new_id("rs", orch.clock.now())

        async def write(tx: WriteTx) -> None:
            await refuse_while_open(tx)
            await restore_members(tx, cid)
            await start_restore(tx, rid, directory, cid, scope)
        await orch.committer.run(write)
        return web.json_response({"restore_id": rid, "checkpoint_id": cid, "directory": directory,
                                  "episodes": len(scope)}, status=202, headers={"Location": f"/v1/restores/{rid}"})

    def retirement(op: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            if op == "retire":
                attempt: int | None = (await read_body(request, Retire)).attempt
                episode = rollout_episode(request.match_info["id"], attempt or 0)
            else:
                await read_body(request, Forget)
                attempt, episode = None, rollout_episode(request.match_info["id"])
            controlled("retirements")
            rid = new_id("rt" if op == "retire" else "fg", orch.clock.now())

            async def write(tx: WriteTx) -> None:
                if op == "retire":
                    await request_retirement(tx, rid, "retire", episodes=[episode])
                else:
                    await request_retirement(tx, rid, "forget", rollout_ids=[episode.rollout_id])
            await orch.committer.run(write)
            return web.json_response({"retirement_id": rid, "op": op, "rollout_id": episode.rollout_id,
                                      "attempt": attempt}, status=202,
                                     headers={"Location": f"/v1/retirements/{rid}"})
        return handler

    def lister(kind: str, key: str) -> Handler:
        def shape(row: Mapping[Any, Any], now: datetime) -> dict[str, Any]:
            return workflow_json(kind, row, now)
        return list_rows(orch.journal, kind, key, shape, orch.clock.now)

    def getter(kind: str) -> Handler:
        t = orch.journal.kinds.get(kind).table
        m = models.checkpoint_members

        async def handler(request: web.Request) -> web.Response:
            no_query(request.query)
            entity_id = request.match_info["id"]
            async with orch.journal.read(snapshot=True) as conn:
                row = (await conn.execute(sa.select(t).where(t.c.id == entity_id))).first()
                if row is None:
                    raise ApiError(404, "not_found", f"no {kind} row {entity_id!r}")
                members = [] if kind != "checkpoints" else (await conn.execute(
                    sa.select(m).where(m.c.checkpoint_id == entity_id).order_by(m.c.stage, m.c.participant))).all()
                history = await audit.query_events(conn, EventFilter(entity_kind=kind, entity_id=entity_id,
                                                                     limit=audit.MAX_PAGE))
            now = orch.clock.now()
            out = workflow_json(kind, row._mapping, now)
            out["timings"]["phases"] = phases_json(kind, history, now)
            if kind == "checkpoints":
                out["members"] = [member_json(r._mapping) for r in members]
            return web.json_response(out)
        return handler

    app.router.add_get("/v1/checkpoints", typed(lister("checkpoints", "checkpoints"), REFUSALS))
    app.router.add_post("/v1/checkpoints", mutating(typed(checkpoints_start, REFUSALS)))
    app.router.add_get("/v1/checkpoints/{id}", typed(getter("checkpoints"), REFUSALS))
    app.router.add_post("/v1/checkpoints/{id}/abort", mutating(typed(checkpoint_abort, REFUSALS)))
    app.router.add_get("/v1/restores", typed(lister("restores", "restores"), REFUSALS))
    app.router.add_post("/v1/restores", mutating(typed(restores_start, REFUSALS)))
    app.router.add_get("/v1/restores/{id}", typed(getter("restores"), REFUSALS))
    app.router.add_get("/v1/retirements", typed(lister("retirements", "retirements"), REFUSALS))
    app.router.add_get("/v1/retirements/{id}", typed(getter("retirements"), REFUSALS))
    app.router.add_post("/v1/rollouts/{id}/retire", mutating(typed(retirement("retire"), REFUSALS)))
    app.router.add_post("/v1/rollouts/{id}/forget", mutating(typed(retirement("forget"), REFUSALS)))


__all__ = ["ABORTABLE", "REFUSALS", "ApiError", "StartCheckpoint", "StartRestore", "Retire", "Forget", "Abort",
           "add_workflow_routes", "stage_name"]
