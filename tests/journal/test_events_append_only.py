"""The event log is append-only, enforced by the database itself, and its sequence is monotonic."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from journal import Journal, outbox
from tests.support.backends import only_postgresql
from tests.support.journal_state import events, raw_execute, snapshot

P = "participants"


async def _history(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create(P, "p1", reason="configured", values={"url": "u1"})
        await tx.create(P, "p2", reason="configured", values={"url": "u2"})
    async with journal.write() as tx:
        await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="probe ok")


async def test_update_and_delete_of_events_are_refused(journal: Journal) -> None:
    await _history(journal)
    before = await snapshot(journal)
    for sql in ("UPDATE events SET reason = 'rewritten' WHERE entity_id = 'p1'",
                "UPDATE events SET to_state = 'removed'",
                "DELETE FROM events WHERE entity_id = 'p2'",
                "DELETE FROM events"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            await raw_execute(journal, sql)
        assert await snapshot(journal) == before, sql


async def test_refusal_holds_inside_a_journal_write_too(journal: Journal) -> None:
    """Even code holding a write transaction cannot rewrite history; its transaction rolls back."""
    await _history(journal)
    before = await snapshot(journal)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        async with journal.write() as tx:
            await tx.create(P, "p3", reason="configured", values={"url": "u3"})
            await tx.execute(sa.text("DELETE FROM events WHERE entity_id = 'p1'"))
    assert await snapshot(journal) == before


@only_postgresql
async def test_truncate_of_events_is_refused_on_postgresql(journal: Journal) -> None:
    await _history(journal)
    before = await snapshot(journal)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        await raw_execute(journal, "TRUNCATE events")
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        await raw_execute(journal, "TRUNCATE events RESTART IDENTITY CASCADE")
    assert await snapshot(journal) == before


async def _history_more(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.transition(P, "p2", from_state="pending", version=1, to_state="unreachable", reason="probe failed")
        await tx.transition(P, "p2", from_state="unreachable", version=2, to_state="healthy", reason="probe ok")


async def test_inserting_events_stays_possible(journal: Journal) -> None:
    await _history(journal)
    await _history_more(journal)
    assert len(await events(journal)) == 5


async def test_sequence_is_monotonic_in_commit_and_operation_order(journal: Journal) -> None:
    expected: list[tuple[str, str]] = []
    for batch in range(6):
        async with journal.write() as tx:
            for i in range(batch + 1):
                pid = f"p{batch}-{i}"
                await tx.create(P, pid, reason="configured", values={"url": pid})
                expected.append((pid, "pending"))
            if batch:
                pid = f"p{batch - 1}-0"
                await tx.transition(P, pid, from_state="pending", version=1, to_state="healthy", reason="ok")
                expected.append((pid, "healthy"))
        # A rolled-back transaction in between leaves no visible gap in order (gaps in numbers are fine).
        with pytest.raises(RuntimeError):
            async with journal.write() as tx:
                await tx.create(P, f"ghost{batch}", reason="configured", values={"url": "g"})
                raise RuntimeError("roll back")
    async with journal.write() as tx:
        intent = outbox.Intent(P, "p0-0", "healthy", 2, "http://p0", "POST", "/x")
        await outbox.ensure(tx, intent, reason="queued")
        expected.append((intent.id, "pending"))
    evs = await events(journal)
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] >= 1
    assert [(e["entity_id"], e["to_state"]) for e in evs] == expected
    # A later write always gets a larger number than everything already committed.
    async with journal.write() as tx:
        await tx.create(P, "last", reason="configured", values={"url": "l"})
    (last,) = await events(journal, P, "last")
    assert last["seq"] > max(seqs)
