"""Audit: querying the event log, and checking the rows against a replay of their events."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from journal import Journal, audit, lease, outbox
from journal.audit import EventFilter, query_events
from tests.support.journal_state import T0, FakeClock, raw_execute

P = "participants"


@pytest.fixture
def journal(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return make_journal(clock=clock)


async def _history(journal: Journal, clock: FakeClock) -> None:
    """p1..p3 created at T0; each second after that one more transition."""
    async with journal.write() as tx:
        for pid in ("p1", "p2", "p3"):
            await tx.create(P, pid, reason="configured", values={"url": f"http://{pid}"})
    steps = [("p1", "pending", "healthy"), ("p2", "pending", "unreachable"), ("p1", "healthy", "unreachable"),
             ("p2", "unreachable", "healthy"), ("p3", "pending", "healthy")]
    versions = {"p1": 1, "p2": 1, "p3": 1}
    for pid, src, dst in steps:
        clock.advance(1)
        async with journal.write() as tx:
            await tx.transition(P, pid, from_state=src, version=versions[pid], to_state=dst, reason="probe",
                                changes={"probe_failures": versions[pid]})
        versions[pid] += 1


async def query(journal: Journal, **kw: Any) -> list[dict[str, Any]]:
    async with journal.read() as conn:
        return await query_events(conn, EventFilter(**kw))


async def test_query_events_filters(journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    await lease.acquire(journal, "leader", "orch-a", 30)
    everything = await query(journal)
    assert len(everything) == 9 and [e["seq"] for e in everything] == sorted(e["seq"] for e in everything)
    assert {e["entity_kind"] for e in await query(journal, entity_kind="leases")} == {"leases"}
    assert [(e["from_state"], e["to_state"]) for e in await query(journal, entity_kind=P, entity_id="p1")] == [
        (None, "pending"), ("pending", "healthy"), ("healthy", "unreachable")]
    assert [e["entity_id"] for e in await query(journal, to_state="healthy")] == ["p1", "p2", "p3"]
    assert await query(journal, entity_id="nobody") == []
    # Time window, inclusive at both ends; a zone other than UTC means the same instants.
    window = await query(journal, since=T0 + timedelta(seconds=2), until=T0 + timedelta(seconds=4))
    assert [(e["entity_id"], e["to_state"]) for e in window] == [
        ("p2", "unreachable"), ("p1", "unreachable"), ("p2", "healthy")]
    zone = timezone(timedelta(hours=9))
    assert await query(journal, since=(T0 + timedelta(seconds=2)).astimezone(zone),
                       until=(T0 + timedelta(seconds=4)).astimezone(zone)) == window
    assert [e["to_state"] for e in await query(journal, entity_kind=P, since=T0 + timedelta(seconds=5))] == [
        "healthy"]
    for event in everything:
        assert event["ts"].utcoffset() == timedelta(0)


async def test_query_events_pages_with_after_seq(journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    everything = await query(journal, limit=1000)
    pages: list[list[dict[str, Any]]] = []
    after = 0
    while True:
        page = await query(journal, after_seq=after, limit=3)
        if not page:
            break
        pages.append(page)
        after = page[-1]["seq"]
    assert [len(p) for p in pages] == [3, 3, 2]
    assert [e for p in pages for e in p] == everything
    # Paging composes with filters.
    healthy = await query(journal, to_state="healthy", after_seq=everything[2]["seq"], limit=1)
    assert [(e["entity_id"], e["to_state"]) for e in healthy] == [("p1", "healthy")]


@pytest.mark.parametrize("kwargs, message", [
    ({"limit": 0}, "limit must be between 1 and 1000"),
    ({"limit": 1001}, "limit must be between 1 and 1000"),
    ({"after_seq": -1}, "after must be >= 0"),
    ({"since": datetime(2026, 1, 1)}, "since must carry a timezone"),
    ({"until": datetime(2026, 1, 1)}, "until must carry a timezone"),
    ({"since": T0, "until": T0 - timedelta(microseconds=1)}, "since must not be later than until"),
])
def test_event_filter_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EventFilter(**kwargs)


def test_event_filter_accepts_its_bounds() -> None:
    EventFilter(limit=1)
    EventFilter(limit=1000, after_seq=0, since=T0, until=T0)


async def test_verify_finds_nothing_on_honest_data(journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    async with journal.write() as tx:
        call = await outbox.ensure(tx, outbox.Intent(P, "p1", "unreachable", 3, "http://p1", "GET", "/health",
                                                     body={"b": [1.5, 2**70]}), reason="probe")
        (claimed,) = await outbox.claim_due(tx, limit=5)
        await outbox.retry_later(tx, claimed, {"error": "refused"},
                                 at=(clock.now + timedelta(seconds=3)).astimezone(timezone(timedelta(hours=-3))))
    assert call == claimed.id
    assert await audit.verify(journal) == []
    assert await audit.verify(journal, ["rpc_calls"]) == []


async def test_verify_finds_a_state_changed_behind_the_journals_back(journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    # Fault injection: a raw UPDATE straight through the engine, bypassing the transition primitive.
    await raw_execute(journal, "UPDATE participants SET state = 'removed' WHERE id = 'p2'")
    mismatches = await audit.verify(journal)
    assert [(m.kind, m.entity_id) for m in mismatches] == [(P, "p2")]
    assert "state is 'removed', events say 'healthy'" in str(mismatches[0])


async def test_verify_finds_columns_and_versions_changed_behind_its_back(journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    # Fault injection: data column and version edits that no event explains.
    await raw_execute(journal, "UPDATE participants SET url = 'http://elsewhere' WHERE id = 'p1'")
    await raw_execute(journal, "UPDATE participants SET version = version + 1 WHERE id = 'p3'")
    found = {(m.entity_id, m.detail) for m in await audit.verify(journal)}
    assert ("p1", "column url is 'http://elsewhere', events say 'http://p1'") in found
    assert ("p3", "version is 3, events say 2") in found
    assert {pid for pid, _ in found} == {"p1", "p3"}


async def test_verify_finds_a_row_with_no_events_and_events_with_no_row(
        journal: Journal, clock: FakeClock) -> None:
    await _history(journal, clock)
    # Fault injection: a row inserted and another deleted outside the journal.
    await raw_execute(
        journal,
        "INSERT INTO participants (id, state, version, created_at, updated_at, url, probe_failures) "
        "VALUES ('intruder', 'healthy', 1, :t, :t, 'http://x', 0)",
        t=T0.replace(tzinfo=None) if journal.backend == "sqlite" else T0)
    await raw_execute(journal, "DELETE FROM participants WHERE id = 'p3'")
    found = {(m.entity_id, m.detail) for m in await audit.verify(journal)}
    assert found == {("intruder", "row exists with no events (written outside the journal)"),
                     ("p3", "events exist but the row is missing")}


def test_fold_reports_a_broken_history() -> None:
    base = {"reason": "r", "actor": "a", "epoch": None, "entity_kind": P, "entity_id": "p1"}
    history = [
        {**base, "seq": 1, "from_state": None, "to_state": "pending", "version": 1, "ts": T0,
         "payload": {"set": {"url": "u"}}},
        {**base, "seq": 2, "from_state": "healthy", "to_state": "removed", "version": 3, "ts": T0,
         "payload": None},
    ]
    folded = audit.fold(history)
    assert folded is not None and (folded.state, folded.version, folded.values) == ("removed", 3, {"url": "u"})
    assert folded.problems == ["event 2: moves from 'healthy' but the entity was 'pending'",
                               "event 2: version 3 does not follow 1"]
    assert audit.fold([]) is None
    late_start = audit.fold([{**history[1], "seq": 5}])
    assert late_start is not None and late_start.problems == ["event 5: history does not start with a create"]
