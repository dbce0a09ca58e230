"""The ``training`` section's models (docs/training.md): the trainer by import path, its executor, the
commit gate's evaluator, batching, the trainer's restart policy, and the engines publication drives.
A class or callable named by import path is found, not imported (a configuration naming the
reference trainer does not import torch)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from engine.config._common import ParticipantEntry, _Strict, _unique_names
from engine.config.deployment import RecoverySettingsModel

class EngineEntry(ParticipantEntry):
    """An inference engine of the deployment (SGLang's HTTP admin API, or the reference engine)."""

    #: Sent as ``Authorization: Bearer`` (SGLang's ``--api-key``); ``TIDELOG_ENGINE_API_KEY`` is the
    #: key of every engine that has none here. Never printed.
    api_key: SecretStr | None = None


_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
#: The executor backends built in (``workers.executor``); anything else is an import path.
_BACKENDS = ("auto", "uni", "mp", "ray", "http")


def _importable(path: str) -> str:
    """``path`` if it is ``package.module:Name`` and the module can be found (it is not imported:
    a trainer's module imports torch, which the orchestrator loads only to train in process)."""
    if not _IMPORT_PATH.match(path):
        raise ValueError(f"{path!r} is not an import path 'package.module:Name'")
    module = path.partition(":")[0]
    try:
        found = _find_module(module)
    except (ImportError, ValueError) as exc:  # a top-level package that is broken
        raise ValueError(f"module {module!r} of {path!r} cannot be found ({exc})") from None
    if not found:
        raise ValueError(f"module {module!r} of {path!r} cannot be found")
    return path


def _find_module(name: str) -> bool:
    """Whether module ``name`` exists, found without running any package's ``__init__``
    (``importlib.util.find_spec`` of a dotted name imports its parents: naming
    ``workers.trainer.worker:Trainer`` would import torch). The top-level name goes through every
    finder (an editable install's too); each part below it is looked for in its parent's directories."""
    first, *rest = name.split(".")
    spec = importlib.util.find_spec(first)
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


class TrainerSettingsModel(_Strict):
    """The trainer: a class named by import path and its constructor's keyword arguments
    (docs/training.md, "Bring your own trainer"). Each rank is built as ``Class(**kwargs, seed=…,
    lr=…, device=…, state_dir=…)``, the four shorthands passed only when set."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    #: ``package.module:Class``; the reference trainer by default.
    class_: str = Field(default="workers.trainer.worker:Trainer", alias="class")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    lr: float | None = Field(default=None, gt=0, le=1e6)
    device: str | None = None
    #: Its durable step record (``step.json``): the evidence that settles an ambiguous job. ``null``:
    #: none (an ambiguous job then waits for an operator).
    state_dir: str | None = "./training/trainer"

    @field_validator("class_")
    @classmethod
    def _class(cls, v: str) -> str:
        return _importable(v)

    @model_validator(mode="after")
    def _no_twice(self) -> TrainerSettingsModel:
        if "state_dir" in self.kwargs:
            raise ValueError("kwargs.state_dir: give it as training.trainer.state_dir (resolved against the "
                             "orchestrator's directory), not in kwargs")
        for key in ("seed", "lr", "device"):
            if key in self.kwargs and getattr(self, key) is not None:
                raise ValueError(f"kwargs.{key}: given both as training.trainer.{key} and in kwargs")
        return self

    def constructor_kwargs(self, state_dir: str | None) -> dict[str, Any]:
        """The keyword arguments each rank is built with (``state_dir`` resolved by the caller)."""
        shorthands = {"seed": self.seed, "lr": self.lr, "device": self.device, "state_dir": state_dir}
        return {**self.kwargs, **{k: v for k, v in shorthands.items() if v is not None}}


class ExecutorSettingsModel(_Strict):
    """Where the trainer's ranks run (``workers.executor``). A plain string is the backend alone."""

    #: ``auto``, ``uni`` (the orchestrator's process), ``mp`` (spawned processes), ``ray`` (actors),
    #: ``http`` (ranks served by ``python -m workers.executor.serve``, a service of the stack, say:
    #: ``options.urls`` one per rank, ``options.token_env`` its bearer token's variable), or
    #: ``package.module:Class``, an ``Executor`` subclass (the seed's custom executor).
    backend: str = "mp"
    #: Ranks, all of the trainer class. Rank 0 answers for the group (docs/training.md).
    workers: int = Field(default=1, ge=1, le=1024)
    #: Ray actor options for every rank (``num_cpus``, ``num_gpus``, ``resources``, ``runtime_env``…),
    #: or a custom executor's own launch options.
    options: dict[str, Any] = Field(default_factory=dict)
    #: GPUs each rank needs: disjoint CUDA masks on ``mp``, ``num_gpus`` on Ray.
    gpus_per_worker: float = Field(default=0, ge=0, le=1024)
    #: One deadline shared by every rank's constructor.
    launch_timeout_s: float = Field(default=300.0, gt=0, le=86_400)

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v in _BACKENDS:
            return v
        if ":" not in v:
            raise ValueError(f"{v!r} is not a backend: auto, uni, mp, ray, http, or an Executor subclass "
                             f"as 'package.module:Class'")
        return _importable(v)

    @model_validator(mode="after")
    def _options_for_the_backend(self) -> ExecutorSettingsModel:
        if self.options and self.backend in ("uni", "mp"):
            raise ValueError(f"options: the {self.backend} backend takes no executor options "
                             f"(got {sorted(self.options)}); Ray actor options need backend ray")
        if self.backend == "http":
            from workers.executor._http import check_http_options  # the executor's own rules, not a copy

            try:
                check_http_options(self.options, self.workers, where="executor",
                                   gpus_per_worker=self.gpus_per_worker)
            except ValueError as exc:
                raise ValueError(str(exc)) from None
        if self.backend == "uni" and self.workers != 1:
            raise ValueError(f"workers: the uni backend runs exactly one rank (got {self.workers})")
        return self


class EvaluatorSettingsModel(_Strict):
    """The evaluator of ``training.commit: evaluate`` (docs/training.md, "The commit gate")."""

    #: ``package.module:name``: a function ``fn(candidate, incumbent, **kwargs)`` or a class built as
    #: ``Class(**kwargs)`` whose ``evaluate(candidate, incumbent)`` is called.
    callable: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: The longest one evaluation may take before it counts as failed (and is asked again).
    timeout_s: float = Field(default=600.0, gt=0, le=86_400)

    @field_validator("callable")
    @classmethod
    def _callable(cls, v: str | None) -> str | None:
        return None if v is None else _importable(v)


class BatchingSettingsModel(_Strict):
    """Finished rollouts grouped into training jobs (docs/training.md, "Batching rollouts into jobs")."""

    enabled: bool = False
    #: Rollouts per job.
    size: int = Field(default=8, ge=1, le=4096)
    #: A finished rollout qualifies only if its result holds a finite number under this key (null: any).
    reward_key: str | None = Field(default="reward", min_length=1)
    #: ... and only if it carries each of these labels with the same value.
    labels: dict[str, Any] = Field(default_factory=dict)
    #: Most publications a rollout's weight version may be behind the job's base (null: no bound).
    max_staleness: int | None = Field(default=1, ge=0, le=1_000_000)
    #: ``package.module:name``: ``fn(rollout, **sample_kwargs)`` -> the job's sample for one rollout.
    sample: str = "engine.workflows.training.samples:rollout_sample"
    sample_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sample")
    @classmethod
    def _sample(cls, v: str) -> str:
        return _importable(v)


class ColocatedSettingsModel(_Strict):
    """Training that shares the engines' GPUs (docs/training.md, "Colocated training"): before each
    step every engine is paused and its memory released; publication takes it back."""

    enabled: bool = False
    #: Release only the KV cache and CUDA graphs, keeping the weights resident (the GPU must hold
    #: them and the training step at once); otherwise the weights are released too.
    keep_base_resident: bool = False


class TrainingWorkflowSettings(_Strict):
    """Training jobs and commit-gated publication (docs/training.md)."""

    enabled: bool = False
    deployment: str = Field(default="default", min_length=1, max_length=255)
    executor: ExecutorSettingsModel = ExecutorSettingsModel()
    trainer: TrainerSettingsModel = TrainerSettingsModel()
    checkpoint_dir: str = "./training/checkpoints"
    weights_dir: str = "./training/weights"
    initial_weights: str | None = None
    train_timeout_s: float = Field(default=3600.0, gt=0, le=7 * 86_400)
    call_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    retry_after_s: float = Field(default=5.0, gt=0, le=3600)
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"
    publish_retry_after_s: float = Field(default=2.0, gt=0, le=3600)
    engine_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    weight_update_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    #: Who makes a READY_TO_COMMIT candidate the head: auto, acknowledge (an operator), evaluate.
    commit: Literal["auto", "acknowledge", "evaluate"] = "auto"
    #: With ``commit: acknowledge``: how long a candidate waits (null: without end), then what happens.
    acknowledge_timeout_s: float | None = Field(default=None, gt=0, le=30 * 86_400)
    on_acknowledge_timeout: Literal["reject", "hold"] = "reject"
    evaluator: EvaluatorSettingsModel = EvaluatorSettingsModel()
    batching: BatchingSettingsModel = BatchingSettingsModel()
    colocated: ColocatedSettingsModel = ColocatedSettingsModel()
    #: How often a trainer that fails (its process dies, its Ray actor is lost) is started again:
    #: at most ``max_restarts`` within ``window_s``, the n-th after ``delays_s[n-1]``; past it the
    #: trainer stays down (``/readyz`` 503, jobs wait) until the orchestrator is restarted.
    recovery: RecoverySettingsModel = RecoverySettingsModel()
    engines: list[EngineEntry] = Field(default_factory=list)

    @field_validator("executor", mode="before")
    @classmethod
    def _backend_alone(cls, v: Any) -> Any:
        # `executor: mp` is the backend with every other executor setting at its default.
        return {"backend": v} if isinstance(v, str) else v

    @field_validator("engines")
    @classmethod
    def _unique(cls, v: list[EngineEntry]) -> list[EngineEntry]:
        return _unique_names(v, "engine")

    @model_validator(mode="after")
    def _gate(self) -> TrainingWorkflowSettings:
        # A setting of another mode would be ignored without a word: refused instead.
        if self.commit == "evaluate" and self.evaluator.callable is None:
            raise ValueError("training.commit 'evaluate' needs training.evaluator.callable")
        if self.commit != "evaluate" and self.evaluator.callable is not None:
            raise ValueError(f"training.evaluator.callable is set but training.commit is {self.commit!r} "
                             f"(it is used only by 'evaluate')")
        if self.colocated.enabled and self.pause_mode == "in_place":
            # Requests left running in place make the engine refuse the release (and a failed
            # release makes it uncertain, and replaced, at every step).
            raise ValueError("training.colocated.enabled needs training.pause_mode 'abort' or 'retract', not "
                             "'in_place': an engine cannot release its memory under running requests")
        if self.commit != "acknowledge" and self.acknowledge_timeout_s is not None:
            raise ValueError(f"training.acknowledge_timeout_s is set but training.commit is {self.commit!r} "
                             f"(it applies only to 'acknowledge')")
        return self

    @model_validator(mode="after")
    def _engines_when_enabled(self) -> TrainingWorkflowSettings:
        # A job leaves the deployment's single in-flight slot only once published (or rejected).
        if self.batching.enabled and not self.enabled:
            raise ValueError("training.batching.enabled needs training.enabled: batches are submitted as "
                             "the deployment's training jobs")
        if self.batching.enabled and self.batching.max_staleness is not None and self.initial_weights is None:
            # Without a head from the start, the first rollouts record no version and are all excluded.
            raise ValueError("training.batching.max_staleness needs training.initial_weights: the first "
                             "rollouts must record the version they ran on (or set max_staleness: null)")
        if self.enabled and not self.engines:
            raise ValueError("training.enabled needs at least one engine in training.engines: a trained "
                             "job holds the deployment until its weights are published")
        return self
