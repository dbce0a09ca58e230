"""The orchestrator's HTTP API (aiohttp).

Reads are open and answered by any replica (straight from the journal);
mutating routes need ``Authorization: Bearer <control token>`` (compared in
constant time) and are answered only by the leader. Every error is
``{"error": {"code", "detail"}}`` with a specific code: ``invalid_query`` (400,
naming the parameter, the value and the rule), ``invalid_body`` (422, naming
the field, the value and the rule; also ``"field"``), ``unauthorized`` (401),
``not_found`` (404), ``checkpoint_open``, ``restore_open``,
``no_participants``, ``already_exists``, ``not_abortable``, ``job_conflict``,
``job_closed``, ``job_state`` (409), ``checkpoint_unverified`` (422),
``not_leader``, ``workflow_unavailable``, ``training_disabled`` and
``trainer_unavailable`` (503); ``directory_refused`` (422), ``checkpoint_not_published`` and
``checkpoint_mismatch`` (409); and, from :mod:`workers.http_limits`, ``request_too_large``
(413), ``body_timeout`` (408), ``method_not_allowed`` (405). No input is answered 500
(docs/security.md): a NUL in the path or the query is refused by :func:`refuse_nul`.

Every registered workflow adds its own routes (``Workflow.routes``, :mod:`engine.runtime.workflow`):
discovery ``GET /v1/participants`` and ``POST /v1/participants/probe``; the checkpoint workflows (checkpoints, restores, retire,
forget) in :mod:`engine.workflows.checkpoint.api`; training (jobs, publications, engines) in
:mod:`engine.workflows.training.api`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from journal import audit, lease
from workers.http_limits import limits_middleware

from engine.http.query import entity_counts, event_json, parse_event_filter, single_values
from engine.http.shell import Handler, bearer_matches, error, refuse_nul, typed
from engine.runtime.leader import LEASE_NAME
from engine.runtime.service import Orchestrator

ORCH: web.AppKey[Orchestrator] = web.AppKey("orchestrator", Orchestrator)


def make_app(orch: Orchestrator) -> web.Application:
    token = orch.settings.token()

    def mutating(handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            if not bearer_matches(request.headers.get("Authorization", ""), token):
                return error(401, "unauthorized", "missing or wrong bearer token")
            if not orch.is_leader:
                current = await lease.read_lease(orch.journal, LEASE_NAME)
                who = f"{current.holder} (epoch {current.epoch})" if current else "nobody"
                return error(503, "not_leader", f"this orchestrator is a standby; the leader is {who}")
            return await handler(request)
        return wrapped

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(_: web.Request) -> web.Response:
        try:
            revision = await orch.check_schema()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return web.json_response({"ready": False, "reason": str(exc)}, status=503)
        if not orch.working():
            return web.json_response({"ready": False, "reason": "a leader loop is not running; stepping down"},
                                     status=503)
        why = await orch.not_ready() if orch.is_leader else None
        if why:
            return web.json_response({"ready": False, "reason": why}, status=503)
        return web.json_response({"ready": True, "schema": revision, "leader": orch.is_leader})

    async def metrics(_: web.Request) -> web.Response:
        m = orch.metrics
        counts = await entity_counts(orch.journal)  # read first: no await between clear and set
        m.queue_depth.set(len(orch.reconciler.queue))
        m.commits.set(orch.committer.commits)
        m.writes.set(orch.committer.writes)
        m.set_entities(counts)
        return web.Response(body=m.render(), headers={"Content-Type": m.content_type,
                                                      "X-Content-Type-Options": "nosniff"})

    async def status(_: web.Request) -> web.Response:
        return web.json_response(await status_snapshot(orch))

    async def events(request: web.Request) -> web.Response:
        flt = parse_event_filter(single_values(request.query), orch.journal.kinds)  # QueryError: typed answers 400
        async with orch.journal.read() as conn:
            page = await audit.query_events(conn, flt)
        nxt = page[-1]["seq"] if len(page) == flt.limit else None
        return web.json_response({"events": [event_json(e) for e in page], "next_after": nxt})

    app = web.Application(middlewares=[limits_middleware(orch.settings.api.body_timeout_s), refuse_nul])
    app[ORCH] = orch
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/events", typed(events))
    for workflow in orch.workflows:
        if workflow.routes is not None:
            workflow.routes(app, orch, mutating)
    return app


async def status_snapshot(orch: Orchestrator) -> dict[str, Any]:
    current = await lease.read_lease(orch.journal, LEASE_NAME)
    counts = await entity_counts(orch.journal)
    return {
        "holder": orch.holder,
        "role": "leader" if orch.is_leader else "standby",
        "lease": None if current is None else {"holder": current.holder, "epoch": current.epoch,
                                               "expires_at": current.expires_at.isoformat()},
        "journal": {"backend": orch.journal.backend, "url": orch.journal.url.redacted()},
        "entities": counts,
        "queue": {"depth": len(orch.reconciler.queue), "active": orch.reconciler.queue.active,
                  "timers": orch.reconciler.queue.timers},
        "rpc_in_flight": orch.dispatcher.in_flight,
    }


__all__ = ["ORCH", "make_app", "status_snapshot"]
