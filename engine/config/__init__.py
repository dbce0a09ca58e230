"""Configuration: one YAML file validated by pydantic, secrets from the environment.

Every key is documented in ``config.example.yaml``. Unknown keys are refused. The ``deployment``
section's models (the service stack) are in :mod:`engine.config.deployment`, the ``training``
section's in :mod:`engine.config.training`; what sections share in :mod:`engine.config._common`.
The control token comes from ``TIDELOG_CONTROL_TOKEN`` (which wins) or from
``control.token`` in the file — never from the command line, and it is never
printed: it is a ``SecretStr`` everywhere.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pydantic_settings import BaseSettings, SettingsConfigDict

from journal import JournalURL, UnsupportedJournalURL

from engine.config._common import _USERINFO, ParticipantEntry, _Strict, _unique_names
from engine.config.deployment import DeploymentSettingsModel
from engine.config.training import (BatchingSettingsModel, EngineEntry, EvaluatorSettingsModel,
                                    ExecutorSettingsModel, TrainerSettingsModel, TrainingWorkflowSettings)
from engine.runtime import workflow

TOKEN_ENV = "TIDELOG_CONTROL_TOKEN"
CONFIG_ENV = "TIDELOG_CONFIG"


class EnvSecrets(BaseSettings):
    """Secrets read from the environment only (``TIDELOG_CONTROL_TOKEN``)."""

    model_config = SettingsConfigDict(env_prefix="TIDELOG_", extra="ignore")
    control_token: SecretStr | None = None
    #: ``TIDELOG_ENGINE_API_KEY``: the inference engines' API key, for those without ``api_key``.
    engine_api_key: SecretStr | None = None


class ConfigError(Exception):
    """The configuration is unusable; the message names the file, the key and the rule."""


class JournalSettings(_Strict):
    url: str = "sqlite+aiosqlite:///./tidelog.db"
    busy_timeout_ms: int = Field(default=5000, ge=0, le=600_000)
    pool_size: int = Field(default=5, ge=1, le=200)

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        try:
            JournalURL.parse(v)
        except UnsupportedJournalURL as exc:
            raise ValueError(str(exc).removeprefix("journal.url: ")) from None
        return v


class OrchestratorSettings(_Strict):
    # The id is written into every event's actor: short and printable.
    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$",
                           description="holder id in the lease; default host-pid-random")
    lease_ttl_s: float = Field(default=10.0, gt=0, le=3600)
    lease_renew_s: float = Field(default=3.0, gt=0, le=3600)
    shutdown_grace_s: float = Field(default=10.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _renew_below_ttl(self) -> OrchestratorSettings:
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError(f"lease_renew_s ({self.lease_renew_s}) must be below lease_ttl_s ({self.lease_ttl_s})")
        return self

    def holder(self) -> str:
        return self.id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ApiSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=0, le=65535)
    #: A connection must deliver a whole request head this soon after it opens (or after a reply).
    header_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    #: A request body must arrive whole this soon after its head.
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)


class ControlSettings(_Strict):
    token: SecretStr | None = None


class ReconcilerSettings(_Strict):
    concurrency: int = Field(default=16, ge=1, le=1024)
    resync_interval_s: float = Field(default=30.0, gt=0, le=86_400)
    max_batch: int = Field(default=256, ge=1, le=10_000)


class DispatcherSettings(_Strict):
    # A checkpoint stage fans out to every participant of a kind at once: keep room for a stage.
    concurrency: int = Field(default=256, ge=1, le=4096)
    #: Data calls in flight (a rollout's /run lasts its episode), counted apart from control calls.
    data_concurrency: int = Field(default=1024, ge=1, le=65_536)
    batch: int = Field(default=256, ge=1, le=10_000)
    poll_s: float = Field(default=1.0, gt=0, le=3600)
    backoff_base_s: float = Field(default=0.5, gt=0, le=3600)
    backoff_cap_s: float = Field(default=30.0, gt=0, le=86_400)


class RpcSettings(_Strict):
    control_pool: int = Field(default=64, ge=1, le=65_536)
    control_per_host: int = Field(default=8, ge=0, le=65_536)
    #: A rollout's /run holds one for its whole episode: at least rollouts.max_in_flight.
    data_pool: int = Field(default=256, ge=1, le=65_536)
    transport_tries: int = Field(default=3, ge=1, le=20)
    retry_backoff_s: float = Field(default=0.2, ge=0, le=3600)


class DiscoverySettingsModel(_Strict):
    probe_timeout_s: float = Field(default=5.0, gt=0, le=600)
    probe_tries: int = Field(default=3, ge=1, le=20)
    interval_s: float = Field(default=30.0, gt=0, le=86_400)
    max_backoff_s: float = Field(default=600.0, gt=0, le=86_400)


class CheckpointWorkflowSettings(_Strict):
    """The checkpoint, restore, retire and forget workflows (docs/checkpointing.md)."""

    directory: str = "./checkpoints"
    #: Further directories a request may name (``POST /v1/checkpoints``/``/v1/restores``), besides
    #: ``directory``; a request naming any other place is refused (docs/security.md).
    roots: list[str] = Field(default_factory=list, max_length=64)
    prepare_timeout_s: float = Field(default=30.0, gt=0, le=86_400)
    commit_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    resume_timeout_s: float = Field(default=30.0, gt=0, le=86_400)
    restore_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    retire_timeout_s: float = Field(default=60.0, gt=0, le=86_400)
    max_tries: int = Field(default=3, ge=1, le=100)
    #: After each rebuild of the deployment's stack, restore the participants from the latest
    #: checkpoint in ``directory``: its episodes still on their checkpointed attempt continue from
    #: their boundary instead of starting over (docs/deployment.md, section 5).
    restore_after_rebuild: bool = True


class RolloutsSettings(_Strict):
    """Dispatching submitted rollouts (docs/rollouts.md): how many attempts run at once, and the
    retry rule. Each attempt's /run holds a data-pool connection for its episode, so
    ``max_in_flight`` may not exceed ``rpc.data_pool``."""

    #: Attempts in flight across every environment server.
    max_in_flight: int = Field(default=256, ge=1, le=100_000)
    #: Attempts in flight on one environment server.
    per_environment: int = Field(default=32, ge=1, le=100_000)
    #: Attempts that may end in a typed error before the rollout fails.
    max_failures: int = Field(default=3, ge=1, le=100)
    #: The longest one attempt's /run may take (its whole episode).
    run_timeout_s: float = Field(default=3600.0, gt=0, le=7 * 86_400)
    #: Most rollouts one forget request names (done rollouts are forgotten everywhere in batches).
    forget_batch: int = Field(default=1000, ge=1, le=10_000)
    #: The wait before the next forget batch after one failed.
    forget_retry_s: float = Field(default=5.0, gt=0, le=3600)


#: ``package.module:Name`` (a class or callable named by import path).
class LoggingSettings(_Strict):
    level: str = "INFO"
    format: str = Field(default="json", pattern="^(json|text)$")

    @field_validator("level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"{v!r} is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
        return v.upper()


#: What ``workflows:`` lists: a module path (``package.module``, which registers its workflow when
#: imported) or ``package.module:NAME`` (the module's :class:`~engine.runtime.workflow.Workflow`
#: ``NAME``, registered by the loader).
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?$")


class Settings(_Strict):
    """The whole configuration. Besides the keys below, a top-level key may be the settings section
    of a registered workflow (:mod:`engine.runtime.workflow`): it is validated by that workflow's
    model and read back with :meth:`section`; any other key is refused."""

    #: Modules to import before the rest is read, each registering its workflow (``load`` imports them).
    workflows: list[str] = Field(default_factory=list, max_length=64)
    journal: JournalSettings = JournalSettings()
    orchestrator: OrchestratorSettings = OrchestratorSettings()
    api: ApiSettings = ApiSettings()
    control: ControlSettings = ControlSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()
    dispatcher: DispatcherSettings = DispatcherSettings()
    rpc: RpcSettings = RpcSettings()
    discovery: DiscoverySettingsModel = DiscoverySettingsModel()
    checkpoint: CheckpointWorkflowSettings = CheckpointWorkflowSettings()
    rollouts: RolloutsSettings = RolloutsSettings()
    participants: list[ParticipantEntry] = Field(default_factory=list)
    training: TrainingWorkflowSettings = TrainingWorkflowSettings()
    #: The service stack (engine/config/deployment.py; docs/deployment.md).
    deployment: DeploymentSettingsModel = DeploymentSettingsModel()
    logging: LoggingSettings = LoggingSettings()
    #: Registered workflows' own sections, validated (filled from their keys; not a key itself).
    sections: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _workflow_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "sections" in data:
            raise PydanticCustomError("sections", "'sections' is not a configuration key")
        declared = workflow.sections()
        own = {k: v for k, v in data.items() if k in cls.model_fields}
        parsed: dict[str, Any] = {}
        for key, value in data.items():
            if key in own:
                continue
            model = declared.get(key)
            if model is None:
                # Left in place: the strict model refuses it, naming the key.
                own[key] = value
                continue
            try:
                parsed[key] = model.model_validate(value if value is not None else {})
            except ValidationError as exc:
                # Named like the built-in sections' errors: ``key.field: rule (got value)``.
                lines = "; ".join(f"{'.'.join(str(p) for p in (key, *e['loc']))}: {e['msg']}"
                                  + ("" if isinstance(e.get("input"), dict | list) else f" (got {e.get('input')!r})")
                                  for e in exc.errors())
                raise PydanticCustomError("workflow_section", "{detail}", {"detail": lines}) from None
        for key, model in declared.items():
            parsed.setdefault(key, model())
        return {**own, "sections": parsed}

    @field_validator("workflows")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _MODULE.match(name):
                raise ValueError(f"{name!r} is not a module path (package.module or package.module:NAME)")
        return v

    def section(self, name: str) -> Any:
        """A workflow's settings section: a field of this class for the built-in families, else
        the section a registered workflow declared (its defaults when the file has none)."""
        if name in type(self).model_fields and name != "sections":
            return getattr(self, name)
        try:
            return self.sections[name]
        except KeyError:
            raise KeyError(f"no settings section {name!r}: no registered workflow declares it") from None

    @field_validator("participants")
    @classmethod
    def _unique(cls, v: list[ParticipantEntry]) -> list[ParticipantEntry]:
        return _unique_names(v, "participant")

    @model_validator(mode="after")
    def _connections_for_rollouts(self) -> Settings:
        # Each attempt's /run holds a data-pool connection for its whole episode: with fewer
        # connections than attempts in flight, admitted attempts would wait unseen for a socket.
        if self.rollouts.max_in_flight > self.rpc.data_pool:
            raise ValueError(f"rollouts.max_in_flight ({self.rollouts.max_in_flight}) exceeds rpc.data_pool "
                             f"({self.rpc.data_pool}): each attempt in flight holds a data connection")
        return self

    def engine_api_key(self, engine: EngineEntry) -> str | None:
        """An engine's API key: its own ``api_key``, else ``TIDELOG_ENGINE_API_KEY``, else none."""
        if engine.api_key is not None and engine.api_key.get_secret_value():
            return engine.api_key.get_secret_value()
        env = EnvSecrets().engine_api_key
        return env.get_secret_value() if env is not None and env.get_secret_value() else None

    def token(self) -> str | None:
        """The control token: ``TIDELOG_CONTROL_TOKEN`` first, then ``control.token``."""
        env = EnvSecrets().control_token
        if env is not None and env.get_secret_value():
            return env.get_secret_value()
        return self.control.token.get_secret_value() if self.control.token else None


