"""The checkpoint family as registered: its kinds (checkpoints and their members, rollouts,
restores, retirements), the checkpoint, restore and retirement controllers from the ``checkpoint``
section, its routes and commands, and the stage names of its staged rows."""

from __future__ import annotations

from journal import EntityKind, machines, models

from engine.runtime.reconciler import Controller
from engine.runtime.workflow import Deps, Parts, Workflow, register
from engine.workflows.checkpoint.api import add_workflow_routes
from engine.workflows.checkpoint.checkpoint import CheckpointController, CheckpointTimeouts
from engine.workflows.checkpoint.cli import add_commands
from engine.workflows.checkpoint.names import STAGE_NAMES
from engine.workflows.checkpoint.restore import RestoreController, RestoreSettings
from engine.workflows.checkpoint.retirement import RetirementController, RetirementSettings

from engine.config import CheckpointWorkflowSettings

NAME = "checkpoint"


def build(deps: Deps) -> Parts:
    c = deps.settings.checkpoint
    controllers: list[Controller] = [
        CheckpointController(CheckpointTimeouts(c.prepare_timeout_s, c.commit_timeout_s, c.resume_timeout_s)),
        RestoreController(RestoreSettings(c.restore_timeout_s, c.resume_timeout_s)),
        RetirementController(RetirementSettings(c.retire_timeout_s))]
    return Parts(controllers=controllers)


WORKFLOW = register(Workflow(
    NAME,
    kinds=tuple(EntityKind(m.kind, table, m) for table, m in (
        (models.checkpoints, machines.CHECKPOINTS), (models.checkpoint_members, machines.CHECKPOINT_MEMBERS),
        (models.rollouts, machines.ROLLOUTS), (models.restores, machines.RESTORES),
        (models.retirements, machines.RETIREMENTS))),
    build=build, routes=add_workflow_routes, commands=add_commands,
    settings=CheckpointWorkflowSettings, builtin_section=True, stage_names=STAGE_NAMES))

__all__ = ["NAME", "WORKFLOW"]
