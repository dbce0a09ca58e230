"""A stack ready to run: the configured services in dependency order, with every ``${env.VAR}``
resolved against the orchestrator's environment — or a :class:`StackConfigError` before anything
starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.health import HealthMonitorConfig

from engine.runtime.restarts import RestartPolicy
from engine.config.deployment import (
    DeploymentSettingsModel, ServiceModel, endpoint_of, env_references, order)


class StackConfigError(ValueError):
    """The stack cannot be started as configured; the message names the service and the key."""


@dataclass(frozen=True)
class Plan:
    """What a stack runs: ``services`` by name, ``order`` (each after its dependencies), where its
    files go, the stop grace, and the environment its ``${env.VAR}`` references read."""

    services: Mapping[str, ServiceModel]
    order: tuple[str, ...]
    run_dir: Path
    stop_grace_s: float
    environ: Mapping[str, str]
    #: Managed recovery's bounds (a fresh policy is made from them for each stack).
    max_restarts: int = 3
    window_s: float = 300.0
    delays_s: tuple[float, ...] = (1.0, 2.0, 4.0)

    #: Service name -> the ``engines`` row id it runs.
    engine_rows: Mapping[str, str] = field(default_factory=dict)
    #: The health monitor's schedule (``None``: ready services are not monitored).
    health: HealthMonitorConfig | None = None

    def policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts, self.window_s, self.delays_s)

    @classmethod
    def build(cls, settings: DeploymentSettingsModel, environ: Mapping[str, str] | None = None, *,
              engines: Mapping[str, str] | None = None, deployment: str = "default") -> Plan:
        """``engines``: ``training.engines`` (name -> url) when training is enabled, else ``None``."""
        env = dict(os.environ if environ is None else environ)
        rows: dict[str, str] = {}
        for name, svc in settings.services.items():
            if svc.engine is None:
                continue
            where = f"deployment.services.{name}.engine"
            if engines is None:
                raise StackConfigError(f"{where}: {svc.engine!r} needs training.enabled (the engine gate puts a "
                                       f"launched engine on the committed head)")
            if svc.engine not in engines:
                raise StackConfigError(f"{where}: {svc.engine!r} is not in training.engines "
                                       f"(configured: {sorted(engines)})")
            published = endpoint_of(svc)
            if published is not None and published.rstrip("/") != engines[svc.engine].rstrip("/"):
                raise StackConfigError(f"{where}: the service publishes {published}, but training.engines "
                                       f"{svc.engine!r} is at {engines[svc.engine]}")
            if svc.engine in {settings.services[n].engine for n in rows}:
                raise StackConfigError(f"{where}: engine {svc.engine!r} is run by two services")
            rows[name] = f"{deployment}/{svc.engine}"
        for name, svc in settings.services.items():
            for key, var in env_references(svc).items():
                if var not in env:
                    raise StackConfigError(f"deployment.services.{name}.env.{key}: names ${{env.{var}}}, which is "
                                           f"not set in the orchestrator's environment")
        r, h = settings.recovery, settings.health
        return cls(dict(settings.services), tuple(order(settings.services)), Path(settings.run_dir).resolve(),
                   settings.stop_grace_s, env, r.max_restarts, r.window_s, tuple(r.delays_s), rows,
                   None if h.interval_s is None else HealthMonitorConfig(h.interval_s, h.timeout_s, h.first_wait_s))

    def dependents(self, name: str) -> list[str]:
        """The services that depend on ``name`` directly."""
        return [n for n in self.order if name in self.services[n].depends_on]
