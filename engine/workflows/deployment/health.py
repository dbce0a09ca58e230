"""The stack's health monitor: every ready service with a readiness check is probed with that check
by :class:`workers.health.EngineHealthMonitor` (interval, timeout and first wait from
``deployment.health``). A service that fails a check is retired by killing the very process the
probe was made for, so managed recovery rebuilds the stack; the monitor's epochs make a probe that
outlived a pause (a rebuild under way) unable to retire the replacement.

The monitor runs only while the stack is ready: :meth:`StackHealth.watch` after start-up, and
:meth:`StackHealth.pause` (which waits for an active probe or retirement to end) before anything is
stopped or replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from workers.health import EngineHealthMonitor, EngineSlots, HealthMonitorConfig

from engine.workflows.deployment.launch import Launch, probe
from engine.workflows.deployment.local import LocalProcess
from engine.workflows.deployment.remote import RayProcess


@dataclass
class Watched:
    """One service as the monitor sees it: its resolved check and the process it was made for."""

    name: str
    launch: Launch
    proc: LocalProcess | RayProcess
    last: str | None = None


class StackHealth:
    def __init__(self, config: HealthMonitorConfig) -> None:
        self.config = config
        self.slots: EngineSlots[Watched] = EngineSlots(self._check, self._retire)
        self.monitor = EngineHealthMonitor(self.slots, config)
        #: Service name -> why its health check retired it (read once by the stack's recovery).
        self.failed: dict[str, str] = {}
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.monitor.start()

    def watch(self, services: list[Watched]) -> None:
        """Probe these services from now on (a new epoch: what a previous one found is void)."""
        self.slots = EngineSlots(self._check, self._retire, services)
        self.monitor.source = self.slots
        if services:
            self.monitor.resume()

    async def pause(self) -> None:
        """No probe runs after this returns (``TimeoutError`` if one could not be drained)."""
        await self.monitor.pause()

    async def close(self) -> None:
        try:
            await self.monitor.stop()
        finally:
            if self._http is not None:
                await self._http.close()
                self._http = None

    async def _check(self, svc: Watched, timeout: float) -> bool:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        svc.last = await probe(svc.launch, self._http, timeout, svc.proc.check)
        return svc.last is None

    async def _retire(self, svc: Watched, timeout: float) -> None:
        self.failed[svc.name] = (f"failed its health check ({svc.last or f'no answer within {timeout:g} s'}); "
                                 f"its process group was killed")
        svc.proc.kill()
