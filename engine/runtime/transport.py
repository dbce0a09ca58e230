"""The seam under :class:`~engine.runtime.rpc.RpcClient`: one HTTP exchange, nothing else.

A :class:`Transport` sends one :class:`Request` and returns the :class:`Response`, or raises
:class:`TransportFailure` saying how no reply came (the client turns that into its typed errors,
decides about retries and decodes the body). :class:`AiohttpTransport` is the real one: two
connection pools (``control`` and ``data``). :class:`HandlerTransport` answers from an async
function in the same process, for controller tests where a server process adds nothing (httpx's
``MockTransport`` is the model).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import aiohttp
from yarl import URL

Pool = Literal["control", "data"]
#: How no reply came: the connection was not made in time, or not at all (the request cannot have
#: arrived), or the reply did not come in time, or the exchange broke after the request was sent.
Failure = Literal["connect_timeout", "connect", "reply_timeout", "broken"]


@dataclass(frozen=True)
class Request:
    method: str
    url: URL
    headers: Mapping[str, str]
    content: bytes | None
    timeout_s: float  # what is left of the call's deadline for this attempt
    pool: Pool = "control"


@dataclass(frozen=True)
class Response:
    status: int
    content: bytes


class TransportFailure(Exception):
    """No reply: ``failure`` says how (and so whether the request may have arrived), ``reason`` why."""

    def __init__(self, failure: Failure, reason: str) -> None:
        self.failure, self.reason = failure, reason
        super().__init__(f"{failure}: {reason}")

    @property
    def sent(self) -> bool:
        """Whether the request may have reached the server."""
        return self.failure in ("reply_timeout", "broken")


class Transport(Protocol):
    async def send(self, request: Request) -> Response: ...

    async def close(self) -> None: ...


class AiohttpTransport:
    """Real HTTP: one aiohttp session per pool, each with its own connection limits."""

    def __init__(self, *, control_pool: int = 64, control_per_host: int = 8, data_pool: int = 16) -> None:
        self._limits = {"control": (control_pool, control_per_host), "data": (data_pool, 0)}
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def _session(self, pool: Pool) -> aiohttp.ClientSession:
        session = self._sessions.get(pool)
        if session is None:
            limit, per_host = self._limits[pool]
            session = self._sessions[pool] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limit, limit_per_host=per_host), json_serialize=json.dumps)
        return session

    async def send(self, request: Request) -> Response:
        try:
            async with self._session(request.pool).request(
                    request.method, request.url, data=request.content, headers=dict(request.headers),
                    allow_redirects=False, timeout=aiohttp.ClientTimeout(total=request.timeout_s)) as resp:
                return Response(resp.status, await resp.read())
        except aiohttp.ConnectionTimeoutError:
            raise TransportFailure("connect_timeout", "the connection was not made in time") from None
        except aiohttp.ClientConnectorError as exc:
            raise TransportFailure("connect", str(exc.os_error or exc)) from None
        except asyncio.TimeoutError:
            raise TransportFailure("reply_timeout", "no reply in time") from None
        except aiohttp.ClientError as exc:
            raise TransportFailure("broken", f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for s in sessions.values():
            await s.close()


class HandlerTransport:
    """Answers every request with ``handler(request)``, in process (a test's remote); the handler
    may raise :class:`TransportFailure` to stand for a network fault. ``requests`` keeps them all."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.handler = handler
        self.requests: list[Request] = []

    async def send(self, request: Request) -> Response:
        self.requests.append(request)
        return await self.handler(request)

    async def close(self) -> None:
        return None


__all__ = ["AiohttpTransport", "Failure", "HandlerTransport", "Pool", "Request", "Response", "Transport",
           "TransportFailure"]
