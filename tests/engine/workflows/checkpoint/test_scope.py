"""A checkpoint's scope and rollout set read from the journal (engine/workflows/checkpoint/scope.py),
on both backends: which rows are in the scope, by which attempt; which stay continued once the
commits are in; and the not-dispatched list capped with an exact count."""

from __future__ import annotations

import pytest

from engine.workflows.checkpoint import scope as scope_module
from engine.workflows.checkpoint.scope import journal_scope, rollout_set
from journal import Journal, Transition


async def rows(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create("rollouts", "in-flight", reason="t", state="dispatched", values={"attempt": 2})
        await tx.create("rollouts", "restored", reason="t", state="pending", values={"attempt": 1})
        await tx.create("rollouts", "parked", reason="t", state="dispatched", values={"attempt": 0})
        await tx.create("rollouts", "done", reason="t", state="dispatched", values={"attempt": 0})
        for i in range(5):
            await tx.create("rollouts", f"queued-{i}", reason="t", state="pending", values={"attempt": 0})
    async with journal.write() as tx:
        row = await tx.get("rollouts", "restored")
        assert row is not None
        await tx.apply([Transition("rollouts", "restored", "pending", row.version, "pending", "restored",
                                   {"restored_on": "environment-0"})])


async def test_the_scope_is_every_attempt_in_flight_and_every_restored_one(journal: Journal) -> None:
    await rows(journal)
    async with journal.read() as conn:
        scope = await journal_scope(conn)
    assert scope == ["done", "in-flight-a2", "parked", "restored-a1"]


async def test_the_rollout_set_keeps_what_is_still_in_flight_or_restored_and_counts_the_rest(
        journal: Journal, monkeypatch: pytest.MonkeyPatch) -> None:
    await rows(journal)
    async with journal.read() as conn:
        scope = await journal_scope(conn)
    # During the commit: one reply came in (finished), one attempt was refused before it started.
    async with journal.write() as tx:
        for rid, to in (("done", "finished"), ("parked", "pending")):
            row = await tx.get("rollouts", rid)
            assert row is not None
            await tx.apply([Transition("rollouts", rid, "dispatched", row.version, to, "t", {})])
    monkeypatch.setattr(scope_module, "NOT_DISPATCHED_LISTED", 3)
    async with journal.read() as conn:
        kept = await rollout_set(conn, [*scope, "foreign-a4"])
    assert kept.continued == ["foreign-a4", "in-flight-a2", "restored-a1"]  # a key with no row stays
    assert kept.not_dispatched == ["parked", "queued-0", "queued-1"] and kept.not_dispatched_count == 6
    assert kept.as_json()["continued"][1] == {"rollout_id": "in-flight", "attempt": 2}
    assert type(kept).from_row(kept.as_row()) == kept
