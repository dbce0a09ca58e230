"""The transition primitive: a row change and its event, together or not at all."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from journal import (
    Committed,
    DuplicateEntity,
    IllegalTransition,
    InvalidColumn,
    InvalidPayload,
    Journal,
    StaleRow,
    UnknownEntityKind,
    UnknownState,
    audit,
    lease,
    outbox,
)
from tests.support.journal_state import T0, FakeClock, events, row, snapshot

P = "participants"


async def add(journal: Journal, pid: str = "p1", **values: Any) -> Committed | None:
    async with journal.write() as tx:
        return await tx.create(P, pid, reason="configured", values={"url": f"http://{pid}", **values})


async def move(journal: Journal, pid: str, from_state: str, version: int, to_state: str,
               **changes: Any) -> Committed:
    async with journal.write() as tx:
        return await tx.transition(P, pid, from_state=from_state, version=version, to_state=to_state,
                                   reason="test", changes=changes)


async def test_create_and_transition_round_trip(journal: Journal) -> None:
    created = await add(journal, "p1", kind="environment")
    assert created == Committed(P, "p1", None, "pending", 1)
    first = await row(journal, P, "p1")
    assert first is not None
    assert (first["state"], first["version"], first["url"], first["kind"]) == ("pending", 1, "http://p1", "environment")
    assert first["probe_failures"] == 0 and first["phase"] is None  # declared defaults

    moved = await move(journal, "p1", "pending", 1, "healthy", phase="serving", instance="i-1")
    assert moved == Committed(P, "p1", "pending", "healthy", 2)
    second = await row(journal, P, "p1")
    assert second is not None
    assert (second["state"], second["version"], second["phase"], second["instance"]) == ("healthy", 2, "serving", "i-1")
    assert second["created_at"] == first["created_at"]

    evs = await events(journal, P, "p1")
    assert [(e["from_state"], e["to_state"], e["version"], e["reason"]) for e in evs] == [
        (None, "pending", 1, "configured"), ("pending", "healthy", 2, "test")]
    # The create records every data column (defaults included), a transition only what it set.
    assert evs[0]["payload"] == {"set": {"url": "http://p1", "kind": "environment", "instance": None,
                                         "phase": None, "detail": None, "probe_failures": 0,
                                         "last_probe_at": None}}
    assert evs[1]["payload"] == {"set": {"phase": "serving", "instance": "i-1"}}
    assert await audit.verify(journal) == []


async def test_version_increments_on_every_transition_including_self_edges(journal: Journal) -> None:
    await add(journal)
    await move(journal, "p1", "pending", 1, "healthy")
    for version in range(2, 6):
        done = await move(journal, "p1", "healthy", version, "healthy", probe_failures=version)
        assert done.version == version + 1
    found = await row(journal, P, "p1")
    assert found is not None and (found["version"], found["probe_failures"]) == (6, 5)
    assert [e["version"] for e in await events(journal, P, "p1")] == [1, 2, 3, 4, 5, 6]


async def test_get_and_note_inside_a_transaction(journal: Journal) -> None:
    await add(journal)
    async with journal.write() as tx:
        current = await tx.get(P, "p1")
        assert current is not None and (current.state, current.version, current["url"]) == ("pending", 1, "http://p1")
        assert await tx.get(P, "nope") is None
        await tx.transition(P, "p1", from_state=current.state, version=current.version, to_state="unreachable",
                            reason="probe failed", changes={"probe_failures": 1},
                            note={"error": "connection refused", "attempt": 1})
    (_, ev) = await events(journal, P, "p1")
    assert ev["payload"] == {"set": {"probe_failures": 1}, "note": {"error": "connection refused", "attempt": 1}}


async def test_illegal_edge_raises_and_writes_nothing(journal: Journal) -> None:
    await add(journal)
    before = await snapshot(journal)
    async with journal.write() as tx:
        with pytest.raises(IllegalTransition) as info:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="pending", reason="x")
    assert (info.value.from_state, info.value.to_state) == ("pending", "pending")
    assert info.value.allowed == ["healthy", "incompatible", "removed", "unreachable"]
    with pytest.raises(IllegalTransition, match="illegal transition None -> 'healthy'"):
        async with journal.write() as tx:
            await tx.create(P, "p2", state="healthy", reason="x", values={"url": "u"})
    with pytest.raises(UnknownState):
        async with journal.write() as tx:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="sleeping", reason="x")
    assert await snapshot(journal) == before


async def test_stale_version_or_state_raises_and_writes_nothing(journal: Journal) -> None:
    await add(journal)
    await move(journal, "p1", "pending", 1, "healthy")
    before = await snapshot(journal)
    cases: list[tuple[str, str, int, str | None, int | None]] = [
        ("p1", "healthy", 1, "healthy", 2),   # old version
        ("p1", "healthy", 3, "healthy", 2),   # future version
        ("p1", "pending", 1, "healthy", 2),   # state moved on (pending -> unreachable is an edge)
        ("ghost", "healthy", 1, None, None),  # no such row
    ]
    for pid, state, version, actual_state, actual_version in cases:
        with pytest.raises(StaleRow) as info:
            async with journal.write() as tx:
                await tx.transition(P, pid, from_state=state, version=version, to_state="unreachable", reason="x")
        assert (info.value.expected_state, info.value.expected_version) == (state, version)
        assert (info.value.actual_state, info.value.actual_version) == (actual_state, actual_version)
    assert await snapshot(journal) == before


class Weird:
    pass


def _pending_to_healthy(**kw: Any) -> Callable[[Any], Any]:
    return lambda tx: tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x", **kw)


#: Operations the journal must refuse with a typed error, before writing anything.
REFUSED: dict[str, tuple[Callable[[Any], Any], type[Exception]]] = {
    "create of unknown kind": (lambda tx: tx.create("gadgets", "g1", reason="x"), UnknownEntityKind),
    "transition of unknown kind": (
        lambda tx: tx.transition("gadgets", "g1", from_state="a", version=1, to_state="b", reason="x"),
        UnknownEntityKind),
    "get of unknown kind": (lambda tx: tx.get("gadgets", "g1"), UnknownEntityKind),
    "create with unknown column": (
        lambda tx: tx.create(P, "p2", reason="x", values={"url": "u", "colour": "red"}), InvalidColumn),
    "create setting version": (lambda tx: tx.create(P, "p2", reason="x", values={"url": "u", "version": 7}),
                               InvalidColumn),
    "create setting created_at": (
        lambda tx: tx.create(P, "p2", reason="x", values={"url": "u", "created_at": T0}), InvalidColumn),
    "create with NaN note": (lambda tx: tx.create(P, "p2", reason="x", values={"url": "u"}, note={"r": math.nan}),
                             InvalidPayload),
    "create with naive datetime": (
        lambda tx: tx.create(P, "p2", reason="x", values={"url": "u", "last_probe_at": datetime(2026, 1, 1)}),
        InvalidPayload),
    "transition with unknown column": (_pending_to_healthy(changes={"colour": "red"}), InvalidColumn),
    "transition setting state": (_pending_to_healthy(changes={"state": "removed"}), InvalidColumn),
    "transition setting version": (_pending_to_healthy(changes={"version": 9}), InvalidColumn),
    "transition setting id": (_pending_to_healthy(changes={"id": "p9"}), InvalidColumn),
    "transition setting updated_at": (_pending_to_healthy(changes={"updated_at": T0}), InvalidColumn),
    "transition with NaN note": (_pending_to_healthy(note={"loss": math.nan}), InvalidPayload),
    "transition with nested -inf": (_pending_to_healthy(note={"nested": [1, {"x": -math.inf}]}), InvalidPayload),
    "transition with unserialisable note": (_pending_to_healthy(note={"obj": Weird()}), InvalidPayload),
    "transition with naive datetime": (_pending_to_healthy(changes={"last_probe_at": datetime(2026, 1, 1)}),
                                       InvalidPayload),
}


async def test_refused_operations_raise_typed_errors_and_write_nothing(journal: Journal) -> None:
    await add(journal)
    before = await snapshot(journal)
    for case, (op, error) in REFUSED.items():
        with pytest.raises(error):
            async with journal.write() as tx:
                await op(tx)
                pytest.fail(f"{case}: not refused")
        assert await snapshot(journal) == before, case


async def test_a_refused_operation_leaves_the_transaction_usable(journal: Journal) -> None:
    await add(journal)
    before = len(await events(journal))
    async with journal.write() as tx:
        with pytest.raises(IllegalTransition):
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="pending", reason="x")
        with pytest.raises(StaleRow):
            await tx.transition(P, "p1", from_state="pending", version=9, to_state="healthy", reason="x")
        with pytest.raises(InvalidColumn):
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x",
                                changes={"state": "removed"})
        with pytest.raises(InvalidPayload):
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x",
                                note={"x": math.inf})
        with pytest.raises(DuplicateEntity):
            await tx.create(P, "p1", reason="x", values={"url": "other"})
        await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="ok")
    evs = await events(journal)
    assert len(evs) == before + 1 and evs[-1]["reason"] == "ok"
    found = await row(journal, P, "p1")
    assert found is not None and (found["state"], found["version"], found["url"]) == ("healthy", 2, "http://p1")
    assert await audit.verify(journal) == []


async def test_failure_mid_transaction_rolls_back_rows_and_events(journal: Journal) -> None:
    await add(journal)
    notified: list[Sequence[Committed]] = []
    journal.add_commit_listener(notified.append)
    before = await snapshot(journal)
    with pytest.raises(RuntimeError, match="boom"):
        async with journal.write() as tx:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x")
            await tx.create(P, "p2", reason="x", values={"url": "u"})
            raise RuntimeError("boom")
    # A journal error escaping after an earlier successful operation undoes that one too.
    with pytest.raises(StaleRow):
        async with journal.write() as tx:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x")
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x")
    assert await snapshot(journal) == before
    assert notified == []


async def test_an_event_that_cannot_be_stored_takes_its_row_change_with_it(journal: Journal) -> None:
    """Fault injection: the row UPDATE succeeds, the event INSERT (at commit) violates NOT NULL."""
    await add(journal)
    notified: list[Sequence[Committed]] = []
    journal.add_commit_listener(notified.append)
    before = await snapshot(journal)
    with pytest.raises(sa.exc.IntegrityError):
        async with journal.write() as tx:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="fine")
            await tx.transition(P, "p1", from_state="healthy", version=2, to_state="removed",
                                reason=None)  # type: ignore[arg-type]
    assert await snapshot(journal) == before
    assert notified == []


async def test_duplicate_entity_versus_if_absent(journal: Journal) -> None:
    await add(journal)
    before = await snapshot(journal)
    with pytest.raises(DuplicateEntity) as info:
        await add(journal, "p1")
    assert (info.value.kind, info.value.entity_id) == (P, "p1")
    async with journal.write() as tx:
        assert await tx.create(P, "p1", reason="again", values={"url": "other"}, if_absent=True) is None
    assert await snapshot(journal) == before
    async with journal.write() as tx:
        assert await tx.create(P, "p2", reason="new", values={"url": "u"}, if_absent=True) is not None
        assert await tx.create(P, "p2", reason="again", values={"url": "v"}, if_absent=True) is None
    assert [e["reason"] for e in await events(journal, P, "p2")] == ["new"]
    found = await row(journal, P, "p2")
    assert found is not None and found["url"] == "u"


async def test_savepoint_rollback_keeps_earlier_operations(journal: Journal) -> None:
    notified: list[Sequence[Committed]] = []
    journal.add_commit_listener(notified.append)
    async with journal.write() as tx:
        await tx.create(P, "p1", reason="kept", values={"url": "u1"})
        with pytest.raises(RuntimeError):
            async with tx.savepoint():
                await tx.create(P, "p2", reason="dropped", values={"url": "u2"})
                await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="dropped")
                raise RuntimeError("undo this group")
        async with tx.savepoint():
            await tx.create(P, "p3", reason="kept", values={"url": "u3"})
    assert await row(journal, P, "p2") is None
    p1 = await row(journal, P, "p1")
    assert p1 is not None and (p1["state"], p1["version"]) == ("pending", 1)
    assert [(e["entity_id"], e["reason"]) for e in await events(journal)] == [("p1", "kept"), ("p3", "kept")]
    assert notified == [[Committed(P, "p1", None, "pending", 1), Committed(P, "p3", None, "pending", 1)]]
    assert await audit.verify(journal) == []


async def test_events_carry_actor_and_epoch_from_the_fence(make_journal: Callable[..., Journal]) -> None:
    journal = make_journal(actor="operator-cli")
    held = await lease.acquire(journal, "leader", "orch-a", ttl_s=60)
    assert held is not None
    async with journal.write(held.fence()) as tx:
        await tx.create(P, "p1", reason="fenced", values={"url": "u"})
    await add(journal, "p2")
    by_id = {e["entity_id"]: e for e in await events(journal, P)}
    assert (by_id["p1"]["actor"], by_id["p1"]["epoch"]) == ("orch-a", 1)
    assert (by_id["p2"]["actor"], by_id["p2"]["epoch"]) == ("operator-cli", None)


async def test_timestamps_are_utc_aware_with_microseconds(make_journal: Callable[..., Journal]) -> None:
    clock = FakeClock()
    journal = make_journal(clock=clock)
    probed = datetime(2026, 3, 1, 17, 30, 0, 654321, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    await add(journal, last_probe_at=probed)
    clock.advance(1.5)
    await move(journal, "p1", "pending", 1, "healthy")
    found = await row(journal, P, "p1")
    assert found is not None
    for col in ("created_at", "updated_at", "last_probe_at"):
        assert found[col].tzinfo is not None and found[col].utcoffset() == timedelta(0), col
    assert found["created_at"] == T0 and found["created_at"].microsecond == 123456
    assert found["updated_at"] == T0 + timedelta(seconds=1.5) and found["updated_at"].microsecond == 623456
    assert found["last_probe_at"] == probed and found["last_probe_at"].microsecond == 654321
    evs = await events(journal, P, "p1")
    assert [e["ts"] for e in evs] == [T0, T0 + timedelta(seconds=1.5)]
    assert all(e["ts"].utcoffset() == timedelta(0) for e in evs)
    # The event records the instant in UTC, as the row gives it back, so replay agrees.
    assert evs[0]["payload"]["set"]["last_probe_at"] == "2026-03-01T12:00:00.654321+00:00"
    assert await audit.verify(journal) == []


async def test_a_clock_in_another_zone_is_stored_as_utc(make_journal: Callable[..., Journal]) -> None:
    local = T0.astimezone(timezone(timedelta(hours=-7)))
    journal = make_journal(clock=lambda: local)
    await add(journal)
    found = await row(journal, P, "p1")
    assert found is not None and found["created_at"] == T0 and found["created_at"].utcoffset() == timedelta(0)


TRICKY_BODY: dict[str, Any] = {
    "zeta": 1,
    "alpha": [0.1 + 0.2, 1e-310, 5e-324, 1.7976931348623157e308, -0.0, 2**70, -(2**70), 10**30],
    "mid": {"b": None, "a": "ünïcødé ✓", "c": [True, False, {"y": 1, "x": 2}]},
    "": "empty key",
}


def _assert_exact(actual: Any, expected: Any) -> None:
    """Equal, same types, same key order, floats bit-for-bit (``-0.0`` keeps its sign)."""
    assert type(actual) is type(expected), (actual, expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_exact(actual[key], expected[key])
    elif isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_exact(a, e)
    elif isinstance(expected, float):
        assert repr(actual) == repr(expected)
    else:
        assert actual == expected


async def test_json_columns_keep_key_order_floats_and_big_ints(journal: Journal) -> None:
    intent = outbox.Intent(P, "p1", "pending", 1, "http://p1", "post", "/ng-control/v1/probe",
                           body=TRICKY_BODY, timeout_s=0.1 + 0.2)
    async with journal.write() as tx:
        call_id = await outbox.ensure(tx, intent, reason="probe")
        claimed = await outbox.claim_due(tx, limit=1)
        await outbox.succeed(tx, claimed[0], {"echo": TRICKY_BODY})
    found = await row(journal, "rpc_calls", call_id)
    assert found is not None
    _assert_exact(found["body"], TRICKY_BODY)
    _assert_exact(found["result"], {"echo": TRICKY_BODY})
    assert repr(found["timeout_s"]) == repr(0.1 + 0.2)
    evs = await events(journal, "rpc_calls", call_id)
    _assert_exact(evs[0]["payload"]["set"]["body"], TRICKY_BODY)
    _assert_exact(evs[-1]["payload"]["set"]["result"], {"echo": TRICKY_BODY})
    async with journal.write() as tx:
        await tx.create(P, "p9", reason="x", values={"url": "u"}, note=TRICKY_BODY)
    (ev,) = await events(journal, P, "p9")
    _assert_exact(ev["payload"]["note"], TRICKY_BODY)
    assert await audit.verify(journal) == []


async def test_bare_json_scalars_round_trip(journal: Journal) -> None:
    """A JSON column holding a bare number keeps it exactly (SQLite must not coerce its text)."""
    values = [2**70 + 1, -(2**64), 1.0, -0.0, 0.1 + 0.2, 1e-310, 1e300, "12", True, None]
    intents = [outbox.Intent(P, "p1", "pending", 1, "http://p1", "POST", f"/x/{i}", body=value)
               for i, value in enumerate(values)]
    async with journal.write() as tx:
        for intent in intents:
            await outbox.ensure(tx, intent, reason="queued")
    for intent, value in zip(intents, values):
        found = await row(journal, "rpc_calls", intent.id)
        assert found is not None
        _assert_exact(found["body"], value)
    assert await audit.verify(journal) == []


async def test_commit_listeners_run_after_commit_only(journal: Journal) -> None:
    seen: list[list[Committed]] = []

    def listener(batch: Sequence[Committed]) -> None:
        seen.append(list(batch))

    journal.add_commit_listener(listener)
    async with journal.write() as tx:
        await tx.create(P, "p1", reason="x", values={"url": "u"})
        await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="x")
        assert seen == []  # never inside the transaction
    async with journal.write():
        pass  # nothing written, nobody told
    assert seen == [[Committed(P, "p1", None, "pending", 1), Committed(P, "p1", "pending", "healthy", 2)]]
    journal.remove_commit_listener(listener)
    await move(journal, "p1", "healthy", 2, "removed")
    assert len(seen) == 1


async def test_dispose_is_idempotent_and_a_disposed_journal_can_write_again(journal: Journal) -> None:
    await add(journal, "p1")
    await journal.dispose()
    await journal.dispose()
    await move(journal, "p1", "pending", 1, "healthy")  # reconnects, like a disposed engine does
    found = await row(journal, P, "p1")
    assert found is not None and found["version"] == 2


async def test_fetch_sees_every_commit(journal: Journal) -> None:
    """``Journal.fetch`` (the reconciler's point read) never answers from an old snapshot."""
    table = journal.kinds.get(P).table
    query = sa.select(table.c.state, table.c.version).where(table.c.id == "p1")
    assert (await journal.fetch(query)).first() is None
    await add(journal)
    assert tuple((await journal.fetch(query)).one()) == ("pending", 1)
    await move(journal, "p1", "pending", 1, "healthy")
    assert tuple((await journal.fetch(query)).one()) == ("healthy", 2)
