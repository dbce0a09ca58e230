"""What every reference participant shares: arguments, the control plane, step counts, serving.

A reference server is an aiohttp application with the checkpoint routes mounted
(:func:`build`), its data routes under ``/ng-rollout/<capture key>/...``, and a
``main`` that serves it until SIGTERM/SIGINT. Typed protocol errors raised by a
data route are answered with their JSON body and status (:func:`protocol_errors`),
and so are aiohttp's own 4xx replies. Data routes read at most
:data:`DATA_MAX_BODY` bytes and keep text fields of at most :data:`MAX_TEXT_CHARS`
characters. Every commit and restore must lie under ``--checkpoint-root``.
Start-up errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sqlite3
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import orjson
from aiohttp import web

from ..http_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, Handler, runner_options
from ..participant import ControlPlane, Participant, mount
from ..participant.routes import CONTROL_MAX_SIZE
from ..protocol import EpisodeId, ErrorCode, ProtocolError

TOKEN_ENV = "TIDELOG_CONTROL_TOKEN"
ROLLOUT_PREFIX = "/ng-rollout/{key}"

log = logging.getLogger("tidelog.reference")


class Executions:
    """How many times each step of each episode ran in this process: ``{capture key: {step: n}}``."""

    def __init__(self) -> None:
        self._counts: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))

    def count(self, key: str, step: str) -> None:
        self._counts[key][step] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {key: dict(steps) for key, steps in sorted(self._counts.items())}


class StartupError(Exception):
    """A reason the server cannot start, said in one line (``main`` prints it and exits 2)."""


def finite_float(*, minimum: float | None = None, above: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number (``nan`` and ``inf`` refused), optionally bounded below."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum:g}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"{text!r} must be > {above:g}")
        return value
    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return value


#: The default checkpoint root, resolved against the working directory at start-up: the same path
#: as the orchestrator's default ``checkpoint.directory``, so processes started in one directory agree.
DEFAULT_CHECKPOINT_ROOT = "checkpoints"


def parser(kind: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m workers.reference.{kind}", description=description)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, required=True, help="port to listen on (0: any free port)")
    p.add_argument("--state-dir", type=Path, required=True,
                   help="where this participant keeps its local state (its retire marks)")
    p.add_argument("--checkpoint-root", type=Path, default=Path(DEFAULT_CHECKPOINT_ROOT),
                   help="the directory every checkpoint this participant writes or reads must lie under "
                        "(a commit's or restore's checkpoint_dir elsewhere is refused); the orchestrator "
                        "sends <its checkpoint directory>/<checkpoint id>, so give a directory holding "
                        f"that (default ./{DEFAULT_CHECKPOINT_ROOT}, resolved at start-up)")
    p.add_argument("--instance", default=f"{kind}-0", help=f"participant instance name (default {kind}-0)")
    p.add_argument("--lease-grace-seconds", type=finite_float(above=0), default=600.0,
                   help="how long past a call's deadline a checkpoint's lease lasts (default 600)")
    p.add_argument("--header-timeout-s", type=finite_float(above=0), default=HEADER_TIMEOUT_S,
                   help=f"a client must send a whole request head this soon (default {HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout-s", type=finite_float(above=0), default=BODY_TIMEOUT_S,
                   help=f"a request body must arrive whole this soon after its head (default {BODY_TIMEOUT_S:g})")
    return p


def control_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise StartupError(f"{TOKEN_ENV} is not set: the checkpoint routes need a control token")
    return token


#: The largest body a reference data route reads (4 MiB): a conversation of 100 turns with long
#: actions fits; a 60 MB prompt does not, and is answered 413 ``request_too_large`` unread.
DATA_MAX_BODY = 4 << 20
#: The longest prompt, action or other text field a data route keeps (characters).
MAX_TEXT_CHARS = 100_000


def build(participant: Participant, args: argparse.Namespace, token: str) -> web.Application:
    """An application with the checkpoint routes of ``participant`` mounted.

    Raises :class:`StartupError` for a state directory or checkpoint root it cannot use.
    """
    if not args.lease_grace_seconds > 0 or not math.isfinite(args.lease_grace_seconds):
        raise StartupError(f"--lease-grace-seconds must be a finite number > 0, not {args.lease_grace_seconds}")
    root = Path(os.path.abspath(args.checkpoint_root))
    if root.exists() and not root.is_dir():
        raise StartupError(f"--checkpoint-root {str(root)!r} is not a directory")
    try:
        control = ControlPlane(participant, state_dir=args.state_dir, checkpoint_root=root,
                               lease_grace_seconds=args.lease_grace_seconds)
    except (OSError, sqlite3.Error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StartupError(f"--state-dir {str(args.state_dir)!r} cannot hold this participant's state: "
                           f"{reason}") from None
    for flag in ("header_timeout_s", "body_timeout_s"):
        value = getattr(args, flag, 1.0)
        if not 0 < value <= 3600:
            raise StartupError(f"--{flag.replace('_', '-')} must be > 0 and at most 3600, not {value:g}")
    body_timeout_s = getattr(args, "body_timeout_s", BODY_TIMEOUT_S)
    app = web.Application(middlewares=[protocol_errors], client_max_size=CONTROL_MAX_SIZE)
    app[BODY_TIMEOUT] = body_timeout_s
    mount(app, control, token=token, body_timeout_s=body_timeout_s)
    return app


#: The app's body deadline (``--body-timeout-s``), read by :func:`read_body`.
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("body_timeout_s", float)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                        headers=headers)


@web.middleware
async def protocol_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every refusal in the JSON error shape: a :class:`ProtocolError` from a data route
    with its typed body and status, and aiohttp's own 4xx replies (a body over ``client_max_size``,
    an unknown route, a wrong method) with their status and a code naming them."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return json_response(exc.body(), exc.status)
    except web.HTTPRequestEntityTooLarge:
        err = ProtocolError(ErrorCode.REQUEST_TOO_LARGE,
                            f"the body of {request.method} {request.path} is larger than this server accepts")
        return json_response(err.body(), err.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return json_response({"error": {"code": code, "detail": f"{request.method} {request.path}: "
                                                                f"{exc.reason}"}}, exc.status)


def episode_of(request: web.Request) -> EpisodeId:
    """The episode a ``/ng-rollout/<capture key>/...`` request belongs to."""
    key = request.match_info["key"]
    try:
        return EpisodeId.from_capture_key(key)
    except ValueError:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{key!r} is not a capture key") from None


async def read_body(request: web.Request, limit: int = DATA_MAX_BODY) -> bytes:
    """The request body, at most ``limit`` bytes: a longer one (by its ``Content-Length`` or as
    read) is 413 ``request_too_large`` and is not kept."""
    too_large = ProtocolError(ErrorCode.REQUEST_TOO_LARGE,
                              f"the body of {request.path} is larger than the {limit} bytes a data route reads")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    timeout = request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.read(64 * 1024):
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ProtocolError(ErrorCode.BODY_TIMEOUT, f"the body of {request.path} did not arrive within "
                                                    f"{timeout:g} s") from None
    return b"".join(chunks)


async def read_json(request: web.Request, limit: int = DATA_MAX_BODY) -> dict[str, Any]:
    """The body as a JSON object, read with :func:`read_body`; 422 ``invalid_request`` otherwise."""
    raw = await read_body(request, limit)
    try:
        body = orjson.loads(raw)
    except Exception:  # JSONDecodeError, nesting past the parser's limit: the body is bad
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the body is not a JSON object")
    return body


def text_field(body: dict[str, Any], name: str, *, limit: int = MAX_TEXT_CHARS) -> str:
    """``body[name]``: a non-empty string of at most ``limit`` characters (422 ``invalid_request``)."""
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{name} must be a non-empty string")
    if len(value) > limit:
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"{name} is {len(value)} characters, more than the {limit} a data route keeps")
    return value


def serve(app: web.Application, args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT; print ``listening on http://host:port`` once bound.

    A failure to start (the address in use, a bad host) is a :class:`StartupError`.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def run() -> None:
        # A client must send its request head within HEADER_TIMEOUT_S (workers/http_limits.py).
        runner = web.AppRunner(app, **runner_options(getattr(args, "header_timeout_s", HEADER_TIMEOUT_S)))
        try:
            await runner.setup()
            site = web.TCPSite(runner, args.host, args.port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise StartupError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
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
    """Parse, build, serve. Every start-up error is one line on stderr and exit code 2 (argparse's
    own usage errors already are exit 2), never a traceback."""
    args = p.parse_args(argv)
    try:
        app = build_app(args, control_token())
        serve(app, args)
    except StartupError as exc:
        _fail(p, str(exc))
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a build_app check said what is wrong
            _fail(p, exc.code)
        raise


def _fail(p: argparse.ArgumentParser, message: str) -> NoReturn:
    print(f"{p.prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
