"""The ``services`` rows: created from the configuration, moved only by the stack that owns them,
each move a transition with its event. Environment values never reach a row or an event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import sqlalchemy as sa

from journal import Row, WriteTx

from engine.workflows.deployment.plan import Plan

KIND = "services"
T = TypeVar("T")
#: A fenced write: runs the step in a transaction of the lease holder (the group committer's ``run``).
Write = Callable[[Callable[[WriteTx], Awaitable[Any]]], Awaitable[Any]]
#: The states in which a row's processes may be running.
LIVE = frozenset({"starting", "ready", "stopping", "restarting"})


def declared_values(plan: Plan, name: str) -> dict[str, Any]:
    svc = plan.services[name]
    return {"executor": svc.executor, "command": list(svc.command), "depends_on": list(svc.depends_on),
            "engine": plan.engine_rows.get(name)}


async def sync(tx: WriteTx, plan: Plan) -> dict[str, Row]:
    """Create a ``pending`` row for each declared service that has none; every row, by name."""
    rows: dict[str, Row] = {}
    for name in plan.order:
        await tx.create(KIND, name, reason="declared by the configuration", values=declared_values(plan, name),
                        if_absent=True)
    table = tx.journal.kinds.get(KIND).table
    for found in (await tx.execute(sa.select(table))).all():
        m = found._mapping
        rows[m["id"]] = Row(KIND, m["id"], m["state"], m["version"], dict(m))
    return rows


async def read(write: Write, plan: Plan) -> dict[str, Row]:
    """Sync, in a fenced write, and return every row."""
    async def step(tx: WriteTx) -> dict[str, Row]:
        return await sync(tx, plan)
    result: dict[str, Row] = await write(step)
    return result


async def gate_again(tx: WriteTx, engine_row: str, service: str) -> None:
    """The engine's service was (re)launched: its ``engines`` row stops claiming a version until the
    engine gate has looked at the new process and put it on the committed head (the same gate as an
    election; the deployment is not ready meanwhile: :mod:`journal.readiness`). ``memory`` is cleared:
    the new process holds every region resident, and no call to it has been acknowledged yet (the
    gate gives it a fresh adapter when the old one knew of released regions or was uncertain)."""
    row = await tx.get("engines", engine_row)
    if row is None or row.state in ("unverified", "registered", "retired"):
        return
    await tx.transition("engines", engine_row, from_state=row.state, version=row.version, to_state="unverified",
                        reason=f"its service {service} was launched: not verified until the gate looks at it",
                        changes={"serving_version": None, "health": None, "paused": False, "memory": None,
                                 "detail": f"service {service} launched a new process"})


async def move(write: Write, name: str, to_state: str, reason: str, *, only_from: frozenset[str] | None = None,
               count_restart: bool = False, engine_row: str | None = None, **changes: Any) -> bool:
    """Move ``name`` to ``to_state`` from whatever state it is in (read in the same transaction);
    with ``only_from``, only from one of those states; ``count_restart`` adds one to ``restarts``;
    ``engine_row``: in the same write, :func:`gate_again`. False when it was not moved."""
    async def step(tx: WriteTx) -> bool:
        row = await tx.get(KIND, name)
        if row is None or (only_from is not None and row.state not in only_from):
            return False
        values = {**changes, "restarts": int(row["restarts"]) + 1} if count_restart else changes
        await tx.transition(KIND, name, from_state=row.state, version=row.version, to_state=to_state,
                            reason=reason, changes=values)
        if engine_row is not None:
            await gate_again(tx, engine_row, name)
        return True
    moved: bool = await write(step)
    return moved


def as_json(m: Mapping[Any, Any]) -> dict[str, Any]:
    """A row as the API shows it."""
    def when(key: str) -> str | None:
        value = m.get(key)
        return value.isoformat() if value is not None else None
    return {"name": m["id"], "state": m["state"], "version": m["version"], "desired": m["desired"],
            "executor": m["executor"], "command": m["command"], "depends_on": m["depends_on"] or [],
            "owner": m["owner"], "host": m["host"], "pids": m["pids"], "endpoint": m["endpoint"],
            "exit_code": m["exit_code"], "restarts": m["restarts"], "log_path": m["log_path"],
            "started_at": when("started_at"), "ready_at": when("ready_at"), "stopped_at": when("stopped_at"),
            "engine": m["engine"], "detail": m["detail"], "updated_at": when("updated_at")}
