"""The discovery family as registered: the ``participants`` kind, its controller, the configured
participants synced on every election, ``GET /v1/participants`` and ``POST /v1/participants/probe``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from aiohttp import web

from journal import EntityKind, WriteTx, machines, models

from engine.config import DiscoverySettingsModel
from engine.http.shell import ApiError, Handler, typed
from engine.runtime.workflow import Deps, Parts, Workflow, register
from engine.workflows.discovery.controller import DiscoveryController, DiscoverySettings, sync_configured

if TYPE_CHECKING:
    from engine.runtime.service import Orchestrator

NAME = "discovery"


def build(deps: Deps) -> Parts:
    ds = deps.settings.discovery
    controller = DiscoveryController(deps.rpc, DiscoverySettings(
        ds.probe_timeout_s, ds.probe_tries, ds.interval_s, ds.max_backoff_s), deps.metrics)
    configured = {p.name: p.url for p in deps.settings.participants}

    async def sync(tx: WriteTx) -> list[str]:
        return await sync_configured(tx, configured)

    return Parts(controllers=[controller], on_elected=[sync], handle=controller)


def participant_json(m: Any) -> dict[str, Any]:
    return {"name": m["id"], "url": m["url"], "health": m["state"], "kind": m["kind"],
            "instance": m["instance"], "phase": m["phase"], "detail": m["detail"],
            "probe_failures": m["probe_failures"], "version": m["version"],
            "last_probe_at": m["last_probe_at"].isoformat() if m["last_probe_at"] else None,
            "updated_at": m["updated_at"].isoformat()}


def routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    """``GET /v1/participants`` (every row, by name) and ``POST /v1/participants/probe[?name=N]`` (queue
    a probe of one or every configured participant)."""

    async def participants(_: web.Request) -> web.Response:
        t = models.participants
        async with orch.journal.read() as conn:
            rows = (await conn.execute(sa.select(t).order_by(t.c.id))).all()
        return web.json_response({"participants": [participant_json(r._mapping) for r in rows]})

    async def probe(request: web.Request) -> web.Response:
        name = request.query.get("name")
        t = models.participants
        async with orch.journal.read() as conn:
            stmt = sa.select(t.c.id).where(t.c.state != "removed")
            if name is not None:
                stmt = stmt.where(t.c.id == name)
            names = list((await conn.execute(stmt)).scalars())
        if name is not None and not names:
            raise ApiError(404, "not_found", f"no configured participant named {name!r}")
        controller = orch.handle(NAME)
        # A probe is a read: the request only queues it; the controller records what it finds.
        if not isinstance(controller, DiscoveryController):
            raise ApiError(404, "not_found", "discovery is not running in this orchestrator")
        for n in names:
            controller.request_probe(n)
            orch.reconciler.enqueue("participants", n)
        return web.json_response({"queued": names}, status=202)

    app.router.add_get("/v1/participants", participants)
    app.router.add_post("/v1/participants/probe", mutating(typed(probe)))


WORKFLOW = register(Workflow(
    NAME, kinds=(EntityKind("participants", models.participants, machines.PARTICIPANTS),),
    build=build, routes=routes, settings=DiscoverySettingsModel, builtin_section=True))

__all__ = ["NAME", "WORKFLOW", "participant_json"]
