"""Query parameters of the API's read routes, checked into typed values (no HTTP here: the CLI
uses the same rules for its flags). A refusal is a :class:`QueryError` naming the parameter, the
value and the rule; the HTTP shell answers it 400 ``invalid_query``."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from journal import KindRegistry, audit
from journal.audit import EventFilter

EVENT_PARAMS = {"kind", "entity", "state", "since", "until", "after", "limit"}
LIST_PARAMS = {"state", "limit", "before"}


class QueryError(Exception):
    """A query parameter that breaks a rule (``param`` names it)."""

    def __init__(self, param: str, value: str, rule: str) -> None:
        self.param = param
        super().__init__(f"query parameter {param}={value!r}: {rule}")


def int_param(q: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = q.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(name, raw, "must be an integer") from None
    if not lo <= value <= hi:
        raise QueryError(name, raw, f"must be between {lo} and {hi}")
    return value


def time_param(q: dict[str, str], name: str) -> datetime | None:
    raw = q.get(name)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise QueryError(name, raw, "must be an ISO-8601 timestamp with a timezone") from None
    if value.tzinfo is None:
        raise QueryError(name, raw, "must carry a timezone (e.g. 2026-11-30T10:00:00+00:00)")
    try:
        # Compared in UTC: near year 1 or 9999 an offset pushes it out of the representable range.
        return value.astimezone(timezone.utc)
    except OverflowError:
        raise QueryError(name, raw, "is out of range once converted to UTC") from None


#: States of records that are not entities (the lease log).
LEASE_STATES = {"held", "released"}


def parse_event_filter(q: dict[str, str], kinds: KindRegistry) -> EventFilter:
    """Validate ``GET /v1/events`` parameters into a filter; :class:`QueryError` names the culprit."""
    for name in q:
        if name not in EVENT_PARAMS:
            raise QueryError(name, q[name], f"unknown parameter (known: {', '.join(sorted(EVENT_PARAMS))})")
    known_kinds = kinds.names() + ["leases"]
    kind = q.get("kind")
    if kind is not None and kind not in known_kinds:
        raise QueryError("kind", kind, f"unknown entity kind (known: {', '.join(known_kinds)})")
    state = q.get("state")
    if state is not None:
        if kind is None:
            states = set(LEASE_STATES).union(*(k.machine.states for k in kinds))
        else:
            states = LEASE_STATES if kind == "leases" else set(kinds.get(kind).machine.states)
        if state not in states:
            where = f"of {kind}" if kind else "of any kind"
            raise QueryError("state", state, f"not a state {where} (known: {', '.join(sorted(states))})")
    since, until = time_param(q, "since"), time_param(q, "until")
    if since and until and since > until:
        raise QueryError("since", q["since"], "must not be later than until")
    return EventFilter(entity_kind=kind, entity_id=q.get("entity"), to_state=state,
                       since=since, until=until, after_seq=int_param(q, "after", 0, 0, 2**62),
                       limit=int_param(q, "limit", 100, 1, audit.MAX_PAGE))


def single_values(query: Any) -> dict[str, str]:
    """The query as a plain mapping; a parameter given twice is refused, not half-read."""
    out: dict[str, str] = {}
    for name in query:
        values = query.getall(name)
        if len(values) > 1:
            raise QueryError(name, ",".join(values), "given more than once")
        out[name] = values[0]
    return out


def no_query(query: Any) -> None:
    """Refuse every parameter of ``query``: for a route that takes none (one given twice is refused as
    such, by :func:`single_values`)."""
    for name, value in single_values(query).items():
        raise QueryError(name, value, "unknown parameter (this route takes none)")


def parse_list_query(q: dict[str, str], kind: str, kinds: KindRegistry) -> tuple[str | None, int, str | None]:
    for name in q:
        if name not in LIST_PARAMS:
            raise QueryError(name, q[name], f"unknown parameter (known: {', '.join(sorted(LIST_PARAMS))})")
    state = q.get("state")
    states = kinds.get(kind).machine.states
    if state is not None and state not in states:
        raise QueryError("state", state, f"not a state of {kind} (known: {', '.join(sorted(states))})")
    return state, int_param(q, "limit", 50, 1, audit.MAX_PAGE), q.get("before")


def event_json(ev: dict[str, Any]) -> dict[str, Any]:
    return {**ev, "ts": ev["ts"].isoformat()}


async def entity_counts(journal: Any) -> dict[str, dict[str, int]]:
    """Rows per kind and state, straight from the journal."""
    out: dict[str, dict[str, int]] = {}
    async with journal.read() as conn:
        for ek in journal.kinds:
            rows = await conn.execute(sa.select(ek.table.c.state, sa.func.count()).group_by(ek.table.c.state))
            out[ek.name] = {state: n for state, n in rows.all()}
    return out


__all__ = ["EVENT_PARAMS", "LEASE_STATES", "LIST_PARAMS", "QueryError", "entity_counts", "event_json", "int_param",
           "no_query", "parse_event_filter", "parse_list_query", "single_values", "time_param"]
