"""The stack supervisor: brings the configured services up in dependency order, watches them, and
brings them down dependents first — every step a transition of a ``services`` row.

It runs while this orchestrator holds the lease (:meth:`Stack.run`, a leader task) and is the only
writer of the rows. Invariants:

- A process is registered in :attr:`Stack.procs` the moment it exists, before its row says
  ``starting``; every path out of :meth:`run` kills what is registered, and the guards kill the
  groups anyway when this process dies (``engine.workflows.deployment.local``).
- Start-up: independent services start together; a service starts as soon as all of its
  dependencies are ready; its readiness deadline counts from its own launch; services already ready
  are watched for exits meanwhile. The stack is ready only when every service is.
- Fail-stop at start-up: the first failure (an exit, a readiness that never came, a launch that
  failed) cancels the other readiness waits, joins the launches in progress (none escapes), then
  stops everything that was started, dependents first, and leaves readiness absent with the reason
  in the journal. A rebuild that fails to start ends the same way: the supervisor stops.
- Managed recovery: a service that exits once the stack was ready removes readiness, stops every
  other service (their groups confirmed gone), tells the other families (``Deps.rebuilt``: the
  checkpoint family asks for a restore of the latest checkpoint, and holds readiness until it has
  ended), waits the policy's delay (interruptible by a stop or ``tidelog down``) and brings the
  stack up again from the configuration; readiness returns only when every service is ready again.
  Past the policy (:mod:`.policy`), or when a process group cannot be confirmed gone, the
  supervisor stops with readiness absent and the reason recorded.
- Shutdown stops each service only after every service depending on it, and tries every one even
  when some fail.
- Rows a previous owner left live are taken for dead once their process groups are confirmed gone
  (the owner pipe killed them with it); the stack is then brought back from the journal unless an
  operator brought it down (``desired = 'down'``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal

import aiohttp

from journal import Row
from journal.readiness import deployment_held

from engine.runtime.clock import Clock
from engine.workflows.deployment import rows
from engine.workflows.deployment.health import StackHealth, Watched
from engine.workflows.deployment.launch import (
    Launch, prepare_run_dir, probe, resolve, write_snapshot, write_worker_json)
from engine.workflows.deployment.local import LaunchFailed, LocalProcess, group_alive, kill_group
from engine.workflows.deployment.remote import RayProcess, ray_address
from engine.workflows.deployment.plan import Plan
from engine.config.deployment import endpoint_of

log = logging.getLogger("tidelog.deployment")
#: A service without a readiness check is ready once it has been running this long.
SETTLE_S = 1.0
#: How long a new owner waits for a previous owner's process groups to be gone before killing them.
ADOPT_WAIT_S = 10.0


class StartFailed(Exception):
    """A service did not become ready; the message says why (one line)."""


class Stack:
    """The stack of one orchestrator (see the module docstring)."""

    def __init__(self, plan: Plan, holder: str, clock: Clock,
                 journal_read: Callable[[], AbstractAsyncContextManager[Any]] | None = None, *,
                 rebuilt: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.plan, self.holder, self.clock = plan, holder, clock
        #: Awaited once a rebuild's old processes are gone, before the new ones start (``Deps.rebuilt``).
        self.rebuilt = rebuilt
        #: A read transaction of the journal (for :meth:`held`); ``None``: the process view only.
        self.journal_read = journal_read
        self.write: rows.Write | None = None
        #: Launched processes by service name (exited ones included, until stopped).
        self.procs: dict[str, LocalProcess | RayProcess] = {}
        #: The Ray cluster the stack uses (its GCS address), injected into services as ``RAY_ADDRESS``.
        self.ray_address: str | None = None
        #: Ray actors placed for a service whose command is not started yet (killed with the rest).
        self.placed: dict[str, RayProcess] = {}
        #: Each launched service's resolved command and check (the health monitor probes with it).
        self.launches: dict[str, Launch] = {}
        #: The health monitor (``deployment.health``), running while the stack is ready.
        self.health: StackHealth | None = None if plan.health is None else StackHealth(plan.health)
        #: ``${endpoints.NAME}`` as published in this run of the stack.
        self.endpoints: dict[str, str] = {}
        #: down (nothing runs), starting, ready, stopping, recovering (stopped for a rebuild, or waiting
        #: for it), failed (the supervisor stopped; nothing runs until ``tidelog up``).
        # "starting" until the journal was read: "down" would already mean an operator's decision.
        self.state: Literal["down", "starting", "ready", "stopping", "recovering", "failed"] = "starting"
        self.policy = plan.policy()
        #: While a rebuild waits for its delay: when it is due (the clock's monotonic time).
        self.rebuild_at: float | None = None
        self.reason = "the stack is not started yet"
        self._want: Literal["up", "down", "stop"] = "up"
        self._running = False
        self._halted = asyncio.Event()
        self._kick = False
        self._changed = asyncio.Event()
        #: Service name -> why another part of the orchestrator had it replaced (:meth:`replace_engine`).
        self._replaced: dict[str, str] = {}
        self.host = socket.gethostname()

    # -- what the rest of the orchestrator sees -------------------------------------------------------

    def not_ready(self) -> str | None:
        """``None`` when every service is ready, else why not."""
        return None if self.state == "ready" else self.reason

    async def held(self) -> str | None:
        """``/readyz``: :meth:`not_ready`, then what the journal says (an engine of the stack not yet
        put on the committed head by the gate since its launch)."""
        why = self.not_ready()
        if why is not None or self.journal_read is None:
            return why
        async with self.journal_read() as conn:
            return await deployment_held(conn)

    async def replace_engine(self, engine_row: str, why: str) -> bool:
        """Replace the service that runs the ``engines`` row ``engine_row`` (an engine whose memory
        state is unknown): its process group is killed, and managed recovery rebuilds the stack as
        for any failure once it was ready, ``why`` recorded as the reason. False (nothing done)
        when no service of this stack runs it, or the stack is not ready (a rebuild under way
        relaunches it anyway)."""
        name = next((n for n, row in self.plan.engine_rows.items() if row == engine_row), None)
        proc = None if name is None else self.procs.get(name)
        if name is None or proc is None or self.state != "ready" or proc.exited.done():
            return False
        log.warning("service %s: %s; killing it so that the stack is rebuilt", name, why)
        self._replaced[name] = f"{why}: replaced (its process group was killed)"
        proc.kill()
        return True

    def request(self, want: Literal["up", "down"]) -> None:
        """Ask for the stack up (again, after a failure too) or down; the running loop acts on it."""
        self._want, self._kick = want, True
        self._changed.set()

    def wanted(self) -> Literal["up", "down", "stop"]:
        """What was asked for last (read through a call: a request may change it at any await)."""
        return self._want

    async def stop_gracefully(self) -> None:
        """The orchestrator is stopping while it leads: stop every service (dependents first) and
        record it, keeping ``desired`` as it was (the next orchestrator brings the stack back)."""
        if not self._running:
            return
        self._want = "stop"
        self._changed.set()
        await self._halted.wait()

    # -- the leader task ----------------------------------------------------------------------------

    async def run(self, write: rows.Write) -> None:
        """Own the stack until cancelled (the lease lost, the orchestrator stopping)."""
        self.write = write
        self._running = True
        self._halted.clear()
        if self.health is not None:
            self.health = StackHealth(self.health.config)  # a new monitor for each term of leadership
            self.health.start()
        lease = None
        try:
            if any(svc.executor == "ray" for svc in self.plan.services.values()):
                from workers.executor import RayRuntimeLease  # noqa: PLC0415 - Ray only when a service uses it

                lease = await asyncio.to_thread(RayRuntimeLease)
                self.ray_address = ray_address()
            found = await rows.read(write, self.plan)
            await self._adopt(found)
            for name, row in found.items():
                if name not in self.plan.services and row["desired"] != "removed":
                    # No longer declared: kept for its history, no longer part of the deployment.
                    await rows.move(write, name, "stopped", "no longer declared by the configuration",
                                    desired="removed")
            declared = [found[n] for n in self.plan.order]
            if self.wanted() != "stop":  # a stop asked for while the journal was read is kept
                self._want = "down" if declared and all(r["desired"] == "down" for r in declared) else "up"
            if self._want == "down":
                self.state, self.reason = "down", "brought down by an operator (tidelog up brings it back)"
            self._kick = self._want == "up"
            while True:
                if self.wanted() == "stop":
                    if self.procs or self.state != "down":
                        await self.shutdown("stopped: the orchestrator is stopping", desired="up")
                    self._halted.set()
                elif self._want == "down" and self.procs:
                    await self.shutdown("brought down by an operator (tidelog down)", desired="down")
                elif self._want == "down" and self._kick:
                    await self._mark_down()
                elif self._want == "up" and self._kick and self.state in ("starting", "down", "failed"):
                    self._kick = False
                    await self._up()
                    continue  # a request may have come while it started
                self._kick = False
                self._changed.clear()
                exits = [p.exited for p in self.procs.values()]
                waiter = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait([waiter, *exits], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                gone = [n for n, p in self.procs.items() if p.exited.done()]
                if gone and self.state == "ready" and self._want == "up":
                    name = gone[0]
                    code = self.procs[name].exited.result()
                    await self._recover(name, f"exited with code {code} (log: {self.plan.run_dir / name}.log)",
                                        code)
        finally:
            self._running = False
            self._halted.set()
            self.kill_all()
            if self.health is not None:
                try:
                    await self.health.close()
                except (TimeoutError, asyncio.CancelledError):
                    log.warning("the health monitor did not stop in time")
            if lease is not None:
                lease.release()
            if self.state in ("starting", "ready", "stopping"):
                self.state, self.reason = "down", "this orchestrator no longer owns the stack"

    def kill_all(self) -> None:
        """SIGKILL every launched group now (no writes: used when the lease is lost or the task ends)."""
        for proc in [*self.procs.values(), *self.placed.values()]:
            proc.kill()
        self.procs.clear()
        self.placed.clear()

    # -- start-up ---------------------------------------------------------------------------------

    async def _up(self) -> None:
        assert self.write is not None
        self.state, self.reason = "starting", "the stack is starting"
        self.endpoints = {}
        prepare_run_dir(self.plan.run_dir)
        for name in self.plan.order:
            await rows.move(self.write, name, "pending", "the stack is brought up",
                            only_from=frozenset({"stopped", "failed"}), desired="up", owner=None, detail=None)
        starting: dict[str, asyncio.Task[None]] = {}
        ready: set[str] = set()
        failure: tuple[str, str, int | None] | None = None
        async with aiohttp.ClientSession() as http:
            while len(ready) < len(self.plan.order) and failure is None:
                for name in self.plan.order:
                    deps = self.plan.services[name].depends_on
                    if name not in starting and all(d in ready for d in deps):
                        starting[name] = asyncio.create_task(self._start_one(name, http), name=f"start-{name}")
                pending = [t for n, t in starting.items() if n not in ready]
                exits = [self.procs[n].exited for n in ready if n in self.procs]
                if self.wanted() != "up":
                    failure = ("", "brought down while it was starting", None)
                    break
                # Cleared first: a request that came before (the one that started this) must not
                # wake every turn of this loop (its effect is read above); one during the wait does.
                self._changed.clear()
                waiter = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait([*pending, *exits, waiter], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                for name, task in starting.items():
                    if name in ready or not task.done():
                        continue
                    exc = task.exception()
                    if exc is None:
                        ready.add(name)
                    elif failure is None:
                        failure = (name, str(exc) if isinstance(exc, StartFailed | LaunchFailed)
                                   else f"{type(exc).__name__}: {exc}", self._code(name))
                for name in ready:
                    if failure is None and name in self.procs and self.procs[name].exited.done():
                        failure = (name, f"exited with code {self._code(name)} while the stack was starting",
                                   self._code(name))
                if failure is None and self._want != "up":
                    failure = ("", "brought down while it was starting", None)
            # Fail-stop: no readiness wait goes on, and no launch in progress escapes.
            for task in starting.values():
                task.cancel()
            await asyncio.gather(*starting.values(), return_exceptions=True)
            for placed in self.placed.values():
                placed.kill()  # placed on a node, never started: nothing to stop but the actor
            self.placed.clear()
        if failure is None:
            self.state, self.reason = "ready", ""
            if self.health is not None:
                self.health.watch([Watched(n, self.launches[n], p) for n, p in self.procs.items()
                                   if self.plan.services[n].readiness is not None])
            log.info("the stack is ready", extra={"services": list(self.plan.order)})
            return
        name, why, code = failure
        if not name:
            return  # brought down or stopping: the loop stops what was started
        await self._fail_stop(name, why, code)

    def _code(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.exited.result() if proc is not None and proc.exited.done() else None

    async def _start_one(self, name: str, http: aiohttp.ClientSession) -> None:
        """Launch ``name`` and wait until it is ready; ``StartFailed`` otherwise."""
        assert self.write is not None
        svc = self.plan.services[name]
        placed = None
        if svc.executor == "ray":
            # Placed first: {host} in its endpoint is the node Ray chose.
            placed = await RayProcess.place(name, svc.ray.actor_options() if svc.ray is not None else {"num_cpus": 0})
            self.placed[name] = placed
        endpoint = endpoint_of(svc, None if placed is None else placed.host)
        if endpoint is not None:
            self.endpoints[name] = endpoint  # published before its process starts
        launch = resolve(self.plan, name, self.endpoints, self.ray_address)
        write_snapshot(launch, self.endpoints)
        started = self.clock.monotonic()
        proc: LocalProcess | RayProcess
        if placed is not None:
            proc = await placed.launch(launch.argv, launch.env, launch.cwd, launch.log_path, self.plan.stop_grace_s)
            self.placed.pop(name, None)
        else:
            proc = await LocalProcess.launch(name, launch.argv, launch.env, launch.cwd, launch.log_path,
                                             self.plan.stop_grace_s)
        self.procs[name] = proc
        self.launches[name] = launch
        # What the configuration declares now (it may have changed since the row was created).
        declared = {**rows.declared_values(self.plan, name), "command": launch.argv}
        await rows.move(self.write, name, "starting", f"launched (pid {proc.pid})", owner=self.holder,
                        engine_row=self.plan.engine_rows.get(name), **declared,
                        host=proc.host, pids=proc.pids, endpoint=endpoint,
                        log_path=str(launch.log_path), started_at=self.clock.now(), ready_at=None,
                        stopped_at=None, exit_code=None, detail=None)
        write_worker_json(launch, proc.host, proc.pids, svc.executor)
        r = svc.readiness
        deadline_s = 120.0 if r is None else r.deadline_s
        if r is None:
            # No check to wait for: a command that dies at once must not count as started.
            await asyncio.wait([proc.exited], timeout=SETTLE_S)
        while True:
            if proc.exited.done():
                raise StartFailed(f"exited with code {proc.exited.result()} before it was ready "
                                  f"(log: {launch.log_path})")
            why = None if r is None else await probe(launch, http, r.timeout_s, proc.check)
            if why is None:
                break
            left = started + deadline_s - self.clock.monotonic()
            if left <= 0:
                raise StartFailed(f"not ready within {deadline_s:g} s of its start (readiness.deadline_s); "
                                  f"last check: {why}")
            await asyncio.wait([proc.exited], timeout=min(r.interval_s if r else 0.25, left))
        await rows.move(self.write, name, "ready", "its readiness check passed", ready_at=self.clock.now())

    async def _fail_stop(self, name: str, why: str, code: int | None) -> None:
        assert self.write is not None
        log.error("service %s failed: %s; stopping the stack", name, why)
        self.state, self.reason = "stopping", f"service {name} failed: {why}"
        await rows.move(self.write, name, "failed", why, only_from=frozenset({"pending", "starting", "ready"}),
                        exit_code=code, stopped_at=self.clock.now(), detail=why)
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.kill()  # its group's leftovers, if any
        await self.shutdown(f"stopped: service {name} failed: {why}", desired="up")
        self.state, self.reason = "failed", f"service {name} failed: {why}"

    async def _recover(self, name: str, why: str, code: int | None) -> None:
        """A service failed once the stack was ready: rebuild the stack within the policy, or stop."""
        assert self.write is not None
        if self.health is not None and name in self.health.failed:
            why = self.health.failed.pop(name)
        if name in self._replaced:
            why = self._replaced.pop(name)
        delay = self.policy.allow(self.clock.monotonic())
        if delay is None:
            await self._fail_stop(name, f"{why}; {self.policy.refusal()}: the supervisor stopped", code)
            return
        n = len(self.policy.history)
        log.error("service %s failed: %s; rebuilding the stack (restart %d of at most %d within %g s)",
                  name, why, n, self.policy.max_restarts, self.policy.window_s)
        self.state, self.reason = "recovering", f"service {name} failed: {why}; the stack is being rebuilt"
        await rows.move(self.write, name, "failed", why, only_from=frozenset({"ready"}), exit_code=code,
                        stopped_at=self.clock.now(), detail=why)
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.kill()
        failures = await self.shutdown(f"stopped to rebuild the stack: service {name} failed: {why}", desired="up",
                                       recovering=True)
        if failures:
            # A process that cannot be confirmed gone must not be started twice: stop supervising.
            self.state, self.reason = "failed", (f"service {name} failed: {why}; the rebuild was abandoned: "
                                                 f"cleanup failed ({'; '.join(failures)})")
            log.error("%s", self.reason)
            return
        if self.rebuilt is not None:
            # The old processes are gone, the new ones not started: what they held in flight is lost
            # (the checkpoint family asks for the restore of the latest checkpoint here).
            await self.rebuilt(f"service {name} failed: {why}")
        await rows.move(self.write, name, "restarting",
                        f"restart {n} of at most {self.policy.max_restarts} within {self.policy.window_s:g} s, "
                        f"in {delay:g} s", only_from=frozenset({"failed"}), count_restart=True)
        for other in self.plan.order:
            if other != name:
                await rows.move(self.write, other, "pending", f"the stack is rebuilt: service {name} failed",
                                only_from=frozenset({"stopped"}), owner=None)
        self._changed.clear()
        self.rebuild_at = self.clock.monotonic() + delay
        self.reason = f"service {name} failed: {why}; the stack is rebuilt in {delay:g} s"
        sleeper = asyncio.ensure_future(self.clock.sleep(delay))
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait([sleeper, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waiter.cancel()
            self.rebuild_at = None
        if self.wanted() != "up":
            return  # brought down or stopping meanwhile: the loop records it
        await self._up()

    # -- shutdown ---------------------------------------------------------------------------------

    async def shutdown(self, reason: str, *, desired: Literal["up", "down"],
                       recovering: bool = False) -> list[str]:
        """Stop every launched service, each after all of its dependents; record ``desired`` (``down``
        keeps the stack down across restarts until ``tidelog up``). Tries every one; returns what
        failed (``service: why``). ``recovering``: the stack stays ``recovering`` (not ``down``)."""
        assert self.write is not None
        self.state, self.reason = ("recovering", self.reason) if recovering else ("stopping", reason)
        failures: list[str] = []
        if self.health is not None:
            try:
                await self.health.pause()  # no probe may act on what is stopped or replaced now
            except TimeoutError as exc:
                failures.append(f"health monitor: {exc}")
        left = set(self.procs)
        while left:
            level = [n for n in left if not any(d in left for d in self.plan.dependents(n))]
            if not level:  # not a known service's dependency graph (cannot happen): all at once
                level = list(left)
            results = await asyncio.gather(*(self._stop_one(n, reason, desired) for n in level),
                                           return_exceptions=True)
            for n, res in zip(level, results):
                if isinstance(res, BaseException):
                    log.error("stopping service %s failed: %s", n, res)
                    failures.append(f"{n}: {res}")
            left -= set(level)
        if recovering:
            return failures
        await self._mark_down(reason, desired)
        self.state, self.reason = "down", reason
        return failures

    async def _stop_one(self, name: str, reason: str, desired: str) -> None:
        assert self.write is not None
        proc = self.procs[name]
        try:
            moved = await rows.move(self.write, name, "stopping", reason, desired=desired,
                                    only_from=frozenset({"starting", "ready"}))
            code = await proc.stop(self.plan.stop_grace_s)
            if not proc.gone():
                proc.kill()
                raise RuntimeError(f"its process group {proc.pid} outlived the stop")
            if moved:
                await rows.move(self.write, name, "stopped", reason, exit_code=code, stopped_at=self.clock.now(),
                                detail=reason)
        except Exception as exc:
            await rows.move(self.write, name, "failed", f"stop failed: {exc}", only_from=frozenset({"stopping"}),
                            detail=f"stop failed: {exc}")
            raise
        finally:
            self.procs.pop(name, None)

    async def _mark_down(self, reason: str = "brought down by an operator (tidelog down)",
                         desired: str = "down") -> None:
        """Rows with no process: never launched -> ``stopped``; failed ones keep their state and
        reason. Each records ``desired``."""
        assert self.write is not None
        for name in self.plan.order:
            if not await rows.move(self.write, name, "stopped", reason, only_from=frozenset({"pending", "restarting"}),
                                   desired=desired, detail=reason) and desired == "down":
                await rows.move(self.write, name, "stopped", reason, only_from=frozenset({"failed"}),
                                desired=desired)
        if desired == "down":
            self.state, self.reason = "down", "brought down by an operator (tidelog up brings it back)"

    # -- taking over ----------------------------------------------------------------------------------

    async def _adopt(self, found: dict[str, Row]) -> None:
        """Rows a previous owner left live: wait for their groups to be gone (kill them past
        :data:`ADOPT_WAIT_S` if they are on this host), then mark them failed."""
        assert self.write is not None
        live = {n: r for n, r in found.items() if r.state in rows.LIVE}
        local = {n: r for n, r in live.items() if r["host"] == self.host}
        waited = 0.0
        while any(group_alive(r["pids"]) for r in local.values()) and waited < ADOPT_WAIT_S:
            await asyncio.sleep(0.1)
            waited += 0.1
        for name, row in live.items():
            if name in local and group_alive(row["pids"]):
                kill_group(row["pids"])
                why = (f"its owner {row['owner']} is gone; its process group outlived it for "
                       f"{ADOPT_WAIT_S:g} s and was killed")
            elif name in local:
                why = f"its owner {row['owner']} is gone; its processes died with it (owner lease)"
            else:
                why = (f"its owner {row['owner']} is gone; its processes on {row['host']} die with it "
                       f"(owner lease; not checked from here)")
            await rows.move(self.write, name, "failed", why, exit_code=None, stopped_at=self.clock.now(),
                            detail=why)

