"""``GET /v1/services[/{name}]`` (the rows and the stack's state) and ``POST /v1/services/up|down``
(what the operator wants; the owning stack acts on it and its rows say how it went)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from aiohttp import web

from journal import models

from engine.http.shell import ApiError, Handler, typed
from engine.workflows.deployment.rows import as_json

if TYPE_CHECKING:
    from engine.runtime.service import Orchestrator
    from engine.workflows.deployment.stack import Stack

NAME = "deployment"


def _stack(orch: Orchestrator) -> Stack | None:
    stack: Stack | None = orch.handle(NAME)
    return stack


def add_routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    async def listing(_: web.Request) -> web.Response:
        stack = _stack(orch)
        # The stack's state first, then the rows: a row is written before the state that follows from
        # it, so the rows read next are never older than the state shown ("ready" with a row still
        # "starting" cannot be seen).
        state = None if stack is None or not orch.is_leader else {"state": stack.state, "reason": stack.not_ready()}
        t = models.services
        async with orch.journal.read() as conn:
            found = (await conn.execute(sa.select(t).order_by(t.c.created_at, t.c.id))).all()
        order = list(stack.plan.order) if stack is not None else []
        body: dict[str, Any] = {"declared": order, "stack": state, "services": [as_json(r._mapping) for r in found]}
        return web.json_response(body)

    async def one(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        t = models.services
        async with orch.journal.read() as conn:
            found = (await conn.execute(sa.select(t).where(t.c.id == name))).first()
        if found is None:
            raise ApiError(404, "not_found", f"no service named {name!r}")
        return web.json_response(as_json(found._mapping))

    def request(want: str) -> Handler:
        async def handler(_: web.Request) -> web.Response:
            stack = _stack(orch)
            if stack is None:
                raise ApiError(404, "no_stack", "this orchestrator runs no stack (deployment.services is empty)")
            stack.request("up" if want == "up" else "down")
            return web.json_response({"requested": want, "services": list(stack.plan.order)}, status=202)
        return handler

    app.router.add_get("/v1/services", listing)
    app.router.add_get("/v1/services/{name}", typed(one))
    app.router.add_post("/v1/services/up", mutating(typed(request("up"))))
    app.router.add_post("/v1/services/down", mutating(typed(request("down"))))
