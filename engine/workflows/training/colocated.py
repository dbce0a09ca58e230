"""Colocated training: the trainer borrows the engines' GPU memory for each optimizer step.

With ``training.colocated.enabled``, before ``train`` is called for a job the training controller
pauses every engine and releases its memory (:func:`release_for_training`): the KV cache and CUDA
graphs, and the weights too unless ``keep_base_resident``. Publication takes it back: the weights
before the new ones are loaded, the KV cache and graphs once every engine reports the target
(:mod:`engine.workflows.training.publication`); the engine gate gives back whatever is still
released before it lets an engine generate (a job rejected, an orchestrator that crashed
mid-step). While a job is ``RUNNING`` the gate holds every engine paused with its memory as it is.

Every release and resume is acknowledged by the engine before the adapter counts it, and each
engine's row records the regions as acknowledged (``engines.memory``). A region call that fails
in any way leaves that engine *uncertain* (:class:`workers.inference.engine.MemoryRegions`): its
adapter refuses every later call, its row says ``uncertain``, and it is replaced, never used again
(:class:`engine.workflows.training.engine_gate.EngineGateController`). The step is not trained
until every engine has released: a trainer allocating beside an engine in an unknown state could
run the GPU out of memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from workers.inference.engine import REGIONS, InferenceEngine

#: What stays released while the weights are kept resident.
KV_AND_GRAPHS: tuple[str, ...] = ("kv_cache", "cuda_graph")


@dataclass(frozen=True)
class ColocatedSettings:
    enabled: bool = False
    keep_base_resident: bool = False

    @property
    def training_regions(self) -> tuple[str, ...]:
        """The regions released before each training step."""
        return KV_AND_GRAPHS if self.keep_base_resident else REGIONS


async def release_for_training(engines: Sequence[InferenceEngine], settings: ColocatedSettings,
                               pause_mode: str) -> None:
    """Pause every engine and release its :attr:`ColocatedSettings.training_regions`, all engines at
    once; every call is let finish, then the first failure is raised. Safe to repeat: a paused
    engine is paused again, and released regions are skipped (nothing is sent for them)."""
    async def one(engine: InferenceEngine) -> None:
        await engine.pause_generation(pause_mode)
        await engine.release_memory(settings.training_regions)

    results = await asyncio.gather(*(one(e) for e in engines), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


__all__ = ["KV_AND_GRAPHS", "ColocatedSettings", "release_for_training"]
