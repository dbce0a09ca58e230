"""The orchestrator's HTTP RPC client.

- Two connection pools: ``control`` (checkpoint control plane, probes) and
  ``data`` (bulk transfers), so a burst of data calls never starves control
  calls of connections.
- Every call carries ``Authorization: Bearer``, the fencing epoch
  (``X-Tidelog-Epoch``) with the journal's lineage (``X-Tidelog-Lineage``) and, for outbox calls, the intent id as
  ``Idempotency-Key``.
- Every call has a deadline; retries (exponential backoff) happen only on transport
  errors and only inside that deadline. A call that is not safe to repeat is
  retried only when the connection was never made, so the request cannot
  have reached the server.
- A non-2xx reply becomes :class:`RemoteError` carrying status, code and
  detail from the ``{"error": {"code", "detail"}}`` body; it is never retried
  here — it goes back to the controller, which decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential
from tenacity.stop import stop_base
from yarl import URL

from workers import protocol

from engine.runtime.clock import Clock, SystemClock
from engine.runtime.transport import AiohttpTransport, Pool, Request, Transport, TransportFailure


TOKEN_HEADER = "Authorization"
EPOCH_HEADER = protocol.EPOCH_HEADER
LINEAGE_HEADER = protocol.LINEAGE_HEADER
IDEMPOTENCY_HEADER = "Idempotency-Key"


class RpcError(Exception):
    """Base of every error a call returns to its caller."""

    def __init__(self, target: str, method: str, path: str, detail: str) -> None:
        self.target = redact(target)
        self.method = method
        self.path = path
        self.detail = detail
        super().__init__(f"{method} {self.target.rstrip('/')}{path}: {detail}")

    def as_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "detail": self.detail}


class TransportError(RpcError):
    """No usable reply: refused, reset, timed out, or not JSON. ``sent`` says if it may have arrived."""

    def __init__(self, target: str, method: str, path: str, detail: str, *, sent: bool) -> None:
        super().__init__(target, method, path, detail)
        self.sent = sent

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "sent": self.sent}


class CallTimeout(TransportError):
    """The call's deadline passed before a reply arrived."""


class RemoteError(RpcError):
    """The remote answered with a non-2xx status (typed when its body carries an error code)."""

    def __init__(self, target: str, method: str, path: str, status: int, code: str | None,
                 detail: str) -> None:
        self.status = status
        self.code = code
        super().__init__(target, method, path, f"HTTP {status} {code or '-'} {detail}".rstrip())
        self.detail = detail

    @property
    def retryable(self) -> bool:
        """5xx is the server's trouble and worth another try; 4xx is a decision for the controller."""
        return self.status >= 500

    def as_dict(self) -> dict[str, Any]:
        return {"type": "RemoteError", "status": self.status, "code": self.code, "detail": self.detail}


