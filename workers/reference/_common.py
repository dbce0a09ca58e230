"""What every reference participant shares: arguments, the control plane, step counts, serving.

A reference server is an aiohttp application with the checkpoint routes mounted
(:func:`build`), its data routes under ``/ng-rollout/<capture key>/...``, and a
``main`` that serves it until SIGTERM/SIGINT. Typed protocol errors raised by a
data route are answered with their JSON body and status (:func:`protocol_errors`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from ..participant import ControlPlane, Participant, mount
from ..participant.routes import CONTROL_MAX_SIZE
from ..protocol import EpisodeId, ErrorCode, ProtocolError

TOKEN_ENV = "TIDELOG_CONTROL_TOKEN"
ROLLOUT_PREFIX = "/ng-rollout/{key}"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("tidelog.reference")


class Executions:
    """How many times each step of each episode ran in this process: ``{capture key: {step: n}}``."""

    def __init__(self) -> None:
        self._counts: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))

    def count(self, key: str, step: str) -> None:
        self._counts[key][step] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {key: dict(steps) for key, steps in sorted(self._counts.items())}


def parser(kind: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m workers.reference.{kind}", description=description)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    p.add_argument("--state-dir", type=Path, required=True,
                   help="where this participant keeps its local state (its retire marks)")
    p.add_argument("--instance", default=f"{kind}-0", help=f"participant instance name (default {kind}-0)")
    p.add_argument("--lease-grace-seconds", type=float, default=600.0,
                   help="how long past a call's deadline a checkpoint's lease lasts (default 600)")
    return p


def control_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"{TOKEN_ENV} is not set: the checkpoint routes need a control token")
    return token


def build(participant: Participant, args: argparse.Namespace, token: str) -> web.Application:
    """An application with the checkpoint routes of ``participant`` mounted."""
    if args.lease_grace_seconds <= 0:
        raise SystemExit(f"--lease-grace-seconds must be > 0, not {args.lease_grace_seconds}")
    control = ControlPlane(participant, state_dir=args.state_dir, lease_grace_seconds=args.lease_grace_seconds)
    app = web.Application(middlewares=[protocol_errors], client_max_size=CONTROL_MAX_SIZE)
    mount(app, control, token=token)
    return app


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                        headers=headers)


@web.middleware
async def protocol_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer a :class:`ProtocolError` from a data route with its typed body and status."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return json_response(exc.body(), exc.status)


def episode_of(request: web.Request) -> EpisodeId:
    """The episode a ``/ng-rollout/<capture key>/...`` request belongs to."""
    key = request.match_info["key"]
    try:
        return EpisodeId.from_capture_key(key)
    except ValueError:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{key!r} is not a capture key") from None


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the body is not a JSON object")
    return body


def serve(app: web.Application, args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT; print ``listening on http://host:port`` once bound."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"listening on http://{args.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
    asyncio.run(run())


def main(argv: Sequence[str] | None, build_app: Callable[[argparse.Namespace, str], web.Application],
         p: argparse.ArgumentParser) -> None:
    args = p.parse_args(argv)
    serve(build_app(args, control_token()), args)