def _format(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        if err["type"] == "workflow_section":
            lines.append(f"  {err['msg']}")  # already ``section.key: rule (got value)``
            continue
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        if isinstance(value, str):
            value = _USERINFO.sub(r"\1***@", value)  # a URL's password never reaches an error
        secret = "token" in where or "api_key" in where
        shown = "" if secret or isinstance(value, dict | list) else f" (got {value!r})"
        lines.append(f"  {where}: {err['msg']}{shown}")
    return "\n".join(lines)


def import_workflows(modules: Any, source: str) -> None:
    """Import each module ``workflows:`` names (and register the workflow a ``module:NAME`` entry
    names), before validation, so that their settings sections are known. A module that cannot be
    imported, a ``NAME`` that is not a Workflow, or a clash with a registered one is a ``ConfigError``."""
    if not isinstance(modules, list):
        return  # the model refuses a value that is not a list, naming the key
    for entry in modules:
        if not isinstance(entry, str) or not _MODULE.match(entry):
            continue  # refused by the model, naming the value
        name, _, attr = entry.partition(":")
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the config's problem
            raise ConfigError(f"{source}: workflows: cannot import {name!r}: {type(exc).__name__}: {exc}") from None
        if not attr:
            continue
        found = getattr(module, attr, None)
        if not isinstance(found, workflow.Workflow):
            raise ConfigError(f"{source}: workflows: {entry!r}: {name} has no Workflow named {attr!r}")
        try:
            workflow.register(found)
        except ValueError as exc:
            raise ConfigError(f"{source}: workflows: {entry!r}: {exc}") from None


def load(path: str | os.PathLike[str] | None) -> Settings:
    """Load and validate a config file (``None``: ``TIDELOG_CONFIG`` or the defaults)."""
    if path is None:
        path = os.environ.get(CONFIG_ENV) or None
    if path is None:
        return Settings()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    import_workflows(data.get("workflows"), str(p))
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, str(p))) from None


__all__ = ["CONFIG_ENV", "TOKEN_ENV", "ApiSettings", "BatchingSettingsModel", "CheckpointWorkflowSettings",
           "ConfigError", "ControlSettings", "DiscoverySettingsModel", "DispatcherSettings", "EngineEntry", "EnvSecrets",
           "EvaluatorSettingsModel", "ExecutorSettingsModel", "JournalSettings", "LoggingSettings",
           "OrchestratorSettings", "ParticipantEntry", "ReconcilerSettings", "RolloutsSettings", "RpcSettings",
           "Settings", "TrainerSettingsModel", "TrainingWorkflowSettings", "_USERINFO", "import_workflows", "load"]
