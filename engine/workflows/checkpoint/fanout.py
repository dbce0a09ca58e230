"""Fan-out helpers the workflow controllers share: participants, idempotent control calls, outcomes.

A workflow row (a checkpoint, a restore, a retirement) calls participants through outbox intents
it owns at its current state and version (:func:`control_intent`), so reconciling the same state
again finds the same calls; :func:`fan_out` writes only the missing ones and reports where they
stand; :func:`describe_error` turns a settled failure into the words the row's ``detail`` keeps.

Every call of one fan-out carries the same request, so its body is encoded once
(:class:`journal.outbox.Body`), stored once, and sent as the same bytes to every participant.
Reading where calls stand never reads their bodies: :func:`call_states` first (which exist, and
their states), and :func:`read_calls` (state, reply, error) only once they can be decided on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from journal import WriteTx, models, outbox
from journal.writes import Row, to_row
from workers.protocol import CONTROL_PREFIX

from engine.runtime.reconciler import Context
from engine.workflows.checkpoint.open_calls import SETTLED



@dataclass(frozen=True)
class Member:
    """A participant a workflow calls: its row id (name), kind and control URL."""

    name: str
    kind: str
    url: str


@dataclass
class FanOut:
    """Where one group of calls stands: ``open`` until every call settled; failures by participant."""

    open: bool = False
    failures: list[str] = field(default_factory=list)
    replies: dict[str, Any] = field(default_factory=dict)


async def participant_rows(ctx: Context) -> list[Row]:
    t = models.participants
    async with ctx.journal.read() as conn:
        rows = (await conn.execute(sa.select(t).order_by(t.c.id))).all()
    return [to_row("participants", r._mapping) for r in rows]


def healthy(rows: Iterable[Row], kinds: Iterable[str] | None = None) -> list[Member]:
    wanted = None if kinds is None else set(kinds)
    return [Member(r.id, r["kind"], r["url"]) for r in rows
            if r.state == "healthy" and r["kind"] and (wanted is None or r["kind"] in wanted)]


def control_intent(owner: Row, url: str, op: str, body: outbox.Body, timeout_s: float, *,
                   max_attempts: int = 3) -> outbox.Intent:
    """``POST <url>/ng-control/v1/checkpoint/<op>`` with a shared body, owned by ``owner`` at its
    state and version."""
    return outbox.Intent.for_row(owner, target=url, method="POST", path=f"{CONTROL_PREFIX}/{op}",
                                 shared=body, timeout_s=timeout_s, max_attempts=max_attempts)


async def read_calls(ctx: Context, ids: Iterable[str]) -> dict[str, Row]:
    """The calls of ``ids`` that exist: state, version, ``result`` and ``error`` (not the body)."""
    wanted = list(ids)
    if not wanted:
        return {}
    t = models.rpc_calls
    async with ctx.journal.read() as conn:
        rows = (await conn.execute(sa.select(t.c.id, t.c.state, t.c.version, t.c.result, t.c.error)
                                   .where(t.c.id.in_(wanted)))).all()
    return {r.id: to_row(outbox.KIND, r._mapping) for r in rows}


async def call_states(ctx: Context, ids: Iterable[str]) -> dict[str, str]:
    """The state of each of the calls ``ids`` that exists (nothing else is read)."""
    wanted = list(ids)
    if not wanted:
        return {}
    t = models.rpc_calls
    async with ctx.journal.read() as conn:
        rows = (await conn.execute(sa.select(t.c.id, t.c.state).where(t.c.id.in_(wanted)))).all()
    return {r.id: r.state for r in rows}


def describe_error(call: Row) -> str:
    """A settled call's failure in words: ``HTTP <status> <code> <detail>`` or the transport error."""
    error = call["error"] or {}
    if call.state == "ambiguous":
        return f"outcome unknown ({error.get('type', 'error')}: {error.get('detail', '')})"
    if error.get("type") == "RemoteError":
        return f"HTTP {error.get('status')} {error.get('code') or '-'} {error.get('detail', '')}".rstrip()
    kind = "timed out" if error.get("type") == "CallTimeout" else "unreachable"
    return f"{kind} ({error.get('type', 'error')}: {error.get('detail', '')})"


async def fan_out(ctx: Context, owner: Row, members: Sequence[Member], op: str, body: Mapping[str, Any],
                  deadline_ts: float) -> FanOut:
    """Ensure one ``op`` call per member (only the missing ones are written) and report where they stand."""
    timeout = max(deadline_ts - ctx.clock.time(), 0.0) + 5.0
    shared = outbox.Body.of(body)
    intents = {m.name: control_intent(owner, m.url, op, shared, timeout) for m in members}
    states = await call_states(ctx, (i.id for i in intents.values()))
    if len(states) == len(intents) and any(s not in SETTLED for s in states.values()):
        return FanOut(open=True)
    if len(states) < len(intents):
        missing = [(i, f"{op} {name} for {owner.kind} {owner.id}") for name, i in intents.items()
                   if i.id not in states]

        async def write(tx: WriteTx) -> list[Row]:
            return await outbox.ensure_all(tx, missing, claim=ctx.claims)
        ctx.send(await ctx.write(write))
        return FanOut(open=True)
    calls = await read_calls(ctx, (i.id for i in intents.values()))
    out = FanOut()
    for name, intent in intents.items():
        call = calls.get(intent.id)
        if call is None or call.state not in SETTLED:
            out.open = True
        elif call.state == "succeeded":
            out.replies[name] = call["result"]
        else:
            out.failures.append(f"{name}: {describe_error(call)}")
    return out


def timings(ctx: Context, row: Row) -> dict[str, Any]:
    """The row's ``timings`` with the seconds spent in its current state added."""
    out = dict(row["timings"] or {})
    out[row.state] = round((ctx.clock.now() - row["updated_at"]).total_seconds(), 3)
    return out


