"""The ``deployment`` section: the service stack a ``tidelog serve`` runs (docs/deployment.md). Its
models live beside :mod:`engine.config` (which imports them: a configuration is read whole before
any family is imported); the deployment family (:mod:`engine.workflows.deployment`) runs them.

Everything is checked here, before anything starts: names, commands, readiness bounds, the
dependency graph (unknown names, cycles) and every ``${...}`` reference. A reference is
``${endpoints.NAME}`` (NAME's published endpoint: the service itself or one of its dependencies,
direct or not, since only those are published before it starts) or, in ``env`` values only,
``${env.VAR}`` (the orchestrator's environment: secrets stay off command lines, which every user of
the machine can read in the process table). ``$${`` is a literal ``${``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: A service's name: it names files in the run directory, so no separators and no leading dot.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
#: ``${endpoints.NAME}`` or ``${env.VAR}``; ``$${`` escapes.
REFERENCE = re.compile(r"(?<!\$)\$\{([^}]*)\}")
_ENDPOINT_REF = re.compile(r"^endpoints\.([A-Za-z0-9][A-Za-z0-9_-]{0,62})$")
_ENV_REF = re.compile(r"^env\.([A-Za-z_][A-Za-z0-9_]*)$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ReadinessModel(_Strict):
    """When a started service counts as ready: an HTTP URL answering 2xx/3xx, or a command exiting 0
    (run with the service's environment and working directory). Without ``readiness``, a service
    is ready once it has been running for one second."""

    http: str | None = None
    command: list[str] | None = None
    #: One check's limit.
    timeout_s: float = Field(default=5.0, gt=0, le=3600)
    #: Measured from this service's own launch: not ready by then and the stack fails, naming it.
    deadline_s: float = Field(default=120.0, gt=0, le=7 * 86_400)
    #: Between checks.
    interval_s: float = Field(default=0.25, gt=0, le=60)

    @model_validator(mode="after")
    def _one_check(self) -> ReadinessModel:
        if self.http is not None and self.command is not None:
            raise ValueError("give http or command, not both")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("command must name a program")
        if self.http is not None and not re.match(r"^(https?://|\$\{endpoints\.)", self.http):
            raise ValueError(f"http must be an http(s):// URL or start with ${{endpoints.NAME}}, not {self.http!r}")
        return self


class RayOptionsModel(_Strict):
    """Where Ray may place a ``ray`` service's actor: the resources it reserves on the node."""

    num_cpus: float = Field(default=0.0, ge=0, le=10_000)
    num_gpus: float = Field(default=0.0, ge=0, le=1_000)
    resources: dict[str, float] = Field(default_factory=dict)

    def actor_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            out["num_gpus"] = self.num_gpus
        if self.resources:
            out["resources"] = dict(self.resources)
        return out


class ServiceModel(_Strict):
    """One service: a foreground command (it must not detach: its process group is what is watched,
    stopped and killed with its owner) and how it joins the stack."""

    #: The argument vector, or one string split like a shell would (no shell runs it).
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    depends_on: list[str] = Field(default_factory=list)
    readiness: ReadinessModel | None = None
    #: What dependents reach it at: ``{host}`` is replaced by ``advertise_host`` (default 127.0.0.1).
    endpoint: str | None = None
    advertise_host: str | None = None
    #: uni: a local process group, guarded so that it dies with the orchestrator that owns it;
    #: ray: the same, on a Ray node through an actor (``{host}``: that node's address).
    executor: Literal["uni", "ray"] = "uni"
    #: With ``executor: ray``: the actor's resources.
    ray: RayOptionsModel | None = None
    #: The ``training.engines`` entry this service runs: each launch puts it behind the engine gate
    #: (the deployment is not ready until the engine serves the committed head).
    engine: str | None = None

    @model_validator(mode="after")
    def _ray_options(self) -> ServiceModel:
        if self.ray is not None and self.executor != "ray":
            raise ValueError(f"ray options are given, but executor is {self.executor!r} (they apply only to 'ray')")
        return self

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("command")
    @classmethod
    def _program(cls, v: list[str]) -> list[str]:
        if not v or not v[0].strip():
            raise ValueError("must name a program")
        return v

    @field_validator("env")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_KEY.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return v

    @field_validator("depends_on")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names a service twice: {v}")
        return v


class RecoverySettingsModel(_Strict):
    """Managed recovery's bounds: at most ``max_restarts`` restarts within ``window_s``, each after its
    delay. ``deployment.recovery``: a service that fails once the stack was ready stops the stack,
    which is rebuilt from the configuration; ``training.recovery``: a trainer that failed is started
    again (engine/workflows/training/trainer_host.py)."""

    #: 0: no rebuild (fail-stop).
    max_restarts: int = Field(default=3, ge=0, le=100)
    window_s: float = Field(default=300.0, gt=0, le=86_400)
    #: The wait before the 1st, 2nd, ... rebuild in the window (the last one for any later).
    delays_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0], min_length=1, max_length=20)

    @field_validator("delays_s")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(d < 0 or d > 3600 for d in v):
            raise ValueError(f"each delay must be within 0..3600 s, not {v}")
        return v


class HealthSettingsModel(_Strict):
    """The health monitor over ready services: each service with a readiness check is probed with it
    every ``interval_s`` (null: not monitored); a failed check retires the service (its process
    group is killed) and managed recovery rebuilds the stack."""

    interval_s: float | None = Field(default=10.0, gt=0, le=86_400)
    #: One check, and one retirement.
    timeout_s: float = Field(default=5.0, gt=0, le=3600)
    #: After the stack is (again) ready, before the first round.
    first_wait_s: float = Field(default=10.0, ge=0, le=86_400)


