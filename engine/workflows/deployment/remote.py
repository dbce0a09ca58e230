"""The ``ray`` executor: one service placed on a Ray node through a :class:`workers.services.host.ServiceHost`
actor, which runs it there under the process guard.

:meth:`RayProcess.place` creates the actor (with the service's Ray options) and learns its node's
address before anything starts, so that ``{host}`` in the endpoint is that node; :meth:`RayProcess.start`
then starts the command. The actor is not detached: Ray kills it when this orchestrator (its driver)
dies, and its guard then kills the service's group. Every signal goes through the actor; a pid of
another node is never signalled from here. The log is read back from the node and appended to
``run_dir/SERVICE.log`` while the service runs.

Ray is imported only when a service uses this executor; the runtime is the process-wide lease the
trainer's Ray executor shares (``RAY_ADDRESS``, else a local cluster; one already initialized is
borrowed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.services.host import ServiceHost

from engine.workflows.deployment.local import LaunchFailed

log = logging.getLogger("tidelog.deployment")
#: How long one ``wait`` call holds the actor (its calls run one at a time).
POLL_S = 0.2


def _ray() -> Any:
    import ray  # noqa: PLC0415 - Ray is optional; imported only when a service uses it

    return ray


def ray_address() -> str | None:
    """The address of the cluster this process is connected to (its GCS), or ``None``."""
    try:
        return str(_ray().get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - not connected, or an older Ray without it
        return None


class RayProcess:
    """A service on a Ray node; the same surface as :class:`~.local.LocalProcess`."""

    def __init__(self, name: str, actor: Any, host: str) -> None:
        self.name, self.actor, self.host = name, actor, host
        self.pid = 0
        self.start: int | None = None
        self._exit: asyncio.Task[int] | None = None

    @classmethod
    async def place(cls, name: str, options: Mapping[str, Any]) -> RayProcess:
        """Create the service's actor on a node Ray picks (``options``: its resources); ``LaunchFailed``
        when it cannot be placed."""
        ray = _ray()
        host_cls = ray.remote(ServiceHost)
        opts = {"num_cpus": 0, **dict(options)}
        try:
            actor = host_cls.options(max_restarts=0, max_task_retries=0, **opts).remote(name)
        except Exception as exc:  # noqa: BLE001 - any failure to place it is a launch failure, named
            raise LaunchFailed(f"cannot place it on a Ray node: {type(exc).__name__}: {exc}") from None
        try:
            node = await actor.node.remote()
        except BaseException as exc:
            ray.kill(actor, no_restart=True)  # cancelled (a peer failed) or not placed: none left behind
            if isinstance(exc, Exception):
                raise LaunchFailed(f"cannot place it on a Ray node: {type(exc).__name__}: {exc}") from None
            raise
        return cls(name, actor, str(node))

    async def launch(self, argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path,
                     grace_s: float) -> RayProcess:
        try:
            said = await self.actor.start.remote(argv, env, cwd, grace_s)
        except BaseException:
            self.kill()
            raise
        if "pid" not in said:
            self.kill()
            raise LaunchFailed(str(said.get("error")))
        self.pid, self.start = int(said["pid"]), said.get("start")
        self._exit = asyncio.ensure_future(self._watch(log_path))
        return self

    async def _watch(self, log_path: Path) -> int:
        """Poll the actor for the exit, appending the node's log to ``log_path`` meanwhile."""
        offset = 0
        code: int | None = None
        with open(log_path, "ab") as out:
            while True:
                try:
                    code = await self.actor.wait.remote(POLL_S)
                    while True:
                        data, offset = await self.actor.read_log.remote(offset)
                        out.write(data)
                        out.flush()
                        if not data:
                            break
                except Exception as exc:  # noqa: BLE001 - the actor (or its node) is gone, and the service with it
                    log.warning("service %s: its Ray actor is gone (%s)", self.name, type(exc).__name__)
                    return 255
                if code is not None:
                    return int(code)

    @property
    def exited(self) -> asyncio.Task[int]:
        assert self._exit is not None
        return self._exit

    @property
    def pids(self) -> dict[str, int | None]:
        return {"service": self.pid, "start": self.start}

    async def stop(self, grace_s: float) -> int:
        try:
            code = int(await self.actor.stop.remote(grace_s))
        except Exception:  # noqa: BLE001 - the actor is gone: so is the group (its guard saw EOF)
            code = 255
        if self._exit is not None:
            await asyncio.gather(self._exit, return_exceptions=True)
        self.kill()
        return code

    def gone(self) -> bool:
        """Whether the group is confirmed gone: the guard reported the exit (it kills the group's
        leftovers before it does)."""
        return self._exit is not None and self._exit.done()

    def kill(self) -> None:
        """End the actor: its process's end closes the owner pipe, and the guard kills the group."""
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    async def check(self, argv: list[str], env: dict[str, str], cwd: str | None, timeout: float) -> str | None:
        """A readiness command on the service's node: ``None`` when it exited 0, else why not."""
        said = await self.actor.check.remote(argv, env, cwd, timeout)
        return None if said == 0 else (said if isinstance(said, str) else f"readiness command exited {said}")
