"""The outbox of RPC intents (``rpc_calls``).

A controller never calls a remote inside a transaction: it writes an intent,
and the dispatcher runs it after the commit. An intent's id is derived from
what it does — the owning entity, the state and version it was decided in,
the target, the method and the path — so reconciling the same state twice
yields the same intent (and the same idempotency key on the wire), never two.

Every change of an intent's state goes through the transition primitive, so
the dispatcher's work is in the audit log like everything else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa

from . import models
from .writes import Row, WriteTx, to_row

Pool = Literal["control", "data"]
KIND = "rpc_calls"


def intent_id(owner_kind: str, owner_id: str, owner_state: str, owner_version: int,
              target: str, method: str, path: str) -> str:
    """Deterministic id (and idempotency key) of the call decided at this state."""
    key = "\x1f".join([owner_kind, owner_id, owner_state, str(owner_version), target, method.upper(), path])
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Intent:
    """What a controller wants called; turned into a ``pending`` row by :func:`ensure`."""

    owner_kind: str
    owner_id: str
    owner_state: str
    owner_version: int
    target: str
    method: str
    path: str
    body: Any = None
    timeout_s: float = 10.0
    repeatable: bool = True
    pool: Pool = "control"
    max_attempts: int = 5

    @property
    def id(self) -> str:
        return intent_id(self.owner_kind, self.owner_id, self.owner_state, self.owner_version,
                         self.target, self.method, self.path)

    @classmethod
    def for_row(cls, row: Row, *, target: str, method: str, path: str, **kw: Any) -> Intent:
        """An intent owned by ``row`` at its current state and version."""
        return cls(row.kind, row.id, row.state, row.version, target, method, path, **kw)


async def ensure(tx: WriteTx, intent: Intent, *, reason: str) -> str:
    """Create the intent if it does not exist yet; return its id either way."""
    if intent.timeout_s <= 0:
        raise ValueError(f"rpc timeout_s must be > 0, got {intent.timeout_s}")
    if intent.max_attempts < 1:
        raise ValueError(f"rpc max_attempts must be >= 1, got {intent.max_attempts}")
    await tx.create(KIND, intent.id, reason=reason, if_absent=True, values={
        "entity_kind": intent.owner_kind, "entity_id": intent.owner_id, "target": intent.target,
        "method": intent.method.upper(), "path": intent.path, "body": intent.body,
        "timeout_s": float(intent.timeout_s), "repeatable": intent.repeatable, "pool": intent.pool,
        "attempts": 0, "max_attempts": intent.max_attempts, "next_attempt_at": tx.now,
        "result": None, "error": None,
    })
    return intent.id


async def get(tx: WriteTx, call_id: str) -> Row | None:
    return await tx.get(KIND, call_id)


async def claim_due(tx: WriteTx, *, limit: int) -> list[Row]:
    """Move up to ``limit`` due ``pending`` intents to ``inflight`` and return them.

    PostgreSQL uses ``FOR UPDATE SKIP LOCKED`` so concurrent claimers never
    take the same intent; SQLite has one writer at a time anyway.
    """
    t = models.rpc_calls
    stmt = (sa.select(t).where(t.c.state == "pending", t.c.next_attempt_at <= tx.now)
            .order_by(t.c.next_attempt_at, t.c.id).limit(limit)
            .with_for_update(skip_locked=True))
    rows = [to_row(KIND, r._mapping) for r in (await tx.execute(stmt)).all()]
    claimed = []
    for row in rows:
        attempts = row["attempts"] + 1
        await tx.transition(KIND, row.id, from_state="pending", version=row.version, to_state="inflight",
                            reason=f"attempt {attempts} of {row['max_attempts']}",
                            changes={"attempts": attempts})
        claimed.append(Row(KIND, row.id, "inflight", row.version + 1, {**row.values, "attempts": attempts}))
    return claimed


async def succeed(tx: WriteTx, call: Row, result: Any) -> None:
    await tx.transition(KIND, call.id, from_state=call.state, version=call.version, to_state="succeeded",
                        reason="call succeeded", changes={"result": result, "error": None})


async def fail(tx: WriteTx, call: Row, error: Mapping[str, Any], *, reason: str) -> None:
    await tx.transition(KIND, call.id, from_state=call.state, version=call.version, to_state="failed",
                        reason=reason, changes={"error": dict(error)})


async def retry_later(tx: WriteTx, call: Row, error: Mapping[str, Any], *, at: datetime) -> None:
    await tx.transition(KIND, call.id, from_state="inflight", version=call.version, to_state="pending",
                        reason=f"transport error, retry at {at.isoformat()}",
                        changes={"error": dict(error), "next_attempt_at": at})


async def recover_inflight(tx: WriteTx) -> list[Row]:
    """After a crash or take-over: settle every intent a dead dispatcher left ``inflight``.

    A repeatable call goes back to ``pending`` (it is re-sent with the same
    idempotency key, which the remote applies once). A call that is not safe to
    repeat becomes ``ambiguous``: it is never re-sent, and its owner must settle
    it from evidence or wait for an operator. Returns the rows as they are now.
    """
    t = models.rpc_calls
    rows = [to_row(KIND, r._mapping)
            for r in (await tx.execute(sa.select(t).where(t.c.state == "inflight"))).all()]
    out = []
    for row in rows:
        if row["repeatable"]:
            await tx.transition(KIND, row.id, from_state="inflight", version=row.version, to_state="pending",
                                reason="recovered in flight after restart; re-send with the same key",
                                changes={"next_attempt_at": tx.now})
            out.append(Row(KIND, row.id, "pending", row.version + 1, row.values))
        else:
            await tx.transition(KIND, row.id, from_state="inflight", version=row.version, to_state="ambiguous",
                                reason="found in flight after restart and not safe to repeat")
            out.append(Row(KIND, row.id, "ambiguous", row.version + 1, row.values))
    return out


async def next_due(tx_or_conn: Any) -> datetime | None:
    """When the earliest pending intent becomes due (for the dispatcher's sleep)."""
    t = models.rpc_calls
    value: datetime | None = (await tx_or_conn.execute(
        sa.select(sa.func.min(t.c.next_attempt_at)).where(t.c.state == "pending"))).scalar()
    return value


def backoff(attempt: int, *, base_s: float, cap_s: float) -> timedelta:
    """Exponential backoff for the ``attempt``-th failure, capped."""
    return timedelta(seconds=min(cap_s, base_s * (2 ** max(0, attempt - 1))))
