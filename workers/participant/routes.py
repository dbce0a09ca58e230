"""The checkpoint routes on an aiohttp application, and the settings that enable them.

:func:`mount` adds ``GET {prefix}/status`` and ``POST {prefix}/<op>`` for the
seven operations to an application, and a fence over every mutating route of the application
(control and data): a request whose ``X-Tidelog-Epoch`` is older than the highest epoch the
participant has seen from its ``X-Tidelog-Lineage`` (one journal's line of leaders) is refused 409
``stale_epoch`` before its handler runs, and an authenticated request with a newer one raises it,
durably (:meth:`~.marks.RetiredMarks.observe_epoch`). Every route checks the bearer token in
constant time (401 ``unauthorized``, also for a header that is not UTF-8),
parses its body once into the operation's request model (a body that is not
JSON, nests deeper than the parser allows, or does not fit, is 422
``invalid_request`` naming the field — never a 500), and answers a
:class:`~workers.protocol.ProtocolError` with its typed body and status. Any
other exception from a hook is an ordinary server error (500), logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import reprlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..http_limits import BODY_TIMEOUT_S
from ..protocol import CONTROL_PREFIX, EPOCH_HEADER, LINEAGE_HEADER, REQUEST_MODELS, ErrorCode, ProtocolError
from .control import ControlPlane

log = logging.getLogger("tidelog.participant")

#: A lineage as the orchestrator sends it (32 hex digits today); ``""`` when a caller names none.
_LINEAGE = re.compile(r"(?:[A-Za-z0-9._-]{1,64})?")
CONTROL_KEY: web.AppKey[ControlPlane] = web.AppKey("tidelog_checkpoint_control", ControlPlane)
#: A commit or restore scope names every continued episode (~50 bytes each): aiohttp's default
#: 1 MiB body limit stops near 20,000 episodes, so participant applications should allow this much.
CONTROL_MAX_SIZE = 64 * 1024 * 1024


class CheckpointSettings(BaseModel):
    """The ``checkpoint:`` block of a participant server. Off by default; a token is required when on."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = False
    control_auth_token: str | None = Field(default=None, repr=False)
    lease_grace_seconds: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    #: The directory every commit and restore must lie under (``ControlPlane(checkpoint_root=...)``):
    #: absolute; ``None`` refuses every commit and restore (``checkpoint_dir_refused``).
    checkpoint_root: str | None = Field(default=None, min_length=1, max_length=4096)

    @field_validator("checkpoint_root")
    @classmethod
    def _absolute_root(cls, v: str | None) -> str | None:
        if v is not None and ("\x00" in v or not os.path.isabs(v)):
            raise ValueError(f"checkpoint.checkpoint_root {v!r} must be an absolute path")
        return v

    def token(self) -> str:
        if not self.control_auth_token:
            raise ValueError("checkpoint.control_auth_token is required when checkpointing is enabled")
        return self.control_auth_token


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(code: ErrorCode, detail: str) -> web.Response:
    err = ProtocolError(code, detail)
    return _json(err.body(), err.status)


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 3
_short.maxlevel = 2


def _validation_detail(exc: ValidationError) -> str:
    """Up to five problems, each as ``field: rule (got value)``; values are shortened, never whole."""
    parts = []
    for item in exc.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']} (got {_short.repr(item.get('input'))})")
    return "; ".join(parts)


def _authorized(header: str | None, expected: bytes) -> bool:
    """Compare the ``Authorization`` header with ``Bearer <token>`` in constant time.

    aiohttp decodes header bytes that are not UTF-8 as surrogate escapes, which plain ``.encode()``
    refuses (it raised, and the request was an unauthenticated 500): the bytes are recovered with
    ``surrogateescape``, and a header that cannot be turned back into bytes is simply wrong.
    """
    try:
        got = (header or "").encode("utf-8", "surrogateescape")
    except UnicodeError:
        return False
    return hmac.compare_digest(got, expected)


