"""The outbox of RPC intents (``rpc_calls``).

A controller never calls a remote inside a transaction: it writes an intent,
and the dispatcher runs it after the commit. An intent's id is derived from
what it does — the owning entity, the state and version it was decided in,
the target, the method and the path — so reconciling the same state twice
yields the same intent (and the same idempotency key on the wire), never two.

Every change of an intent's state goes through the transition primitive, so
the dispatcher's work is in the audit log like everything else.

A fan-out shares one request body among its intents (:class:`Body`): the body is
encoded once, stored once in ``rpc_bodies`` under the SHA-256 of its bytes, and
each intent references it (``body_id``), so every target receives the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from . import models
from .batch import Create, Transition
from .types import dumps
from .writes import Row, WriteTx, to_row

Pool = Literal["control", "data"]
KIND = "rpc_calls"


def intent_id(owner_kind: str, owner_id: str, owner_state: str, owner_version: int,
              target: str, method: str, path: str) -> str:
    """Deterministic id (and idempotency key) of the call decided at this state."""
    key = "\x1f".join([owner_kind, owner_id, owner_state, str(owner_version), target, method.upper(), path])
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Body:
    """A request body encoded once: the exact bytes every intent that references it sends.

    ``id`` is the SHA-256 of ``content``, so equal bodies are stored once and a
    stored body never changes.
    """

    content: bytes

    @property
    def id(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @classmethod
    def of(cls, value: Any) -> Body:
        """Encode ``value`` as compact JSON (refuses NaN and what JSON cannot hold)."""
        return cls(dumps(value).encode())


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
    #: A shared body (then ``body`` must be ``None``): stored once, referenced by ``body_id``.
    shared: Body | None = None
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
    """Create the intent (and its shared body) if it does not exist yet; return its id either way."""
    await ensure_all(tx, [(intent, reason)])
    return intent.id


async def ensure_all(tx: WriteTx, intents: Sequence[tuple[Intent, str]], *, claim: bool = False) -> list[Row]:
    """Create each ``(intent, reason)`` that does not exist yet; each shared body is stored once.

    Every intent is created ``pending`` (the dispatcher claims it) unless ``claim``: then
    each *repeatable* intent is created already ``inflight``, its first attempt counted —
    claimed by the writer, whose dispatcher must be handed the returned rows after the
    commit (``Dispatcher.send``). That saves the claim's own transaction; a crash before
    the send leaves the call ``inflight``, which recovery puts back to ``pending`` and
    re-sends with the same key, as for any claimed call. A call not safe to repeat is
    never created ``inflight``: recovery would take a call that was never sent for one
    that may have arrived, and make it ambiguous.

    Returns the rows created ``inflight`` (only those this transaction created: an intent
    that already existed is left as it is and not returned).

    Raises ``ValueError`` before anything is written for a timeout or an attempt
    limit out of range, or an intent with both a body and a shared body.
    """
    for intent, _ in intents:
        if intent.timeout_s <= 0:
            raise ValueError(f"rpc timeout_s must be > 0, got {intent.timeout_s}")
        if intent.max_attempts < 1:
            raise ValueError(f"rpc max_attempts must be >= 1, got {intent.max_attempts}")
        if intent.shared is not None and intent.body is not None:
            raise ValueError("an rpc intent has either a body or a shared body, not both")
    bodies = {i.shared.id: i.shared for i, _ in intents if i.shared is not None}
    for body_id, body in bodies.items():
        await tx.execute(_insert_body_stmt(tx.journal.backend),
                         {"id": body_id, "content": body.content.decode(), "created_at": tx.now})
    creates: list[Create] = []
    for intent, reason in intents:
        claimed_now = claim and intent.repeatable
        creates.append(Create(KIND, intent.id, reason, {
            "entity_kind": intent.owner_kind, "entity_id": intent.owner_id, "target": intent.target,
            "method": intent.method.upper(), "path": intent.path, "body": intent.body,
            "body_id": None if intent.shared is None else intent.shared.id,
            "timeout_s": float(intent.timeout_s), "repeatable": intent.repeatable, "pool": intent.pool,
            "attempts": 1 if claimed_now else 0, "max_attempts": intent.max_attempts, "next_attempt_at": tx.now,
            "result": None, "error": None,
        }, "inflight" if claimed_now else "pending", if_absent=True))
    # One create per intent, written together (a run of creates is one statement on both backends).
    written = await tx.apply(creates)
    return [Row(KIND, op.entity_id, "inflight", 1, dict(op.values))
            for op, done in zip(creates, written) if done is not None and op.state == "inflight"]


@lru_cache(maxsize=2)
def _insert_body_stmt(backend: str) -> sa.Insert:
    t = models.rpc_bodies
    if backend == "postgresql":
        return postgresql.insert(t).on_conflict_do_nothing(index_elements=["id"])
    # A plain insert with a prefix keeps SQLAlchemy's compiled-statement cache (the dialect insert does not).
    return sa.insert(t).prefix_with("OR IGNORE")


async def read_bodies(conn: Any, body_ids: Iterable[str]) -> dict[str, bytes]:
    """The stored shared bodies of ``body_ids`` (those that exist), as the bytes to send."""
    wanted = sorted(set(body_ids))
    if not wanted:
        return {}
    t = models.rpc_bodies
    rows = (await conn.execute(sa.select(t.c.id, t.c.content).where(t.c.id.in_(wanted)))).all()
    return {r.id: r.content.encode() for r in rows}


async def get(tx: WriteTx, call_id: str) -> Row | None:
    return await tx.get(KIND, call_id)


async def due(conn: Any, now: datetime, *, limit: int, pool: Pool | None = None) -> list[Row]:
    """Up to ``limit`` ``pending`` intents due at ``now`` (of ``pool`` only, if given), earliest first
    (a read; claim them with :func:`claim`, each a compare-and-set, so a row another claimer took is
    simply stale)."""
    t = models.rpc_calls
    stmt = sa.select(t).where(t.c.state == "pending", t.c.next_attempt_at <= now)
    if pool is not None:
        stmt = stmt.where(t.c.pool == pool)
    stmt = stmt.order_by(t.c.next_attempt_at, t.c.id).limit(limit)
    return [to_row(KIND, r._mapping) for r in (await conn.execute(stmt)).all()]


def claim(row: Row) -> Transition:
    """``pending -> inflight``, counting the attempt."""
    attempts = row["attempts"] + 1
    return Transition(KIND, row.id, "pending", row.version, "inflight",
                      f"attempt {attempts} of {row['max_attempts']}", {"attempts": attempts})


def claimed(row: Row) -> Row:
    """``row`` as :func:`claim` leaves it."""
    return Row(KIND, row.id, "inflight", row.version + 1, {**row.values, "attempts": row["attempts"] + 1})


def succeeded(call: Row, result: Any) -> Transition:
    return Transition(KIND, call.id, call.state, call.version, "succeeded", "call succeeded",
                      {"result": result, "error": None})


def failed(call: Row, error: Mapping[str, Any], *, reason: str) -> Transition:
    return Transition(KIND, call.id, call.state, call.version, "failed", reason, {"error": dict(error)})


def retried(call: Row, error: Mapping[str, Any], *, at: datetime) -> Transition:
    return Transition(KIND, call.id, "inflight", call.version, "pending",
                      f"transport error, retry at {at.isoformat()}", {"error": dict(error), "next_attempt_at": at})


async def claim_due(tx: WriteTx, *, limit: int) -> list[Row]:
    """Move up to ``limit`` due ``pending`` intents to ``inflight`` inside ``tx`` and return them.

    PostgreSQL uses ``FOR UPDATE SKIP LOCKED`` so concurrent claimers never
    take the same intent; SQLite has one writer at a time anyway.
    """
    t = models.rpc_calls
    stmt = (sa.select(t).where(t.c.state == "pending", t.c.next_attempt_at <= tx.now)
            .order_by(t.c.next_attempt_at, t.c.id).limit(limit)
            .with_for_update(skip_locked=True))
    rows = [to_row(KIND, r._mapping) for r in (await tx.execute(stmt)).all()]
    await tx.apply([claim(row) for row in rows])
    return [claimed(row) for row in rows]


async def succeed(tx: WriteTx, call: Row, result: Any) -> None:
    await tx.apply([succeeded(call, result)])


async def fail(tx: WriteTx, call: Row, error: Mapping[str, Any], *, reason: str) -> None:
    await tx.apply([failed(call, error, reason=reason)])


async def retry_later(tx: WriteTx, call: Row, error: Mapping[str, Any], *, at: datetime) -> None:
    await tx.apply([retried(call, error, at=at)])


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