def redact(url: str) -> str:
    """``url`` without user or password (errors land in logs and in the journal)."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return "<unparseable url>"
    return str(parsed.with_user(None)) if parsed.user or parsed.password else url


def encode_body(body: Any) -> bytes:
    """JSON bytes for a request body (orjson; stdlib json for integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


class _StopAtDeadline(stop_base):
    """Stop retrying once ``deadline`` has passed on ``clock`` (tenacity's ``stop_after_delay``,
    measured on the injectable clock rather than on ``time.monotonic``)."""

    def __init__(self, clock: Clock, deadline: float) -> None:
        self.clock, self.deadline = clock, deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.clock.monotonic() >= self.deadline


class RpcClient:
    """Pooled, authenticated, fenced HTTP calls with deadlines, over a :class:`Transport`
    (default: real HTTP with a ``control`` and a ``data`` pool; a test may pass its own).

    A call's deadline and the backoff between its tries are measured on ``clock`` (the
    orchestrator's injectable clock; the system clock by default)."""

    def __init__(self, *, token: str | None, epoch: Callable[[], int | None] = lambda: None,
                 lineage: Callable[[], str | None] = lambda: None,
                 control_pool: int = 64, control_per_host: int = 8, data_pool: int = 16,
                 transport_tries: int = 3, retry_backoff_s: float = 0.2,
                 transport: Transport | None = None, clock: Clock | None = None) -> None:
        if transport_tries < 1:
            raise ValueError("transport_tries must be >= 1")
        self._token = token
        self._epoch = epoch
        self._lineage = lineage
        self._tries = transport_tries
        self._backoff = retry_backoff_s
        self._clock: Clock = clock or SystemClock()
        self.transport: Transport = transport or AiohttpTransport(
            control_pool=control_pool, control_per_host=control_per_host, data_pool=data_pool)
        self._urls: dict[tuple[str, str], URL] = {}

    async def close(self) -> None:
        await self.transport.close()

    def _url(self, target: str, path: str) -> URL:
        """``target + path`` parsed once: a fan-out calls the same few URLs again and again."""
        key = (target, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            url = self._urls[key] = URL(target.rstrip("/") + path)
        return url

    def headers(self, idempotency_key: str | None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self._token:
            h[TOKEN_HEADER] = f"Bearer {self._token}"
        epoch = self._epoch()
        if epoch is not None:
            h[EPOCH_HEADER] = str(epoch)
            lineage = self._lineage()
            if lineage is not None:
                h[LINEAGE_HEADER] = lineage
        if idempotency_key:
            h[IDEMPOTENCY_HEADER] = idempotency_key
        return h

    async def call(self, target: str, method: str, path: str, body: Any = None, *, timeout_s: float,
                   idempotency_key: str | None = None, pool: Pool = "control", repeatable: bool = True,
                   tries: int | None = None, content: bytes | None = None) -> Any:
        """Call ``method target+path`` and return the parsed JSON reply (``None`` for an empty one).

        The request body is ``body`` encoded as JSON, or ``content``: JSON bytes sent as
        they are (a shared body, encoded once for every call of a fan-out).

        Raises :class:`TransportError`/:class:`CallTimeout` when no reply came
        within ``timeout_s`` over at most ``tries`` attempts, and
        :class:`RemoteError` for a non-2xx reply.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if content is not None and body is not None:
            raise ValueError("pass a body or its encoded content, not both")
        data = content if content is not None else None if body is None else encode_body(body)
        headers = self.headers(idempotency_key)
        if data is not None:
            headers["Content-Type"] = "application/json"
        url = self._url(target, path)
        clock = self._clock
        deadline = clock.monotonic() + timeout_s

        def worth_retrying(exc: BaseException) -> bool:
            if not isinstance(exc, TransportError) or isinstance(exc, CallTimeout):
                return False
            return repeatable or not exc.sent

        sent_any = False
        last: list[RpcError] = []

        async def attempt() -> Any:
            nonlocal sent_any
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                # Report what the earlier attempts met, and whether any of them may have arrived.
                if last:
                    raise last[-1]
                raise CallTimeout(target, method, path, f"deadline of {timeout_s:g}s passed", sent=sent_any)
            try:
                reply = await self.transport.send(Request(method, url, headers, data, remaining, pool))
            except TransportFailure as exc:
                if exc.failure == "connect_timeout":
                    last.append(CallTimeout(target, method, path, f"cannot connect within {timeout_s:g}s",
                                            sent=sent_any))
                elif exc.failure == "connect":
                    last.append(TransportError(target, method, path, f"cannot connect: {exc.reason}", sent=sent_any))
                else:
                    sent_any = True
                    if exc.failure == "reply_timeout":
                        raise CallTimeout(target, method, path, f"no reply within {timeout_s:g}s",
                                          sent=True) from None
                    raise TransportError(target, method, path, exc.reason, sent=True) from None
                raise last[-1] from None
            return self._decode(target, method, path, reply.status, reply.content)

        # Retries with exponential backoff (``retry_backoff_s * 2**(n-1)``, capped at
        # ``max(retry_backoff_s, 2s)``), on transport errors only (see worth_retrying), for at most
        # ``tries`` attempts and not once ``timeout_s`` has passed since the first; the last error
        # is raised as it is. The waits are slept on the client's clock.
        retrying = AsyncRetrying(
            stop=stop_after_attempt(tries or self._tries) | _StopAtDeadline(clock, deadline),
            wait=wait_exponential(multiplier=self._backoff, exp_base=2, min=0, max=max(self._backoff, 2.0)),
            retry=retry_if_exception(worth_retrying), sleep=clock.sleep, reraise=True)
        return await retrying(attempt)

    @staticmethod
    def _decode(target: str, method: str, path: str, status: int, raw: bytes) -> Any:
        parsed: Any = None
        if raw:
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    if 200 <= status < 300:
                        raise TransportError(target, method, path, f"HTTP {status} reply is not JSON",
                                             sent=True) from None
                    parsed = None
        if 200 <= status < 300:
            return parsed
        code: str | None = None
        detail = raw[:200].decode("utf-8", "replace") if raw else ""
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            err = parsed["error"]
            code = err.get("code") if isinstance(err.get("code"), str) else None
            detail = str(err.get("detail", ""))
        raise RemoteError(target, method, path, status, code, detail)
