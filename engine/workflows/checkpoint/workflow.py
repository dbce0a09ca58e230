"""The checkpoint family as registered: its kinds (checkpoints and their members, rollouts,
restores, retirements), the checkpoint, restore, retirement and rollout controllers from the
``checkpoint`` and ``rollouts`` sections, its routes and commands, and the stage names of its staged
rows. Rollouts live here because every workflow of the family acts on them: a checkpoint's scope
is built from them, a restore continues them, retire and forget end them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from journal import EntityKind, machines, models

from engine.runtime.reconciler import Controller
from engine.runtime.workflow import Command, Deps, Parts, Workflow, register
from engine.workflows.checkpoint.api import add_workflow_routes
from engine.workflows.checkpoint.checkpoint import CheckpointController, CheckpointTimeouts
from engine.workflows.checkpoint.cli import add_commands as add_checkpoint_commands
from engine.workflows.checkpoint.names import STAGE_NAMES
from engine.workflows.checkpoint.after_rebuild import AfterRebuild
from engine.workflows.checkpoint.restore import RestoreController, RestoreSettings
from engine.workflows.checkpoint.retirement import RetirementController, RetirementSettings
from engine.workflows.checkpoint.rollouts import RolloutController, RolloutSettings
from engine.workflows.checkpoint.rollouts_api import add_rollout_routes
from engine.workflows.checkpoint.rollouts_cli import add_commands as add_rollout_commands

from engine.config import CheckpointWorkflowSettings

if TYPE_CHECKING:
    from aiohttp import web

    from engine.http.shell import Handler
    from engine.runtime.service import Orchestrator

NAME = "checkpoint"


def build(deps: Deps) -> Parts:
    c, r = deps.settings.checkpoint, deps.settings.rollouts
    rollouts = RolloutController(RolloutSettings(
        r.max_in_flight, r.per_environment, r.max_failures, r.run_timeout_s, r.forget_batch, r.forget_retry_s,
        deployment=deps.settings.training.deployment if deps.settings.training.enabled else None,
        batched=deps.settings.training.enabled and deps.settings.training.batching.enabled))
    controllers: list[Controller] = [
        CheckpointController(CheckpointTimeouts(c.prepare_timeout_s, c.commit_timeout_s, c.resume_timeout_s)),
        RestoreController(RestoreSettings(c.restore_timeout_s, c.resume_timeout_s)),
        RetirementController(RetirementSettings(c.retire_timeout_s)),
        rollouts]
    after = None
    if c.restore_after_rebuild and deps.write is not None and deps.read is not None:
        after = AfterRebuild(deps.write, deps.read, c.directory)
    return Parts(controllers=controllers, on_lost=rollouts.lost, on_rebuild=None if after is None else after.restore,
                 not_ready=None if after is None else after.held)


def routes(app: web.Application, orch: Orchestrator, mutating: Callable[[Handler], Handler]) -> None:
    add_workflow_routes(app, orch, mutating)
    add_rollout_routes(app, orch, mutating)


def commands(sub: Any) -> Mapping[str, Command]:
    return {**add_checkpoint_commands(sub), **add_rollout_commands(sub)}


WORKFLOW = register(Workflow(
    NAME,
    kinds=tuple(EntityKind(m.kind, table, m) for table, m in (
        (models.checkpoints, machines.CHECKPOINTS), (models.checkpoint_members, machines.CHECKPOINT_MEMBERS),
        (models.rollouts, machines.ROLLOUTS), (models.restores, machines.RESTORES),
        (models.retirements, machines.RETIREMENTS))),
    build=build, routes=routes, commands=commands,
    settings=CheckpointWorkflowSettings, builtin_section=True, stage_names=STAGE_NAMES))

__all__ = ["NAME", "WORKFLOW"]
