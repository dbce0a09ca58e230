"""What every Tidelog HTTP server (the orchestrator's API, participants, the reference servers) allows a client.

- **Headers**: a connection must deliver a complete request head within ``header_timeout_s`` of
  opening (and of the end of the previous response, on a kept-alive connection), else it is
  closed. aiohttp arms its keep-alive timer at ``connection_made`` and only a complete request
  stops it, so :func:`runner_options` sets ``keepalive_timeout`` to that deadline; a client that
  trickles header bytes cannot hold a connection open (``tests`` check it with 50 such clients).
- **Bodies**: :func:`limits_middleware` reads every request body before the handler runs, under
  ``body_timeout_s``; a body still arriving then is answered 408 ``body_timeout`` and the
  connection is closed. A body over the application's ``client_max_size`` is 413
  ``request_too_large``. The body is then cached by aiohttp, so the handler's ``read()`` is free.
- **Errors**: aiohttp's own refusals (404 for an unknown route, 405 for a wrong method, 413) are
  given the JSON shape every Tidelog route answers with, ``{"error": {"code", "detail"}}``.

- **Malformed HTTP** (a bad request line, a header with control characters) never reaches a
  route: aiohttp's parser answers it with a plain-text 400 and closes the connection. It would
  also log the parser's exception with a full traceback, which lets anyone flood the log;
  :func:`quiet_protocol_errors` turns those records into one warning line without a traceback.

The module is shared by both sides of the control plane (it imports aiohttp only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

#: Seconds a client has to deliver a complete request head.
HEADER_TIMEOUT_S = 15.0
#: Seconds a client has to deliver a complete request body once its head has arrived.
BODY_TIMEOUT_S = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The codes aiohttp's own refusals are given.
_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 408: "body_timeout",
          413: "request_too_large", 414: "uri_too_long", 431: "headers_too_large"}


def error_body(code: str, detail: str) -> dict[str, Any]:
    return {"error": {"code": code, "detail": detail}}


class _ProtocolErrorFilter(logging.Filter):
    """Malformed requests logged by aiohttp's server: one line, no traceback (see the module docs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            # Only the first line: the rest quotes the offending header, which may be a token.
            first = str(exc.message).strip().splitlines()[0] if str(exc.message).strip() else ""
            record.msg = f"{record.getMessage()}: malformed request refused ({type(exc).__name__}: {first[:200]})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_protocol_errors() -> None:
    """Install the filter on aiohttp's server logger (once; calling again changes nothing)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ProtocolErrorFilter) for f in logger.filters):
        logger.addFilter(_ProtocolErrorFilter())


def runner_options(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` that bound how long a request head may take."""
    if not 0 < header_timeout_s <= 3600:
        raise ValueError(f"header_timeout_s={header_timeout_s!r}: must be > 0 and at most 3600")
    quiet_protocol_errors()
    return {"keepalive_timeout": header_timeout_s}


def limits_middleware(body_timeout_s: float = BODY_TIMEOUT_S) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that reads the body under ``body_timeout_s`` and answers aiohttp's refusals as JSON."""
    if not 0 < body_timeout_s <= 3600:
        raise ValueError(f"body_timeout_s={body_timeout_s!r}: must be > 0 and at most 3600")

    @web.middleware
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.can_read_body:
                try:
                    async with asyncio.timeout(body_timeout_s):
                        await request.read()
                except TimeoutError:
                    # The rest of the body may still be arriving: do not keep reading it.
                    return web.json_response(
                        error_body("body_timeout", f"the request body did not arrive within {body_timeout_s:g} s"),
                        status=408, headers={"Connection": "close"})
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:
            return web.json_response(error_body(
                "request_too_large", f"the request body is larger than this server accepts "
                                     f"({exc.text or 'over client_max_size'})"), status=413)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = _CODES.get(exc.status, f"http_{exc.status}")
            detail = exc.reason if exc.status != 405 else f"{request.method} is not allowed on {request.path}"
            return web.json_response(error_body(code, detail), status=exc.status)

    return limits


__all__ = ["BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "error_body", "limits_middleware", "quiet_protocol_errors",
           "runner_options"]