class DeploymentSettingsModel(_Strict):
    """``deployment:``: the stack (``services``), where its files go and how long a stop may take."""

    #: Logs (SERVICE.log), SERVICE.worker.json and the private config snapshots (mode 0600); the
    #: directory is created mode 0700.
    run_dir: str = "./run"
    #: Between SIGTERM to a service's process group and SIGKILL.
    stop_grace_s: float = Field(default=10.0, ge=0, le=3600)
    recovery: RecoverySettingsModel = RecoverySettingsModel()
    health: HealthSettingsModel = HealthSettingsModel()
    services: dict[str, ServiceModel] = Field(default_factory=dict)

    @field_validator("services")
    @classmethod
    def _names(cls, v: dict[str, ServiceModel]) -> dict[str, ServiceModel]:
        for name in v:
            if not NAME.match(name):
                raise ValueError(f"{name!r} is not a service name (letters, digits, '_' and '-', "
                                 f"starting with a letter or digit, at most 63)")
        return v

    @model_validator(mode="after")
    def _graph(self) -> DeploymentSettingsModel:
        for name, svc in self.services.items():
            for dep in svc.depends_on:
                if dep == name:
                    raise ValueError(f"services.{name}.depends_on: a service cannot depend on itself")
                if dep not in self.services:
                    raise ValueError(f"services.{name}.depends_on: {dep!r} is not a service of the stack "
                                     f"(declared: {sorted(self.services)})")
        order(self.services)  # raises on a cycle, naming it
        for name, svc in self.services.items():
            reachable = {name, *dependencies(self.services, name)}
            for key, text in _fields(svc):
                for ref in REFERENCE.findall(text):
                    _check_reference(self.services, name, key, ref, reachable)
        return self


def _fields(svc: ServiceModel) -> Iterator[tuple[str, str]]:
    """Each text a reference may appear in, with its key (``command[0]``, ``env.KEY``, ...)."""
    for i, arg in enumerate(svc.command):
        yield f"command[{i}]", arg
    for key, value in svc.env.items():
        yield f"env.{key}", value
    if svc.cwd is not None:
        yield "cwd", svc.cwd
    if svc.readiness is not None and svc.readiness.http is not None:
        yield "readiness.http", svc.readiness.http
    for i, arg in enumerate(svc.readiness.command or [] if svc.readiness is not None else []):
        yield f"readiness.command[{i}]", arg


def _check_reference(services: Mapping[str, ServiceModel], name: str, key: str, ref: str,
                     reachable: set[str]) -> None:
    where = f"services.{name}.{key}"
    env = _ENV_REF.match(ref)
    if env is not None:
        if not key.startswith("env."):
            raise ValueError(f"{where}: ${{{ref}}} may appear only in env values (a command line is "
                             f"readable by every user of the machine)")
        return
    found = _ENDPOINT_REF.match(ref)
    if found is None:
        raise ValueError(f"{where}: ${{{ref}}} is not a reference (${{endpoints.NAME}} or ${{env.VAR}})")
    target = found.group(1)
    if target not in services:
        raise ValueError(f"{where}: ${{endpoints.{target}}} names a service the stack does not declare "
                         f"(declared: {sorted(services)})")
    if services[target].endpoint is None:
        raise ValueError(f"{where}: ${{endpoints.{target}}}: service {target!r} declares no endpoint")
    if target not in reachable:
        raise ValueError(f"{where}: ${{endpoints.{target}}}: {target!r} is not among {name!r}'s dependencies, "
                         f"so its endpoint may not be published when {name!r} starts (add it to depends_on)")


def dependencies(services: Mapping[str, ServiceModel], name: str) -> set[str]:
    """Every service ``name`` depends on, directly or not."""
    seen: set[str] = set()
    todo = list(services[name].depends_on)
    while todo:
        dep = todo.pop()
        if dep not in seen and dep in services:
            seen.add(dep)
            todo.extend(services[dep].depends_on)
    return seen


def order(services: Mapping[str, ServiceModel]) -> list[str]:
    """The services with each one after all of its dependencies (declaration order otherwise);
    ``ValueError`` naming the services of a cycle."""
    done: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: placed

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = [*path[path.index(name):], name]
            raise ValueError(f"services.{name}.depends_on: a dependency cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in services[name].depends_on:
            if dep in services:
                visit(dep, [*path, name])
        state[name] = 2
        done.append(name)

    for name in services:
        visit(name, [])
    return done


def substitute(text: str, endpoints: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """``text`` with its references replaced (``KeyError`` for an unset ``${env.VAR}``)."""

    def one(m: re.Match[str]) -> str:
        ref = m.group(1)
        found = _ENDPOINT_REF.match(ref)
        if found is not None:
            return endpoints[found.group(1)]
        env = _ENV_REF.match(ref)
        if env is not None and environ is not None:
            return environ[env.group(1)]
        raise KeyError(ref)

    return REFERENCE.sub(one, text).replace("$${", "${")


def env_references(svc: ServiceModel) -> dict[str, str]:
    """``{env key: VAR}`` for each ``${env.VAR}`` the service's env values name."""
    out: dict[str, str] = {}
    for key, value in svc.env.items():
        for ref in REFERENCE.findall(value):
            m = _ENV_REF.match(ref)
            if m is not None:
                out[key] = m.group(1)
    return out


def endpoint_of(svc: ServiceModel, node: str | None = None) -> str | None:
    """The endpoint the service publishes: its template with ``{host}`` filled in (IPv6 bracketed):
    ``advertise_host``, else the Ray node's address (``node``), else 127.0.0.1."""
    if svc.endpoint is None:
        return None
    host = svc.advertise_host or node or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return svc.endpoint.replace("{host}", host)
