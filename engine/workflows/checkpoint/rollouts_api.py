"""The rollout routes.

- ``POST /v1/rollouts`` ``{"tasks": [{"rollout_id"?, "input", "labels"?}, ...]}`` (1..10,000 tasks)
  -> 201 when any task is new, 200 when every one was already recorded with the same input:
  ``{"submitted", "new", "existing", "rollouts": [{"id", "disposition"}]}``. Refused, with nothing
  written: 422 ``invalid_body`` naming ``tasks[i].<field>``, its value and the rule (a reserved
  ``-a<N>`` suffix also says which attempt of which rollout it would name, as ``attempt`` and
  ``rollout``); 409 ``rollout_conflict`` for an id already recorded (or named earlier in the batch)
  with another input (``rollout_id``, ``index``); 503 ``workflow_unavailable`` when this
  orchestrator runs no rollout controller.
- ``GET /v1/rollouts[?state=&limit=&before=]``: newest first, without inputs and results (paged by
  ``next_before``).
- ``GET /v1/rollouts/{id}``: the row with its input, result and labels, its ``phases`` and its
  ``history`` (every event: each attempt, where it was sent, why it ended).

Reads come from the journal, so any replica answers them; the POST needs the token and the leader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import sqlalchemy as sa
from aiohttp import web
from pydantic import Field

from journal import WriteTx, audit, models
from journal.audit import EventFilter

from engine.http.listing import lister
from engine.http.query import no_query
from engine.http.shell import ApiError, Body, Handler, Refusals, phases, read_body, row_json, shown, typed
from engine.workflows.checkpoint.rollout_tasks import (MAX_BATCH, InvalidTask, ReservedSuffix, RolloutConflict, check_task,
                                             submit_rollouts)

if TYPE_CHECKING:  # annotations only: the service builds the families
    from engine.runtime.service import Orchestrator

KIND = "rollouts"
#: Columns a listing leaves out (they may be large; ``GET /v1/rollouts/{id}`` has them).
LIST_OMITS = ("task", "result")


class SubmitRollouts(Body):
    """``POST /v1/rollouts``: the tasks, checked one by one by :func:`~engine.workflows.checkpoint.rollout_tasks.check_task`."""

    tasks: Annotated[list[Any], Field(min_length=1, max_length=MAX_BATCH)]


def _invalid(exc: InvalidTask) -> ApiError:
    where = f"tasks[{exc.index}].{exc.field}" if exc.index is not None else exc.field
    extra: dict[str, Any] = {}
    if isinstance(exc, ReservedSuffix):
        extra = {"attempt": exc.attempt, "rollout": exc.rollout}
    return ApiError(422, "invalid_body", f"{where}={shown(exc.value)}: {exc.rule}", where, **extra)


REFUSALS: Refusals = {
    InvalidTask: _invalid,
    RolloutConflict: lambda exc: ApiError(409, "rollout_conflict", str(exc), rollout_id=exc.rollout_id,
                                          index=exc.index),
}


def rollout_json(mapping: Mapping[Any, Any], terminal: frozenset[str], *, full: bool = True) -> dict[str, Any]:
    out = row_json(mapping)
    if not full:
        for name in LIST_OMITS:
            out.pop(name, None)
    out["terminal"] = mapping["state"] in terminal
    return out


def add_rollout_routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    """Register the rollout routes; ``mutating`` is the API's token-and-leader guard."""
    terminal = orch.journal.kinds.get(KIND).machine.terminal
    t = models.rollouts

    def handled(handler: Handler) -> Handler:
        return typed(handler, REFUSALS)

    async def submit(request: web.Request) -> web.Response:
        body = await read_body(request, SubmitRollouts)
        tasks = [check_task(raw, i) for i, raw in enumerate(body.tasks)]
        if KIND not in orch.reconciler.controllers:
            raise ApiError(503, "workflow_unavailable", "this orchestrator runs no rollouts controller, so nothing "
                                                        "would dispatch them; nothing was written")

        async def write(tx: WriteTx) -> list[Any]:
            return await submit_rollouts(tx, tasks)
        done = await orch.committer.run(write)
        new = sum(1 for s in done if s.disposition == "new")
        return web.json_response({"submitted": len(done), "new": new, "existing": len(done) - new,
                                  "rollouts": [{"id": s.rollout_id, "disposition": s.disposition} for s in done]},
                                 status=201 if new else 200)

    def shape(row: Mapping[Any, Any], _now: datetime) -> dict[str, Any]:
        return rollout_json(row, terminal, full=False)

    async def show(request: web.Request) -> web.Response:
        no_query(request.query)
        rollout_id = request.match_info["id"]
        async with orch.journal.read(snapshot=True) as conn:
            row = (await conn.execute(sa.select(t).where(t.c.id == rollout_id))).first()
            if row is None:
                raise ApiError(404, "not_found", f"no rollout {rollout_id!r}")
            history = await audit.query_events(conn, EventFilter(entity_kind=KIND, entity_id=rollout_id,
                                                                 limit=audit.MAX_PAGE))
        now = orch.clock.now()
        out = rollout_json(row._mapping, terminal)
        out["phases"] = phases(history, terminal, now)
        out["history"] = [{"seq": ev["seq"], "at": ev["ts"].isoformat(), "from_state": ev["from_state"],
                           "to_state": ev["to_state"], "reason": ev["reason"], "epoch": ev["epoch"]}
                          for ev in history]
        return web.json_response(out)

    app.router.add_post("/v1/rollouts", mutating(handled(submit)))
    app.router.add_get("/v1/rollouts", handled(lister(orch.journal, KIND, KIND, shape, orch.clock.now)))
    app.router.add_get("/v1/rollouts/{id}", handled(show))


__all__ = ["REFUSALS", "SubmitRollouts", "add_rollout_routes", "rollout_json"]
