"""Participant discovery: probe every configured server's checkpoint status.

Each configured server is a ``participants`` row named after its config entry.
The controller probes ``GET {url}/ng-control/v1/checkpoint/status`` with a
per-probe timeout and a capped number of connection tries, and records kind,
instance, phase and health:

- ``healthy``: a valid status reply of a known kind;
- ``incompatible``: 404 (not a participant), an unknown kind, or a reply
  that is not a valid status; probing goes on in case the server is fixed;
- ``unreachable``: refused, reset, timed out or 5xx; probed again with
  exponential backoff (``interval_s`` doubling up to ``max_backoff_s``).

Every participant is also probed at once when a ``services`` row becomes ``ready`` (a service of the
deployment's stack started or was rebuilt: the participant it runs may be a new process).

A probe that changes nothing writes nothing: ``last_probe_at`` is the time of
the last probe that changed the row. Probes are reads, so they are made
directly (outside any transaction) rather than through the outbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

import sqlalchemy as sa

from journal import Committed, Transition, WriteTx, models
from journal.writes import Row
from workers.protocol import KINDS, STATUS_PATH, StatusReply

from engine.runtime.metrics import Metrics
from engine.runtime.reconciler import BaseController, Context, Result
from engine.runtime.rpc import RemoteError, RpcClient, RpcError

log = logging.getLogger("tidelog.discovery")

KIND = "participants"


@dataclass(frozen=True)
class DiscoverySettings:
    probe_timeout_s: float = 5.0
    probe_tries: int = 3
    interval_s: float = 30.0
    max_backoff_s: float = 600.0


@dataclass(frozen=True)
class ProbeOutcome:
    state: str
    values: dict[str, Any]
    reason: str


def classify(reply: Any = None, error: RpcError | None = None) -> ProbeOutcome:
    """Turn a probe's reply or error into the row's next state and columns."""
    if error is not None:
        if isinstance(error, RemoteError) and error.status == 404:
            return ProbeOutcome("incompatible", {"detail": "not a participant (status route answers 404)"},
                                "not a participant")
        if isinstance(error, RemoteError) and not error.retryable:
            return ProbeOutcome("incompatible", {"detail": str(error)}, "status refused")
        return ProbeOutcome("unreachable", {"detail": str(error)}, "probe failed")
    try:
        status = StatusReply.model_validate(reply)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "reply"
        return ProbeOutcome("incompatible", {"detail": f"invalid status reply: {where}: {first['msg']}"},
                            "invalid status reply")
    if status.kind not in KINDS:
        return ProbeOutcome("incompatible",
                            {"kind": None, "instance": status.instance, "phase": status.phase,
                             "detail": f"unknown participant kind {status.kind!r} (known: {', '.join(KINDS)})"},
                            "unknown kind")
    return ProbeOutcome("healthy", {"kind": status.kind, "instance": status.instance, "phase": status.phase,
                                    "detail": None}, "status ok")


class DiscoveryController(BaseController):
    kind = KIND

    def __init__(self, rpc: RpcClient, settings: DiscoverySettings, metrics: Metrics | None = None) -> None:
        self.rpc = rpc
        self.settings = settings
        self.metrics = metrics or Metrics()
        # Operator requests for an immediate probe (POST /v1/participants/probe). Not entity
        # state: losing them in a crash only means waiting for the next scheduled probe.
        self._forced: set[str] = set()
        # Every participant this process has looked at (to probe them all when a service is ready).
        self._known: set[str] = set()
        self._enqueue: Callable[[str, str], None] | None = None

    def request_probe(self, name: str) -> None:
        self._forced.add(name)

    def attach(self, enqueue: Callable[[str, str], None]) -> None:
        self._enqueue = enqueue

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """A service of the stack became ready (started, or rebuilt after a failure): every known
        participant is probed now. A rebuilt participant is a new process on the same address, and
        its row may say ``unreachable`` with a backoff of minutes (a probe made while it was down);
        work waits for ``healthy``, so waiting out that backoff would cost the rebuild minutes."""
        if self._enqueue is None or not any(c.kind == "services" and c.to_state == "ready" for c in committed):
            return
        for name in sorted(self._known):
            self._forced.add(name)
            self._enqueue(KIND, name)

    def next_probe_in(self, row: Row) -> float:
        """Seconds until the row is due for its next probe."""
        s = self.settings
        if row.state == "pending" or row["last_probe_at"] is None:
            return 0.0
        interval = s.interval_s
        if row.state == "unreachable":
            interval = min(s.max_backoff_s, s.interval_s * 2 ** max(0, row["probe_failures"] - 1))
        return interval

    async def probe(self, url: str) -> ProbeOutcome:
        try:
            reply = await self.rpc.call(url, "GET", STATUS_PATH, timeout_s=self.settings.probe_timeout_s,
                                        tries=self.settings.probe_tries)
        except RpcError as exc:
            outcome = classify(error=exc)
        else:
            outcome = classify(reply)
        self.metrics.probes.labels(result=outcome.state).inc()
        return outcome

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state == "removed":
            self._known.discard(entity_id)
            return Result()
        self._known.add(entity_id)
        last = row["last_probe_at"]
        wait = self.next_probe_in(row)
        forced = entity_id in self._forced
        self._forced.discard(entity_id)
        if last is not None and not forced:
            elapsed = (ctx.clock.now() - last).total_seconds()
            if elapsed < wait:
                return Result(requeue_after=wait - elapsed)
        outcome = await self.probe(row["url"])
        changes = self._changes(row, outcome)
        if changes is None:
            return Result(requeue_after=self.next_probe_in(row))

        await ctx.apply(Transition(KIND, entity_id, row.state, row.version, outcome.state, outcome.reason,
                                   {**changes, "last_probe_at": ctx.clock.now()}))
        if outcome.state != "healthy" and row.state != outcome.state:
            log.warning("participant %s is %s: %s", entity_id, outcome.state, outcome.values.get("detail"))
        return Result()  # the commit wakes this key; the next look computes the delay

    @staticmethod
    def _changes(row: Row, outcome: ProbeOutcome) -> dict[str, Any] | None:
        """Columns to write, or ``None`` when the probe changed nothing worth recording."""
        values: dict[str, Any] = dict(outcome.values)
        if outcome.state == "unreachable":
            values["probe_failures"] = row["probe_failures"] + 1
        elif row["probe_failures"]:
            values["probe_failures"] = 0
        if outcome.state == row.state and all(row[k] == v for k, v in values.items()
                                              if k != "probe_failures"):
            if outcome.state != "unreachable":
                return None
        return values


async def sync_configured(tx: WriteTx, configured: Mapping[str, str]) -> list[str]:
    """Make ``participants`` match the configuration (name -> url); returns the names touched.

    New names are created ``pending``; a changed URL or a name put back into
    the configuration is probed again from ``pending``; names no longer
    configured become ``removed`` (their history stays).
    """
    t = models.participants
    rows = {r.id: r for r in (await tx.execute(sa.select(t.c.id, t.c.state, t.c.version, t.c.url))).all()}
    touched: list[str] = []
    for name, url in configured.items():
        row = rows.get(name)
        if row is None:
            await tx.create(KIND, name, reason="configured", values={"url": url})
        elif row.state == "removed":
            await tx.transition(KIND, name, from_state="removed", version=row.version, to_state="pending",
                                reason="configured again", changes={"url": url, "last_probe_at": None,
                                                                    "probe_failures": 0})
        elif row.url != url:
            await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state="removed",
                                reason=f"url changed to {url}")
            await tx.transition(KIND, name, from_state="removed", version=row.version + 1, to_state="pending",
                                reason="configured with a new url",
                                changes={"url": url, "last_probe_at": None, "probe_failures": 0,
                                         "kind": None, "instance": None, "phase": None, "detail": None})
        else:
            continue
        touched.append(name)
    for name, row in rows.items():
        if name not in configured and row.state != "removed":
            await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state="removed",
                                reason="no longer configured")
            touched.append(name)
    return touched
