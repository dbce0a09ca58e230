"""Build the training half of an orchestrator from the ``training`` section of the configuration.

``tidelog serve`` with ``training.enabled``: a :class:`TrainerHost` (restarted within
``training.recovery``) over an executor of the
trainer's ranks (the class ``training.trainer.class`` names, built with its keyword arguments, on the
backend and options of ``training.executor``), the deployment's engines (SGLang's HTTP admin API; the
reference engine speaks it too), the training controller with commit-gated publication, and the
engine gate. Nothing starts here: the trainer process is launched on the first call, by the
leader only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from workers.executor import Executor, ExecutorConfig, WorkerSpec
from workers.inference.engine import InferenceEngine
from workers.inference.sglang import SGLangConfig, SGLangEngine

from engine.config import Settings
from engine.runtime.clock import Clock
from engine.runtime.restarts import RestartPolicy
from engine.workflows.training.batching import BatchController, BatchingSettings
from engine.workflows.training.colocated import ColocatedSettings
from engine.workflows.training.commit_gate import CommitGateSettings, Evaluator
from engine.workflows.training.engine_gate import EngineGateController, GateSettings, engine_id
from engine.workflows.training.publication import PublicationSettings
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.workflows.training.samples import BatchRules, load_sample
from engine.workflows.training.trainer_host import TrainerHost


@dataclass
class TrainingParts:
    host: TrainerHost
    engines: Mapping[str, InferenceEngine]
    controller: TrainingController
    gate: EngineGateController
    #: With ``training.batching.enabled``: groups finished rollouts into the deployment's jobs.
    batcher: BatchController | None = None

    async def close(self) -> None:
        await asyncio.to_thread(self.host.shutdown)
        for engine in self.engines.values():
            close = getattr(engine, "close", None)
            if close is not None:
                await close()


def _absolute(path: str) -> str:
    """Paths go to other processes (engines read weights from disk; Ray actors have their own working
    directory) and into the journal: resolved once, against the orchestrator's working directory."""
    return str(Path(path).expanduser().resolve())


def executor_config(settings: Settings) -> ExecutorConfig:
    """What each generation of the trainer is launched with: ``training.executor.workers`` ranks of
    ``training.trainer.class``, each built with the configured keyword arguments (paths resolved
    here). Rank 0 answers for the group, so its step record is the one in ``state_dir``; rank
    ``k > 0`` keeps its own in ``<state_dir>/rank-<k>`` (two ranks never share one file)."""
    t = settings.training
    state_dir = None if t.trainer.state_dir is None else _absolute(t.trainer.state_dir)
    specs = tuple(WorkerSpec(t.trainer.class_, kwargs=t.trainer.constructor_kwargs(
        state_dir if state_dir is None or rank == 0 else str(Path(state_dir) / f"rank-{rank}")))
        for rank in range(t.executor.workers))
    return ExecutorConfig(backend=t.executor.backend, workers=specs, options=t.executor.options,
                          gpus_per_worker=t.executor.gpus_per_worker, launch_timeout_s=t.executor.launch_timeout_s)


def build_training(settings: Settings, clock: Clock | None = None) -> TrainingParts:
    t = settings.training
    config = executor_config(settings)
    r = t.recovery
    host = TrainerHost(lambda: Executor.create(config),
                       RestartPolicy(r.max_restarts, r.window_s, tuple(r.delays_s), setting="training.recovery"), clock)
    configs = {engine_id(t.deployment, e.name): SGLangConfig(url=e.url, timeout=t.engine_timeout_s,
                                                             weight_update_timeout=t.weight_update_timeout_s,
                                                             api_key=settings.engine_api_key(e))
               for e in t.engines}

    def fresh(engine: str) -> InferenceEngine:
        """A new adapter for ``engine`` (the replacement of an uncertain one's: see the engine gate)."""
        return SGLangEngine(configs[engine])
    # One mapping, shared by the publisher and the engine gate (which replaces adapters in it).
    engines: dict[str, InferenceEngine] = {name: fresh(name) for name in configs}
    publication = PublicationSettings(
        deployment=t.deployment, weights_dir=_absolute(t.weights_dir), pause_mode=t.pause_mode,
        retry_after_s=t.publish_retry_after_s,
        initial_weights=None if t.initial_weights is None else _absolute(t.initial_weights),
        colocated=t.colocated.enabled,
        gate=CommitGateSettings(
            mode=t.commit, acknowledge_timeout_s=t.acknowledge_timeout_s, on_acknowledge_timeout=t.on_acknowledge_timeout,
            evaluator=None if t.evaluator.callable is None else Evaluator(t.evaluator.callable, t.evaluator.kwargs),
            evaluate_timeout_s=t.evaluator.timeout_s, retry_after_s=t.publish_retry_after_s))
    controller = TrainingController(host, TrainingSettings(
        checkpoint_dir=_absolute(t.checkpoint_dir), deployment=t.deployment, train_timeout_s=t.train_timeout_s,
        call_timeout_s=t.call_timeout_s, retry_after_s=t.retry_after_s, ranks=t.executor.workers),
        publication=(engines, publication) if engines else None, clock=clock,
        colocated=ColocatedSettings(t.colocated.enabled, t.colocated.keep_base_resident))
    lock = controller.publisher.lock if controller.publisher is not None else asyncio.Lock()
    gate = EngineGateController(engines, GateSettings(t.deployment, t.pause_mode, t.retry_after_s,
                                                      colocated=t.colocated.enabled), lock, fresh=fresh)
    return TrainingParts(host, engines, controller, gate, batcher(settings))


def batcher(settings: Settings) -> BatchController | None:
    """The batch controller of ``training.batching`` (``None`` when it is not enabled). The sample
    function is imported here, once: a module that cannot be imported fails the start."""
    t, b = settings.training, settings.training.batching
    if not b.enabled:
        return None
    rules = BatchRules(reward_key=b.reward_key, labels=dict(b.labels), max_staleness=b.max_staleness,
                       sample=load_sample(b.sample, b.sample_kwargs))
    return BatchController(BatchingSettings(t.deployment, b.size, rules))


__all__ = ["TrainingParts", "batcher", "build_training", "executor_config"]
