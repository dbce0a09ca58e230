"""The reference inference engine: a small real torch server speaking SGLang's native HTTP subset.

    python -m workers.inference.reference --port 30000 [--host 127.0.0.1] [--model-dir DIR]

It serves the reference :class:`~workers.policy.Policy` (seed 0, weight version ``initial``,
unless ``--model-dir`` names a weights directory written by
:func:`~workers.policy.save_weights`, whose version it then serves) with the same paths,
bodies and status codes as SGLang for the routes Tidelog uses:

- ``GET /health``, ``GET /health_generate``: 200 once a 1-token generation finishes within
  ``--health-check-timeout``; 503 otherwise (paused, memory released).
- ``GET /model_info``, ``GET /get_model_info``: ``{model_path, tokenizer_path, is_generation,
  preferred_sampling_params, weight_version}``; ``GET /get_weight_version``: ``{weight_version}``.
- ``GET /get_server_info``: server arguments, ``internal_states`` (queue, pause and region
  states) and ``version``.
- ``POST /pause_generation {mode: abort|retract|in_place}`` (default ``abort``) and
  ``POST /continue_generation {}``: ``{message, status: "ok"}``.
- ``GET|POST /flush_cache``: 200 text; 400 while requests are running.
- ``POST /update_weights_from_disk {model_path, weight_version?, flush_cache, abort_all_requests,
  load_format?, ...}``: ``{success, message, num_paused_requests}``, 200 or 400.
- ``POST /update_weight_version {new_version, abort_all_requests}``: ``{success, message,
  new_version}``.
- ``GET|POST /release_memory_occupation``, ``/resume_memory_occupation {tags?}``: 200 ``null``,
  or 400 ``{"error": {"message"}}``.
- ``POST /generate {text | input_ids, sampling_params, rid?}``: ``{text, output_ids, meta_info}``
  (one prompt, non-streaming). Greedy unless ``sampling_params.temperature`` > 0 (absent means
  greedy here, not SGLang's 1.0); then sampled, reproducibly with ``sampling_params.sampling_seed``.
- ``GET|POST /slow_down {forward_sleep_time}``: seconds added to each decoding step (testing).

With ``--api-key-env NAME`` the server takes its API key from the environment variable ``NAME``
(never from its command line) and, as SGLang's ``--api-key`` does, answers 401 ``{"error":
"Unauthorized"}`` to any request without ``Authorization: Bearer <key>``, except the health and
metrics paths. ``--legacy-model-info`` serves only ``/get_model_info``, as SGLang builds before
``/model_info`` do (for the adapter's fallback).

A body that fails validation gets SGLang's 400 ``{"object": "error", "message", "type",
"param", "code"}``. Semantics of pause, regions and weights: :mod:`workers.inference.serving`.

Test-only fault injection: with ``--enable-test-faults``, ``POST /_test/fail_next {path,
mode, seconds?}`` makes the next request to ``path`` fail: ``error`` answers 500, ``refuse``
answers 200 ``{"success": false}``, ``hang`` sleeps ``seconds`` (default 30) and then answers
500 — all without acting. ``POST /_test/die_next {path}`` makes the process SIGKILL itself when
the next request to ``path`` arrives, *before* the route acts (nothing is applied, no answer is
sent: the caller sees the connection drop), so a crash harness can kill an engine at one phase of
a publication. ``GET /_test/history`` answers ``{"history": [[event, weight_version, at], ...]}``:
every ``pause``, ``continue``, ``load`` (``/update_weights_from_disk``), ``label``
(``/update_weight_version``), ``release REGIONS`` and ``resume REGIONS`` (the memory calls, with
the regions asked for, comma-separated) this process answered with a status below 400 since it started,
with the weight version it served right after and the Unix time it acted — so a test can check
that generation was only ever continued on a version already committed. A real engine cannot be made to fail (or die) on demand on
a CPU; without the flag none of these routes exists.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..http_limits import Handler
from ..policy import Policy, WeightsError, load_weights
from ..reference._common import serve
from .engine import REGIONS
from .serving import ReferenceEngineState, ServingError

VERSION = "tidelog-reference-0.1"
INITIAL_VERSION = "initial"
STATE: web.AppKey[ReferenceEngineState] = web.AppKey("state", ReferenceEngineState)
FAULTS: web.AppKey[dict[str, tuple[str, float]]] = web.AppKey("faults", dict)
#: Test faults only: the routes whose next request kills the process, and the event history.
DIE_NEXT: web.AppKey[set[str]] = web.AppKey("die_next", set)
HISTORY: web.AppKey[list[tuple[str, str, float]]] = web.AppKey("history", list)
#: The routes /_test/history records, by the event name it gives them.
HISTORY_EVENTS = {"/pause_generation": "pause", "/continue_generation": "continue",
                  "/update_weights_from_disk": "load", "/update_weight_version": "label",
                  "/release_memory_occupation": "release", "/resume_memory_occupation": "resume"}
MEMORY_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")

log = logging.getLogger("tidelog.inference.reference")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    torch_empty_cache: bool = False


class FlushBody(_Body):
    timeout_s: float | None = None


class MemoryBody(_Body):
    tags: list[str] | None = None


class UpdateFromDiskBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1)
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class WeightVersionBody(_Body):
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True  # SGLang's default; callers send false explicitly


class SamplingParams(BaseModel):
    # Every SGLang sampling parameter is accepted; only these three act (top_k, top_p, ... are ignored).
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int = Field(default=128, ge=0, le=4096)
    #: Absent or 0: greedy (unlike SGLang, whose default is 1.0, so that existing callers keep greedy
    #: decoding); > 0: each token is drawn from ``softmax(logits / temperature)``.
    temperature: float | None = Field(default=None, ge=0, le=100)
    #: SGLang's per-request seed: with a temperature > 0, the same seed, prompt and weights always
    #: draw the same tokens. Absent: a fresh random seed.
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**63)


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang accepts many more fields (logprobs, ...)
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False


class SlowDownBody(_Body):
    forward_sleep_time: float | None = Field(default=None, ge=0)


class DieNextBody(_Body):
    path: str = Field(pattern=r"^/[a-z_]+$")


class FailNextBody(_Body):
    path: str = Field(pattern=r"^/[a-z_]+$")
    mode: Literal["error", "refuse", "hang"]
    seconds: float = Field(default=30.0, gt=0)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _validation_error(exc: ValidationError) -> web.Response:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return _json({"object": "error", "message": f"{where}: {first['msg']}", "type": "Bad Request",
                  "param": None, "code": 400}, 400)


async def _parse(request: web.Request, model: type[Any]) -> Any:
    """The body as ``model``; an empty body means every default (SGLang's older no-body calls)."""
    raw = await request.read()
    return model.model_validate_json(raw) if raw.strip() else model()


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ValidationError as exc:
        return _validation_error(exc)
    except ServingError as exc:
        if exc.success_body:
            return _json({"success": False, "message": exc.message, "num_paused_requests": 0}, exc.status)
        return _json({"error": {"message": exc.message}}, exc.status)


def _api_key(key: str) -> Any:
    """SGLang's API-key check: every path but the health and metrics ones needs the Bearer key."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics")):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)
    return check


@web.middleware
async def _faults(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in request.app[DIE_NEXT]:
        # Before the route acts: the request is not applied and never answered.
        log.warning("dying (SIGKILL) on %s, as armed by /_test/die_next", request.path)
        os.kill(os.getpid(), signal.SIGKILL)
    armed = request.app[FAULTS].pop(request.path, None)
    if armed is None:
        response = await handler(request)
        event = HISTORY_EVENTS.get(request.path)
        if event is not None and response.status < 400:
            if request.path in MEMORY_PATHS:
                # "release weights,kv_cache": the regions asked for (the body was read and cached).
                try:
                    body = await request.json()
                except ValueError:  # no body (a GET, or an empty POST): every region
                    body = None
                tags = body.get("tags") if isinstance(body, dict) else None
                event = f"{event} {','.join(tags if isinstance(tags, list) else REGIONS)}"
            request.app[HISTORY].append((event, request.app[STATE].weight_version, time.time()))
        return response
    mode, seconds = armed
    log.warning("injecting a %s fault into %s", mode, request.path)
    if mode == "refuse":
        return _json({"success": False, "message": "injected fault (refuse)"})
    if mode == "hang":
        await asyncio.sleep(seconds)
    return _json({"error": {"message": f"injected fault ({mode})"}}, 500)


def build_app(state: ReferenceEngineState, *, health_timeout: float = 20.0,
              test_faults: bool = False, host: str = "127.0.0.1", api_key: str | None = None,
              legacy_model_info: bool = False) -> web.Application:
    """The HTTP application over ``state`` (see the module docstring for the routes)."""
    middlewares = [_faults, _errors] if test_faults else [_errors]
    if api_key:
        middlewares.insert(0, _api_key(api_key))
    app = web.Application(middlewares=middlewares)
    faults: dict[str, tuple[str, float]] = {}
    app[STATE] = state
    app[FAULTS] = faults
    app[DIE_NEXT] = set()
    app[HISTORY] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if await state.health_generate(health_timeout) else 503)

    def info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version}

    async def model_info(request: web.Request) -> web.Response:
        return _json(info())

    async def weight_version(request: web.Request) -> web.Response:
        return _json({"weight_version": state.weight_version})

    async def server_info(request: web.Request) -> web.Response:
        body = {**info(), "host": host, "device": state.device, "health_check_timeout": health_timeout,
                "internal_states": [state.stats()], "version": VERSION}
        if test_faults:
            body["armed_faults"] = sorted(faults)
        return _json(body)

    async def pause(request: web.Request) -> web.Response:
        body = await _parse(request, PauseBody)
        await state.pause(body.mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def resume_generation(request: web.Request) -> web.Response:
        await _parse(request, ContinueBody)
        await state.resume_generation()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(request: web.Request) -> web.Response:
        await _parse(request, FlushBody)
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
        try:
            state.flush_cache()
        except ServingError:
            return web.Response(text=text, status=400)
        return web.Response(text=text, status=200)

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await _parse(request, UpdateFromDiskBody)
        result = await state.update_weights(body.model_path, body.weight_version, body.flush_cache,
                                            body.abort_all_requests)
        return _json(result)

    async def update_version(request: web.Request) -> web.Response:
        body = await _parse(request, WeightVersionBody)
        if body.abort_all_requests:
            await state.abort_all()
        state.weight_version = body.new_version
        return _json({"success": True, "message": f"Weight version updated to {body.new_version}",
                      "new_version": body.new_version})

    async def release(request: web.Request) -> web.Response:
        await state.release((await _parse(request, MemoryBody)).tags)
        return _json(None)

    async def resume(request: web.Request) -> web.Response:
        await state.resume((await _parse(request, MemoryBody)).tags)
        return _json(None)

    async def generate(request: web.Request) -> web.Response:
        body = await _parse(request, GenerateBody)
        if body.stream:
            raise ServingError(400, "stream: the reference engine answers non-streaming requests only")
        if (body.text is None) == (body.input_ids is None):
            raise ServingError(400, "exactly one of text and input_ids must be given")
        sp = body.sampling_params
        out = await state.generate(body.text, body.input_ids, sp.max_new_tokens, rid=body.rid,
                                   temperature=sp.temperature or 0.0, seed=sp.sampling_seed)
        return _json(out)

    async def slow_down(request: web.Request) -> web.Response:
        state.forward_sleep = (await _parse(request, SlowDownBody)).forward_sleep_time
        return _json(None)

    async def fail_next(request: web.Request) -> web.Response:
        body = await _parse(request, FailNextBody)
        faults[body.path] = (body.mode, body.seconds)
        return _json({"armed": body.path, "mode": body.mode})

    async def die_next(request: web.Request) -> web.Response:
        body = await _parse(request, DieNextBody)
        request.app[DIE_NEXT].add(body.path)
        return _json({"armed": body.path, "mode": "die"})

    async def history(request: web.Request) -> web.Response:
        return _json({"history": [list(entry) for entry in request.app[HISTORY]]})

    r = app.router
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    for path in (("/get_model_info",) if legacy_model_info else ("/model_info", "/get_model_info")):
        r.add_get(path, model_info)
    r.add_get("/get_weight_version", weight_version)
    r.add_get("/get_server_info", server_info)
    r.add_post("/pause_generation", pause)
    r.add_post("/continue_generation", resume_generation)
    r.add_post("/update_weights_from_disk", update_from_disk)
    r.add_post("/update_weight_version", update_version)
    r.add_post("/generate", generate)
    for path, handler in (("/flush_cache", flush), ("/release_memory_occupation", release),
                          ("/resume_memory_occupation", resume), ("/slow_down", slow_down)):
        r.add_get(path, handler)
        r.add_post(path, handler)
    if test_faults:
        r.add_post("/_test/fail_next", fail_next)
        r.add_post("/_test/die_next", die_next)
        r.add_get("/_test/history", history)
    return app


def load_state(model_dir: Path | None, seed: int, device: str = "cpu") -> ReferenceEngineState:
    """The policy to serve on ``device``: ``model_dir``'s weights and version, or ``Policy(seed)`` as
    ``initial``."""
    if model_dir is None:
        return ReferenceEngineState(Policy(seed=seed).to(device), INITIAL_VERSION, f"reference-policy-seed-{seed}")
    try:
        weights, meta = load_weights(model_dir)
    except WeightsError as exc:
        raise SystemExit(f"--model-dir {model_dir}: {exc}") from None
    model = Policy(int(meta["vocab"]), int(meta["dim"]))
    model.load_state_dict(weights)
    return ReferenceEngineState(model.to(device), str(meta["version"]), str(model_dir))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.inference.reference",
                                description="Reference inference engine (SGLang's native HTTP subset).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="weights directory to serve (default: the seed policy as version 'initial')")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial policy (default 0)")
    p.add_argument("--device", default="cpu", help="torch device to generate on: cpu (default), cuda, cuda:N")
    p.add_argument("--health-check-timeout", type=float, default=20.0,
                   help="seconds /health_generate waits for its 1-token request (default 20)")
    p.add_argument("--api-key-env", metavar="NAME",
                   help="require Authorization: Bearer <the value of environment variable NAME> (SGLang's "
                        "--api-key; the key itself is never an argument)")
    p.add_argument("--legacy-model-info", action="store_true",
                   help="serve /get_model_info only, as SGLang builds without /model_info do")
    p.add_argument("--enable-test-faults", action="store_true",
                   help="TEST ONLY: add POST /_test/fail_next and /_test/die_next to inject one "
                        "failure (or a SIGKILL) into a route, and GET /_test/history")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port: {args.port} must lie in [0, 65535]")
    if not args.health_check_timeout > 0:
        raise SystemExit(f"--health-check-timeout: {args.health_check_timeout} must be > 0")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env: the environment variable {args.api_key_env} is not set or empty")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"--device: {args.device!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device: {args.device!r} asks for CUDA, which this process does not have")
    torch.set_num_threads(1)  # a tiny model; more threads only contend with the rest of the host
    state = load_state(args.model_dir, args.seed, str(device))
    serve(build_app(state, health_timeout=args.health_check_timeout, test_faults=args.enable_test_faults,
                    host=args.host, api_key=api_key, legacy_model_info=args.legacy_model_info), args)

__all__ = ["INITIAL_VERSION", "VERSION", "build_app", "load_state", "main", "parser"]

if __name__ == "__main__":
    main()
