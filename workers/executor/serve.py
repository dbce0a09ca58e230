"""One worker rank served over HTTP: the far side of the ``http`` executor (``workers.executor._http``),
so a trainer can be a service of the deployment's stack — started, watched and rebuilt by the
orchestrator like any other process, on any host it can reach.

    python -m workers.executor.serve --port 8600 --worker workers.trainer.worker:Trainer \\
        --kwargs '{"seed": 0, "state_dir": "/var/lib/trainer"}' [--token-env TIDELOG_WORKER_TOKEN]

The worker is constructed before the port is bound, so a readiness check of ``GET /health`` passes
only once it can take calls. Calls run one at a time, in arrival order, on one thread (a rank's
calls are ordered, as on every backend). Routes:

- ``GET /health``: ``{"ok": true, "pid", "worker"}`` (``worker``: the class as ``module:Qualname``).
- ``POST /rpc`` ``{"method", "args", "kwargs"}`` (JSON): ``200 {"value": ...}``, or ``200
  {"error": {"type", "mro", "message", "traceback", "fields"}}`` when the worker raised (``mro``:
  every class of the exception as ``module.Qualname``, so the caller can tell a trainer's refusal
  from a failure without importing the trainer). A body that is not a call is ``400`` naming the
  field; a method the worker lacks (or a private one) is ``404``.

With ``--token-env NAME`` every route but ``/health`` needs ``Authorization: Bearer <$NAME>``; the
token is read from the environment, never from the command line, and never logged. The process
exits on SIGTERM or SIGINT; it never detaches (the stack's owner guard stops it with its owner).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import json
import logging
import os
import signal
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from workers.executor._http import FIELDS
from workers.executor._spec import WorkerSpec

log = logging.getLogger("tidelog.executor.serve")



def error_body(exc: BaseException) -> dict[str, Any]:
    """What a caller needs to re-raise ``exc`` faithfully enough: its classes, words and fields."""
    fields: dict[str, Any] = {}
    for key in FIELDS:
        if hasattr(exc, key):
            try:
                fields[key] = json.loads(json.dumps(getattr(exc, key)))
            except (TypeError, ValueError):
                fields[key] = repr(getattr(exc, key))
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__ if c is not object],
            "message": str(exc), "traceback": "".join(traceback.format_exception(exc))[-8000:], "fields": fields}


def build_app(worker: Any, name: str, token: str | None) -> web.Application:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidelog-served-rank")

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        if token is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pid": os.getpid(), "worker": name})

    async def rpc(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be an object {method, args, kwargs}"}, status=400)
        method, args, kwargs = body.get("method"), body.get("args", []), body.get("kwargs") or {}
        if not isinstance(method, str) or not method:
            return web.json_response({"error": f"method: {method!r} is not a method name"}, status=400)
        if not isinstance(args, list):
            return web.json_response({"error": f"args: must be a list, not {type(args).__name__}"}, status=400)
        if not isinstance(kwargs, dict):
            return web.json_response({"error": f"kwargs: must be an object, not {type(kwargs).__name__}"}, status=400)
        target = None if method.startswith("_") else getattr(worker, method, None)
        if not callable(target):
            return web.json_response({"error": f"method: {name} has no method {method!r}"}, status=404)

        def call() -> Any:
            return target(*args, **kwargs)

        try:
            value = await asyncio.get_running_loop().run_in_executor(pool, call)
        except Exception as exc:  # noqa: BLE001 - the worker's exception goes back to the caller
            return web.json_response({"error": error_body(exc)})
        try:
            return web.json_response({"value": value}, dumps=json.dumps)
        except (TypeError, ValueError) as exc:
            return web.json_response({"error": error_body(TypeError(
                f"{method} returned a value JSON cannot carry ({exc})"))})

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_post("/rpc", rpc)
    app.on_cleanup.append(lambda _: asyncio.to_thread(pool.shutdown, True))
    return app


async def _serve(host: str, port: int, worker: Any, name: str, token: str | None) -> None:
    runner = web.AppRunner(build_app(worker, name, token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("serving %s on %s:%d (pid %d)", name, host, port, os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        shutdown = getattr(worker, "shutdown", None)
        if callable(shutdown):
            shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.executor.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", required=True, help="the worker class, as package.module:Class")
    parser.add_argument("--kwargs", default="{}", help="its constructor's keyword arguments, as a JSON object")
    parser.add_argument("--token-env", default=None, help="the environment variable holding the bearer token")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        kwargs = json.loads(ns.kwargs)
    except ValueError as exc:
        parser.error(f"--kwargs: not JSON ({exc})")
    if not isinstance(kwargs, dict):
        parser.error(f"--kwargs: must be a JSON object, not {type(kwargs).__name__}")
    token = None
    if ns.token_env is not None:
        token = os.environ.get(ns.token_env)
        if not token:
            parser.error(f"--token-env: {ns.token_env} is not set in the environment")
    spec = WorkerSpec(ns.worker, kwargs=kwargs)
    worker = spec.resolve_class()(**kwargs)
    asyncio.run(_serve(ns.host, ns.port, worker, spec.name, token))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
