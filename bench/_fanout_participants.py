"""Participant processes for ``bench/checkpoint_fanout.py``: many kit participants in one event loop.

One process serves ``--servers`` real participants from ``workers/participant`` (the kinds spread
round-robin over environment, model, agent, resources), each its own aiohttp application on its own
loopback port, all in one event loop. Each server's control plane is a :class:`ControlPlane` with
the routes :func:`workers.participant.routes.mount` installs, behind a middleware that records, per
control request, its arrival and the moment its reply was ready (``time.time()``, so the bench can
compare them with its own clock and with the orchestrator's).

Each environment server runs ``--episodes`` episodes that step forever (a ``replay`` step of
``--step-s`` seconds, then a boundary), so a checkpoint parks and exports real episodes and the
commit scope is not empty (``--episodes 0``: none).

Each environment server also serves ``POST /run`` (``bench/rollouts.py`` dispatches through it): body
``{"rollout_id": "<id>" | "<id>-a<N>", "task": {"hold"?: bool}}``. The attempt runs as a kit episode of
one step: a boundary, one ``replay`` step, a boundary, then the reply ``{"rollout_id", "attempt",
"reward"}``. A ``hold`` task's step lasts until ``POST /release`` (so it is in flight while a
checkpoint runs); any other's step is immediate. A refusal (``checkpoint_parked``, ``stale_attempt``)
is the protocol's typed error body.

A small admin application on its own port serves the bench:

- ``GET /log``: every recorded control request ``[server, op, arrived, finished, status]``
  (``finished`` and ``status`` are ``null`` while it is being handled);
- ``POST /reset``: forget the records;
- ``POST /block?server=NAME``: start, on that environment server, an episode whose next step is a
  ``wait`` step that lasts until ``POST /unblock`` — a prepare of that server then waits (the
  recovery scenario's checkpoint stays open);
- ``POST /release``: end the step of every ``hold`` rollout, now and from now on (``POST
  /hold`` makes new ``hold`` rollouts wait again);
- ``GET /episodes``: ``{"live": N, "runs": M}``, the episodes in progress on this process's
  environment servers and the ``/run`` attempts they finished.

The process prints one JSON line ``{"admin": url, "servers": [{"name", "kind", "url"}, ...]}`` once
every server listens, and runs until SIGTERM/SIGINT or until its stdin closes. The control token
comes from ``TIDELOG_CONTROL_TOKEN``, as for the reference participants.

    TIDELOG_CONTROL_TOKEN=t python bench/_fanout_participants.py --first 0 --servers 64 --state-dir /tmp/p0
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.participant import ControlPlane, mount  # noqa: E402
from workers.participant.base import Participant  # noqa: E402
from workers.participant.kinds import (AgentParticipant, EnvironmentParticipant,  # noqa: E402
                                       PolicyModelParticipant, ResourcesParticipant)
from workers.participant.routes import CONTROL_MAX_SIZE  # noqa: E402
from workers.protocol import CONTROL_PREFIX, EpisodeId, ErrorCode, ProtocolError  # noqa: E402
from workers.reference._common import json_response, protocol_errors, read_json  # noqa: E402

KINDS = ("environment", "model", "agent", "resources")
OPS = {f"{CONTROL_PREFIX}/{op}": op for op in ("prepare", "commit", "resume", "renew", "restore", "retire",
                                                "forget", "status")}


def build(kind: str, name: str) -> Participant:
    if kind == "environment":
        return EnvironmentParticipant(name)
    if kind == "model":
        return PolicyModelParticipant(name)
    if kind == "agent":
        return AgentParticipant(name)  # restart-only: no session hooks
    return ResourcesParticipant(name, mode="stateless")


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log: list[list[Any]] = []
        self.envs: dict[str, EnvironmentParticipant] = {}
        self.unblock = asyncio.Event()
        self.released = asyncio.Event()
        self.live = 0
        self.runs = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.runners: list[web.AppRunner] = []

    def middleware(self, name: str) -> Any:
        log = self.log

        @web.middleware
        async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
            op = OPS.get(request.path)
            if op is None:
                response: web.StreamResponse = await handler(request)
                return response
            # Logged on arrival (finished and status filled in later), so that a call still
            # being handled is already visible to the bench.
            record: list[Any] = [name, op, time.time(), None, None]
            log.append(record)
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
                record[3], record[4] = time.time(), status
        return timed

    async def episode(self, participant: EnvironmentParticipant, rollout_id: str) -> None:
        step_s = self.args.step_s
        async with participant.episode(EpisodeId(rollout_id=rollout_id), {"task": rollout_id}) as ep:
            i = 0
            while True:
                await ep.boundary({"step": i, "observation": f"{rollout_id} step {i} " + "x" * 200})
                async with ep.step("replay"):
                    await asyncio.sleep(step_s)
                i += 1

    async def blocker(self, participant: EnvironmentParticipant) -> None:
        async with participant.episode(EpisodeId(rollout_id=f"{participant.instance}-blocker"), {"b": 1}) as ep:
            await ep.boundary({"step": 0})
            async with ep.step("wait"):
                await self.unblock.wait()

    def run_route(self, participant: EnvironmentParticipant) -> Any:
        async def run(request: web.Request) -> web.Response:
            body = await read_json(request)
            try:
                episode = EpisodeId.from_capture_key(body["rollout_id"])
                task = body["task"]
            except (KeyError, TypeError, ValueError):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "a /run body is {rollout_id, task}") from None
            async with participant.episode(episode, task) as ep:
                self.live += 1
                try:
                    await ep.boundary({"step": 0})
                    async with ep.step("replay"):
                        if isinstance(task, dict) and task.get("hold"):
                            await self.released.wait()
                    await ep.boundary({"step": 1})
                finally:
                    self.live -= 1
            self.runs += 1
            return json_response({"rollout_id": episode.rollout_id, "attempt": episode.attempt, "reward": 1.0})
        return run

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self) -> dict[str, Any]:
        a = self.args
        servers = []
        for i in range(a.first, a.first + a.servers):
            kind = a.kinds[i % len(a.kinds)]
            name = f"{kind}-{i:04d}"
            participant = build(kind, name)
            control = ControlPlane(participant, state_dir=Path(a.state_dir) / name,
                                   checkpoint_root=a.checkpoint_root or Path(a.state_dir).resolve().parent)
            app = web.Application(client_max_size=CONTROL_MAX_SIZE,
                                  middlewares=[self.middleware(name), protocol_errors])
            mount(app, control, token=os.environ["TIDELOG_CONTROL_TOKEN"])
            if isinstance(participant, EnvironmentParticipant):
                app.router.add_post("/run", self.run_route(participant))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            self.runners.append(runner)
            port = runner.addresses[0][1]
            servers.append({"name": name, "kind": kind, "url": f"http://127.0.0.1:{port}"})
            if isinstance(participant, EnvironmentParticipant):
                self.envs[name] = participant
                for e in range(a.episodes):
                    self.spawn(self.episode(participant, f"{name}-r{e}"))
        admin = web.Application()
        admin.router.add_get("/log", self.get_log)
        admin.router.add_post("/reset", self.reset)
        admin.router.add_post("/block", self.block)
        admin.router.add_post("/unblock", self.release)
        admin.router.add_post("/release", self.release_holds)
        admin.router.add_post("/hold", self.hold)
        admin.router.add_get("/episodes", self.episodes)
        runner = web.AppRunner(admin, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return {"admin": f"http://127.0.0.1:{runner.addresses[0][1]}", "servers": servers}

    async def get_log(self, _request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.log), content_type="application/json")

    async def reset(self, _request: web.Request) -> web.Response:
        self.log.clear()
        return web.json_response({"ok": True})

    async def block(self, request: web.Request) -> web.Response:
        self.unblock.clear()
        self.spawn(self.blocker(self.envs[request.query["server"]]))
        await asyncio.sleep(0.05)  # the episode is inside its wait step
        return web.json_response({"ok": True})

    async def release(self, _request: web.Request) -> web.Response:
        self.unblock.set()
        return web.json_response({"ok": True})

    async def release_holds(self, _request: web.Request) -> web.Response:
        self.released.set()
        return web.json_response({"ok": True})

    async def hold(self, _request: web.Request) -> web.Response:
        self.released.clear()
        return web.json_response({"ok": True})

    async def episodes(self, _request: web.Request) -> web.Response:
        return web.json_response({"live": self.live, "runs": self.runs})

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for runner in self.runners:
            await runner.cleanup()


async def main_async(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    info = await fleet.start()
    sys.stdout.write(orjson.dumps(info).decode() + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The bench holds our stdin: when it goes away (even killed), so do we.
    stdin = sys.stdin.fileno()
    loop.add_reader(stdin, lambda: None if os.read(stdin, 4096) else stop.set())
    await stop.wait()
    await fleet.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first", type=int, default=0, help="index of the first server (names and kinds)")
    p.add_argument("--servers", type=int, default=64)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--checkpoint-root", default=None,
                   help="where every checkpoint must lie (default: the state directory's parent)")
    p.add_argument("--episodes", type=int, default=2, help="live episodes per environment server")
    p.add_argument("--step-s", type=float, default=0.5, help="length of an episode's replay step")
    p.add_argument("--kinds", type=lambda v: tuple(v.split(",")), default=KINDS,
                   help="the kinds, round-robin over the servers (default: all four)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