def mount(app: web.Application, control: ControlPlane, *, token: str, prefix: str = CONTROL_PREFIX,
          body_timeout_s: float = BODY_TIMEOUT_S) -> None:
    """Install the checkpoint routes for ``control`` on ``app``, guarded by ``token``.

    Build ``app`` with ``client_max_size=CONTROL_MAX_SIZE`` (or more) so large scopes fit; a body
    over the limit is answered 413 ``request_too_large``, never an untyped error. A body that has
    not arrived whole ``body_timeout_s`` after the request head is 408 ``body_timeout``. Serve the
    app with ``web.AppRunner(app, **workers.http_limits.runner_options())`` so that a client
    trickling its request head is cut off too.
    """
    if not token:
        raise ValueError("the checkpoint control token must not be empty")
    expected = f"Bearer {token}".encode()
    app[CONTROL_KEY] = control

    def authorized(request: web.Request) -> bool:
        return _authorized(request.headers.get("Authorization"), expected)

    async def status(request: web.Request) -> web.Response:
        if not authorized(request):
            return _error(ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")
        return _json(control.status().model_dump())

    def route(op: str, call: Callable[[Any], Awaitable[BaseModel]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        model = REQUEST_MODELS[op]

        async def handler(request: web.Request) -> web.Response:
            if not authorized(request):
                return _error(ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")
            try:
                async with asyncio.timeout(body_timeout_s):
                    raw = await request.read()
            except TimeoutError:
                # A client trickling its body must not hold the route (and a connection) for good.
                return web.json_response(ProtocolError(ErrorCode.BODY_TIMEOUT, (
                    f"the {op} body did not arrive within {body_timeout_s:g} s")).body(), status=408,
                    headers={"Connection": "close"})
            except web.HTTPRequestEntityTooLarge:
                return _error(ErrorCode.REQUEST_TOO_LARGE,
                              f"the {op} body is larger than this server accepts; build its application "
                              f"with client_max_size of at least {CONTROL_MAX_SIZE} bytes")
            try:
                body = orjson.loads(raw)
            except Exception:  # JSONDecodeError, and anything else a parser may raise: the body is bad
                return _error(ErrorCode.INVALID_REQUEST, f"the {op} body is not JSON (or nests too deep)")
            try:
                req = model.model_validate(body)
            except ValidationError as exc:
                return _error(ErrorCode.INVALID_REQUEST, f"invalid {op} request: {_validation_detail(exc)}")
            except Exception as exc:  # e.g. RecursionError: still the body's fault, never a 500
                return _error(ErrorCode.INVALID_REQUEST,
                              f"invalid {op} request: it cannot be validated ({type(exc).__name__})")
            try:
                reply = await call(req)
            except ProtocolError as exc:
                return _json(exc.body(), exc.status)
            except Exception as exc:
                # A hook failed: an ordinary server error. The reply names the exception type only
                # (its message may carry server data); the log has the traceback.
                log.exception("checkpoint %s of %s failed", op, req.checkpoint_id)
                return _json({"error": {"code": "internal_error",
                                        "detail": f"{op} failed on the participant ({type(exc).__name__}); "
                                                  "see its log"}}, 500)
            return _json(reply.model_dump())
        return handler

    @web.middleware
    async def fence(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        """A mutating request (control or data route) that carries the orchestrator's epoch is
        refused when that epoch is older than the highest seen in its lineage; an authenticated
        one with a newer epoch raises it (durably) before its handler runs."""
        raw = request.headers.get(EPOCH_HEADER)
        if raw is None or request.method in ("GET", "HEAD", "OPTIONS"):
            return await handler(request)
        lineage = request.headers.get(LINEAGE_HEADER, "")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            return _error(ErrorCode.INVALID_REQUEST,
                          f"{EPOCH_HEADER} must be a non-negative integer below 10**18, got {_short.repr(raw)}")
        if not _LINEAGE.fullmatch(lineage):
            return _error(ErrorCode.INVALID_REQUEST, f"{LINEAGE_HEADER} must be 1 to 64 of [A-Za-z0-9._-], "
                                                     f"got {_short.repr(lineage)}")
        known = authorized(request)
        if not known and request.path.startswith(prefix):
            return await handler(request)  # a control route answers 401 before anything else
        try:
            control.marks.observe_epoch(lineage, int(raw), record=known)
        except ProtocolError as exc:
            return _json(exc.body(), exc.status)
        return await handler(request)

    app.middlewares.append(fence)
    app.router.add_get(f"{prefix}/status", status)
    calls: dict[str, Callable[[Any], Awaitable[BaseModel]]] = {
        "prepare": control.prepare, "renew": control.renew, "retire": control.retire, "forget": control.forget,
        "commit": control.commit, "restore": control.restore, "resume": control.resume}
    for op, call in calls.items():
        app.router.add_post(f"{prefix}/{op}", route(op, call))

    async def close(_app: web.Application) -> None:
        await control.aclose()
    app.on_cleanup.append(close)
