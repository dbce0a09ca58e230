"""The deployment family as registered: the ``services`` kind, the ``deployment`` section, the stack
supervisor (built when ``deployment.services`` declares any; it runs while this orchestrator leads,
is stopped in order before the orchestrator lets go, and holds ``/readyz`` until the stack is
ready), ``GET /v1/services``, ``POST /v1/services/up|down`` and ``tidelog up|down|services``."""

from __future__ import annotations

from journal import EntityKind, machines, models

from engine.runtime.workflow import Deps, Parts, Workflow, register
from engine.workflows.deployment.api import NAME, add_routes
from engine.workflows.deployment.cli import add_commands
from engine.workflows.deployment.plan import Plan
from engine.config.deployment import DeploymentSettingsModel
from engine.workflows.deployment.stack import Stack


def build(deps: Deps) -> Parts | None:
    settings: DeploymentSettingsModel = deps.settings.deployment
    if not settings.services:
        return None
    assert deps.write is not None, "the stack writes its rows through the leader's fenced write"
    t = deps.settings.training
    engines = {e.name: e.url for e in t.engines} if t.enabled else None
    stack = Stack(Plan.build(settings, engines=engines, deployment=t.deployment), deps.holder, deps.clock,
                  deps.read, rebuilt=deps.rebuilt)
    write = deps.write

    async def run() -> None:
        await stack.run(write)

    async def lost() -> None:
        stack.kill_all()

    return Parts(run=run, before_stop=stack.stop_gracefully, not_ready=stack.held, on_lost=lost,
                 handle=stack, replace_engine=stack.replace_engine)


WORKFLOW = register(Workflow(
    NAME, kinds=(EntityKind("services", models.services, machines.SERVICES),),
    build=build, routes=add_routes, commands=add_commands, settings=DeploymentSettingsModel, builtin_section=True))

__all__ = ["NAME", "WORKFLOW"]
