"""One service's launch: its resolved command and environment, its files in the run directory
(``SERVICE.log``, ``SERVICE.worker.json``, the private ``SERVICE.config.json``) and its readiness check.

What a service inherits: the orchestrator's environment without its own ``TIDELOG_*`` secrets (a
service that needs one names it: ``env: {TIDELOG_CONTROL_TOKEN: "${env.TIDELOG_CONTROL_TOKEN}"}``)
and, when a service of the stack runs on Ray, ``RAY_ADDRESS`` (the cluster the stack uses), then its
``env``, then ``TIDELOG_SERVICE`` (its name) and ``TIDELOG_SERVICE_CONFIG`` (its snapshot).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from workers.files import write_atomically

from engine.workflows.deployment.plan import Plan
from engine.config.deployment import substitute


@dataclass(frozen=True)
class Launch:
    """A service resolved against the endpoints published when it starts."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    endpoint: str | None
    http: str | None
    check: list[str] | None
    log_path: Path
    snapshot: Path
    worker_json: Path

    @property
    def env_keys(self) -> list[str]:
        """The names of the variables of its environment, ``TIDELOG_SERVICE*`` aside (what its
        private snapshot records)."""
        return sorted(k for k in self.env if not k.startswith("TIDELOG_SERVICE"))


def resolve(plan: Plan, name: str, endpoints: Mapping[str, str], ray_address: str | None = None) -> Launch:
    """``name`` with its references replaced; ``endpoints`` holds every endpoint published so far
    (its own and its dependencies' at least: the configuration was checked for that). With Ray in
    use, ``RAY_ADDRESS`` is the cluster the stack uses (unless the service sets its own)."""
    svc = plan.services[name]
    base = {k: v for k, v in plan.environ.items() if not k.startswith("TIDELOG_")}
    if ray_address is not None:
        base["RAY_ADDRESS"] = ray_address
    env = {**base, **{k: substitute(v, endpoints, plan.environ) for k, v in svc.env.items()}}
    run = plan.run_dir
    snapshot = run / f"{name}.config.json"
    env.update({"TIDELOG_SERVICE": name, "TIDELOG_SERVICE_CONFIG": str(snapshot)})
    r = svc.readiness
    return Launch(
        name=name, argv=[substitute(a, endpoints) for a in svc.command], env=env,
        cwd=None if svc.cwd is None else substitute(svc.cwd, endpoints), endpoint=endpoints.get(name),
        http=None if r is None or r.http is None else substitute(r.http, endpoints),
        check=None if r is None or r.command is None else [substitute(a, endpoints) for a in r.command],
        log_path=run / f"{name}.log", snapshot=snapshot, worker_json=run / f"{name}.worker.json")


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory readable by this user only (logs may hold what a service prints)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)


def write_snapshot(launch: Launch, endpoints: Mapping[str, str]) -> None:
    """The service's private configuration (mode 0600: its environment may hold secrets): its own
    resolved command and environment and every endpoint published so far."""
    body = {"service": launch.name, "command": launch.argv, "cwd": launch.cwd, "endpoint": launch.endpoint,
            "endpoints": dict(endpoints), "env": {k: launch.env[k] for k in launch.env_keys}}
    # write_atomically's temporary file (mkstemp) is created 0600 and renamed over the old one, so the
    # snapshot is never readable by another user, not even for a moment.
    write_atomically(launch.snapshot, json.dumps(body, indent=2).encode())


def write_worker_json(launch: Launch, host: str, pids: Mapping[str, Any], executor: str) -> None:
    """``SERVICE.worker.json``: where its processes run and where its log is; never a secret."""
    body = {"service": launch.name, "executor": executor, "host": host, "pids": dict(pids),
            "log_dir": str(launch.log_path.parent), "log": str(launch.log_path), "endpoint": launch.endpoint}
    write_atomically(launch.worker_json, json.dumps(body, indent=2).encode())


#: Runs a readiness command on the service's node: ``(argv, env, cwd, timeout) -> None | why not``.
RemoteCheck = Callable[[list[str], dict[str, str], "str | None", float], Awaitable["str | None"]]


async def probe(launch: Launch, http: aiohttp.ClientSession, timeout_s: float,
                remote: RemoteCheck | None = None) -> str | None:
    """One readiness check: ``None`` when ready, else why not (one line). A command runs here, or
    through ``remote`` on the service's node (a ``ray`` service)."""
    if launch.http is not None:
        try:
            async with http.get(launch.http, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                allow_redirects=False) as resp:
                return None if resp.status < 400 else f"GET {launch.http}: HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"GET {launch.http}: {type(exc).__name__}: {exc}".rstrip(": ")
    if launch.check is not None and remote is not None:
        try:
            return await remote(launch.check, launch.env, launch.cwd, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the node or its actor did not answer: not ready
            return f"readiness command on the service's node: {type(exc).__name__}: {exc}"
    if launch.check is not None:
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.check, env=launch.env, cwd=launch.cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return f"readiness command {launch.check[0]!r}: {exc.strerror or exc}"
        try:
            code = await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            return f"readiness command did not finish within {timeout_s:g} s"
        finally:
            if proc.returncode is None:  # cancelled: no check outlives its wait
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return None if code == 0 else f"readiness command exited {code}"
    return None
