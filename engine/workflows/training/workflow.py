"""The training family as registered: its kinds (training jobs, weight versions, engines, batches),
the trainer host, training controller and engine gate built from the ``training`` section (only when
``training.enabled``), the batcher with ``training.batching.enabled`` (its open batch ensured on every
election), the configured engines synced on every election, the trainer released when the lease is
lost, and its routes and commands."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from journal import EntityKind, WriteTx, machines, models

from engine.config import TrainingWorkflowSettings
from engine.runtime.workflow import Deps, Parts, Workflow, register
from engine.workflows.training.api import add_training_routes
from engine.workflows.training.batching import BatchController, ensure_head, ensure_open
from engine.workflows.training.cli import add_commands
from engine.workflows.training.engine_gate import sync_engines
from engine.workflows.training.wiring import TrainingParts, build_training

NAME = "training"


def build(deps: Deps) -> Parts | None:
    """``None`` unless ``training.enabled``, or when the caller supplies the training controller
    itself (its publisher and the gate share a lock, so the family is built whole or not at all)."""
    t = deps.settings.training
    if not t.enabled or "training_jobs" in deps.replaced:
        return None
    parts = build_training(deps.settings, deps.clock)
    # An uncertain engine is replaced by whichever family runs it (the deployment's stack).
    parts.gate.replace = deps.replace_engine
    engines: Mapping[str, str] = {e.name: e.url for e in t.engines}

    async def sync(tx: WriteTx) -> list[str]:
        touched = await sync_engines(tx, t.deployment, engines)
        await parts.gate.adopt(tx)
        return touched

    async def open_batch(tx: WriteTx) -> str:
        await ensure_head(tx, t.deployment, parts.controller.publisher.settings.initial_weights
                          if parts.controller.publisher is not None else None)
        return await ensure_open(tx, t.deployment)

    batcher: BatchController | None = parts.batcher

    async def lost() -> None:
        if batcher is not None:
            await batcher.lost()
        # The next leader starts its own trainer; this one's must not train beside it.
        await asyncio.to_thread(parts.host.release)

    async def not_ready() -> str | None:
        # A trainer that failed is not there until it is started again, and one that failed past
        # training.recovery is not started again: either way the deployment cannot train.
        return parts.host.unready()

    return Parts(controllers=[parts.controller, parts.gate, *([batcher] if batcher else [])],
                 on_elected=[sync, *([open_batch] if batcher else [])], on_lost=lost, close=parts.close,
                 handle=parts, not_ready=not_ready)


def training_parts(handle: object) -> TrainingParts | None:
    """The orchestrator's built training half, if it has one (``orch.handle(NAME)``)."""
    return handle if isinstance(handle, TrainingParts) else None


WORKFLOW = register(Workflow(
    NAME,
    kinds=tuple(EntityKind(m.kind, table, m) for table, m in (
        (models.training_jobs, machines.TRAINING_JOBS), (models.weight_versions, machines.WEIGHT_VERSIONS),
        (models.engines, machines.ENGINES), (models.training_batches, machines.TRAINING_BATCHES))),
    build=build, routes=add_training_routes, commands=add_commands,
    settings=TrainingWorkflowSettings, builtin_section=True))

__all__ = ["NAME", "WORKFLOW", "training_parts"]
