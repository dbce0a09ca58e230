"""The HTTP shell every route shares: the error shape, the typed refusal, bodies, the token check.

Every refusal is ``{"error": {"code", "detail"[, "field"]}}``: a route raises :class:`ApiError`
(or :class:`~engine.http.query.QueryError`, answered 400 ``invalid_query``), and :func:`typed`
turns it into the response. Bodies are read by :func:`read_body` into a pydantic model that
forbids unknown fields; what no route stores (deep nesting, NUL, non-finite numbers) is refused
before the model sees it.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime, timezone
from typing import Annotated, Any, TypeVar

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, ValidationError

from journal import LeaseLost

from engine.http.query import QueryError
from engine.runtime.committer import NotLeader

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
B = TypeVar("B", bound=BaseModel)


def error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


class ApiError(Exception):
    """A typed refusal: ``{"error": {"code", "detail"[, "field"], **extra}}`` with ``status``
    (``extra``: the ids or states the refusal names, e.g. the job in the way)."""

    def __init__(self, status: int, code: str, detail: str, field: str | None = None, **extra: Any) -> None:
        self.status, self.code, self.detail, self.field = status, code, detail, field
        self.extra = extra
        super().__init__(detail)

    def response(self) -> web.Response:
        body: dict[str, Any] = {"code": self.code, "detail": self.detail}
        if self.field is not None:
            body["field"] = self.field
        body.update(self.extra)
        return web.json_response({"error": body}, status=self.status)


#: A family's exception-to-refusal table: for an exception of a key's type (or a subclass), the
#: :class:`ApiError` to answer with. Domain rules raise their own exceptions (no HTTP in them);
#: the family's routes hand :func:`typed` this table.
Refusals = Mapping[type[Exception], Callable[[Any], ApiError]]


def _no_nul(v: str) -> str:
    if "\x00" in v:
        raise ValueError("must not contain a NUL character")
    return v


Directory = Annotated[str, StringConstraints(min_length=1, max_length=4096), AfterValidator(_no_nul)]


class Body(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(exc: ValidationError) -> ApiError:
    """The pydantic errors as one 422: each names the field, the value it got and the rule."""
    parts, first = [], None
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        first = first or where
        got = "" if err["type"] == "missing" else f"={shown(err.get('input'))}"
        parts.append(f"{where}{got}: {err['msg']}")
    return ApiError(422, "invalid_body", "; ".join(parts), first)


#: Deepest nesting of arrays and objects a request body may have.
MAX_DEPTH = 32




def check_json(data: Any) -> None:
    """Refuse (422, naming where) what no route stores: nesting deeper than :data:`MAX_DEPTH`,
    NUL characters in keys or strings (PostgreSQL's text cannot hold them), and ``NaN``,
    ``Infinity`` or a number past a double's range (JSON has none of them)."""
    stack: list[tuple[Any, str, int]] = [(data, "body", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise ApiError(422, "invalid_body", f"{where}: must not contain a NUL character", where)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ApiError(422, "invalid_body", f"{where}={value}: must be a finite number (JSON has no NaN "
                                                "or infinities)", where)
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise ApiError(422, "invalid_body", f"{where}: nested deeper than {MAX_DEPTH} levels", where)
        if isinstance(value, dict):
            for k, v in value.items():
                if "\x00" in k:
                    raise ApiError(422, "invalid_body", f"{where}: a key must not contain a NUL character", where)
                stack.append((v, f"{where}.{k}" if where != "body" else k, depth + 1))
        else:
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


async def read_body(request: web.Request, model: type[B]) -> B:
    """The request body validated into ``model`` (an empty body is ``{}``).

    Refused with a typed error, never a 500: a query string (400), a body that is not a JSON
    object, is not UTF-8, holds ``NaN``/``Infinity``, nests deeper than :data:`MAX_DEPTH` or
    carries a NUL (422, see :func:`check_json`), and whatever ``model`` rejects (422 naming the
    field, the value and the rule).
    """
    for name in request.query:
        raise ApiError(400, "invalid_query", f"query parameter {shown(name)}={shown(request.query[name])}: "
                                             "unknown parameter (this route takes a JSON body)")
    raw = await request.read()
    data: Any = {}
    if raw.strip():
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ApiError(422, "invalid_body", f"body: nested deeper than {MAX_DEPTH} levels", "body") from None
        except ValueError as exc:  # also UnicodeDecodeError
            raise ApiError(422, "invalid_body", f"body: not JSON ({str(exc)[:200]})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_body", f"body: must be a JSON object, got {type(data).__name__}", "body")
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def new_id(prefix: str, now: datetime) -> str:
    """``<prefix>-<now in UTC>-<4 hex>``: sorts by time, and two in one second still differ.

    ``now`` is the caller's clock (``orch.clock.now()``), timezone-aware."""
    return f"{prefix}-{now.astimezone(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


def iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def row_json(mapping: Mapping[Any, Any]) -> dict[str, Any]:
    return {k: iso(v) for k, v in mapping.items()}


def phases(history: Sequence[Mapping[str, Any]], terminal: Collection[str], now: datetime,
           stage: Callable[[str, int | None], str | None] | None = None) -> list[dict[str, Any]]:
    """Each state a row passed through, from its events (oldest first): when it began and for how
    long (``None`` for a terminal one; up to ``now`` for the current one). A self-edge stays in the
    same phase, unless ``stage`` (``(state, stage index) -> stage name``, the index read from the
    events' ``set``) names another stage: then each entry also carries its ``stage``."""
    out: list[dict[str, Any]] = []
    began: datetime | None = None
    index: int | None = None
    for ev in history:
        name: str | None = None
        if stage is not None:
            index = (ev["payload"] or {}).get("set", {}).get("stage", index)
            name = stage(ev["to_state"], index)
        if out and out[-1]["state"] == ev["to_state"] and out[-1].get("stage") == name:
            continue  # a self-edge that changed something else (a retry, a scope)
        if out and began is not None:
            out[-1]["seconds"] = round((ev["ts"] - began).total_seconds(), 3)
        began = ev["ts"]
        entry: dict[str, Any] = {"state": ev["to_state"]}
        if stage is not None:
            entry["stage"] = name
        entry.update({"at": ev["ts"].isoformat(), "seconds": None})
        out.append(entry)
    if out and began is not None and out[-1]["state"] not in terminal:
        out[-1]["seconds"] = round((now - began).total_seconds(), 3)
    return out


def bearer_matches(header: str, token: str | None) -> bool:
    """Whether ``Authorization: <header>`` carries ``token``, in constant time. A header aiohttp
    could not decode as UTF-8 (it keeps such bytes as surrogates) is simply not the token."""
    if not token or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].encode("utf-8", "surrogateescape"), token.encode())


@web.middleware
async def refuse_nul(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A NUL in the path or the query is refused before any route reads it (PostgreSQL text cannot
    hold one, and no id or parameter is allowed one)."""
    if "\x00" in request.path:
        return error(404, "not_found", "no route or entity has a NUL character in its path")
    for name, value in request.query.items():
        if "\x00" in name or "\x00" in value:
            return error(400, "invalid_query", f"query parameter {name[:80]!r}: must not contain a NUL character")
    return await handler(request)


def typed(handler: Handler, refusals: Refusals | None = None) -> Handler:
    """``handler`` with its refusals answered in the error shape: :class:`ApiError`,
    :class:`QueryError` (400 ``invalid_query``), a lost lease (503 ``not_leader``), and the
    exceptions ``refusals`` maps (the nearest class in the exception's MRO wins); any other
    exception is not a refusal and propagates."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except QueryError as exc:
            return error(400, "invalid_query", str(exc))
        except (NotLeader, LeaseLost) as exc:
            return error(503, "not_leader", f"this orchestrator lost the lease before the write committed "
                                            f"({exc}); nothing was written")
        except Exception as exc:
            for cls in type(exc).__mro__:
                refusal = (refusals or {}).get(cls)
                if refusal is not None:
                    return refusal(exc).response()
            raise
    return wrapped


__all__ = ["ApiError", "Body", "Directory", "Handler", "MAX_DEPTH", "Refusals", "bearer_matches", "check_json", "error", "iso",
           "new_id", "phases", "read_body", "refuse_nul", "row_json", "shown", "typed", "validation_error"]
