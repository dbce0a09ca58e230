"""Group commit of declarative operations: ``Journal.apply(groups, fence)`` (journal.batch).

Every test runs on both backends; on PostgreSQL the batch goes through the
``INSERT … RETURNING`` / ``UPDATE … FROM (VALUES …)`` statements and the
per-operation fallback for a second operation on one entity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from journal import (
    Committed,
    Create,
    DuplicateEntity,
    Fence,
    IllegalTransition,
    InvalidColumn,
    InvalidPayload,
    Journal,
    LeaseLost,
    StaleRow,
    Transition,
    UnknownEntityKind,
    UnknownState,
    audit,
    lease,
)
from tests.support.gauges import G, C, T, open_gauge_journal
from tests.support.journal_state import T0, FakeClock, events, row, snapshot

TTL = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def gj(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return await open_gauge_journal(make_journal, clock=clock, actor="orch-a")


async def seed(journal: Journal, *ids: str, **values: Any) -> None:
    """Create each gauge and move it new -> on, so every one sits at ``on`` v2."""
    outcomes = await journal.apply([[C(i, **values), T(i, "new", 1, "on")] for i in ids])
    assert all(isinstance(o, list) for o in outcomes), outcomes


async def at(journal: Journal, entity_id: str) -> tuple[str, int] | None:
    found = await row(journal, G, entity_id)
    return None if found is None else (found["state"], found["version"])


async def n_events(journal: Journal, entity_id: str) -> int:
    return len(await events(journal, G, entity_id))


async def assert_clean(journal: Journal) -> None:
    assert await audit.verify(journal) == []


def committed(outcome: Any) -> list[Committed | None]:
    assert isinstance(outcome, list), outcome
    return outcome


# -- many groups ------------------------------------------------------------------------------

async def test_many_groups_commit_with_one_event_per_operation(gj: Journal) -> None:
    ids = [f"g{i:02d}" for i in range(40)]
    created = await gj.apply([[C(i, label=i, hits=n)] for n, i in enumerate(ids)])
    assert created == [[Committed(G, i, None, "new", 1)] for i in ids]
    # Groups of two operations, with three different column sets (three VALUES statements).
    groups: list[Sequence[Transition]] = []
    for n, i in enumerate(ids):
        change = [{"hits": n + 100}, {"label": f"L{n}", "ratio": n / 7}, {}][n % 3]
        groups.append([T(i, "new", 1, "on", **change), T(i, "on", 2, "off")])
    moved = await gj.apply(groups)
    assert moved == [[Committed(G, i, "new", "on", 2), Committed(G, i, "on", "off", 3)] for i in ids]
    for n, i in enumerate(ids):
        found = await row(gj, G, i)
        assert found is not None and (found["state"], found["version"]) == ("off", 3)
        assert found["hits"] == (n + 100 if n % 3 == 0 else n)
        assert await n_events(gj, i) == 3
    assert len(await events(gj, G)) == 3 * len(ids)
    await assert_clean(gj)


async def test_an_empty_call_and_an_empty_group(gj: Journal) -> None:
    assert await gj.apply([]) == []
    assert await gj.apply([[], [C("e1")]]) == [[], [Committed(G, "e1", None, "new", 1)]]
    await assert_clean(gj)


# -- stale rows -------------------------------------------------------------------------------

async def test_a_stale_group_writes_nothing_and_the_others_commit(gj: Journal) -> None:
    await seed(gj, "a", "b", "c")
    out = await gj.apply([[T("a", "on", 2, "off")], [T("b", "on", 7, "off", hits=9)],
                          [T("c", "on", 2, "off")]])
    assert out[0] == [Committed(G, "a", "on", "off", 3)]
    assert out[2] == [Committed(G, "c", "on", "off", 3)]
    err = out[1]
    assert isinstance(err, StaleRow)
    assert (err.entity_id, err.expected_version, err.actual_state, err.actual_version) == ("b", 7, "on", 2)
    assert await at(gj, "b") == ("on", 2) and (await row(gj, G, "b") or {})["hits"] == 0
    assert await n_events(gj, "b") == 2
    missing = (await gj.apply([[T("nobody", "on", 2, "off")]]))[0]
    assert isinstance(missing, StaleRow) and missing.actual_state is None
    await assert_clean(gj)


async def test_a_group_whose_second_operation_is_stale_is_rolled_back_whole(gj: Journal) -> None:
    await seed(gj, "a", "b", "c", "d")
    seen: list[Committed] = []
    gj.add_commit_listener(seen.extend)
    out = await gj.apply([
        [T("a", "on", 2, "off")],
        [T("b", "on", 2, "off", label="lost"), T("c", "on", 9, "off")],  # b written, then c stale
        [T("d", "on", 2, "off")],
        [T("c", "on", 2, "on", hits=1), T("c", "on", 2, "off")],  # the same entity twice in one group
    ])
    assert out[0] == [Committed(G, "a", "on", "off", 3)]
    assert out[2] == [Committed(G, "d", "on", "off", 3)]
    assert isinstance(out[1], StaleRow) and out[1].entity_id == "c" and out[1].expected_version == 9
    assert isinstance(out[3], StaleRow) and out[3].entity_id == "c" and out[3].expected_version == 2
    assert await at(gj, "b") == ("on", 2) and (await row(gj, G, "b") or {})["label"] is None
    assert await at(gj, "c") == ("on", 2)
    assert await n_events(gj, "b") == 2 and await n_events(gj, "c") == 2
    # Listeners hear only what was committed, once.
    assert sorted(c.entity_id for c in seen) == ["a", "d"]
    await assert_clean(gj)


# -- operations refused before anything is written ---------------------------------------------

BAD: dict[str, tuple[Create | Transition, type[Exception]]] = {
    "illegal edge": (T("x", "on", 2, "new"), IllegalTransition),
    "terminal edge": (T("x", "dead", 2, "on"), IllegalTransition),
    "unknown state": (T("x", "on", 2, "exploded"), UnknownState),
    "create in a non-initial state": (Create(G, "fresh", "made", {}, state="on"), IllegalTransition),
    "unknown column": (T("x", "on", 2, "off", bogus=1), InvalidColumn),
    "managed column": (Transition(G, "x", "on", 2, "off", "moved", {"version": 5}), InvalidColumn),
    "unknown column on create": (C("fresh", bogus=1), InvalidColumn),
    "NaN in changes": (T("x", "on", 2, "off", ratio=float("nan")), InvalidPayload),
    "infinity in JSON": (T("x", "on", 2, "off", data={"v": float("inf")}), InvalidPayload),
    "NaN in a note": (T("x", "on", 2, "off", note={"why": float("nan")}), InvalidPayload),
    "naive datetime": (T("x", "on", 2, "off", seen_at=datetime(2026, 1, 1)), InvalidPayload),
    "unknown kind": (Transition("widgets", "x", "on", 2, "off", "moved"), UnknownEntityKind),
}


@pytest.mark.parametrize("name", list(BAD))
async def test_a_bad_operation_fails_only_its_group_before_anything_is_written(gj: Journal, name: str) -> None:
    await seed(gj, "x", "y", "z")
    bad, error = BAD[name]
    before = await snapshot(gj)
    # The bad operation comes second: the first of its group must not be written either.
    out = await gj.apply([[T("y", "on", 2, "off")], [T("x", "on", 2, "off", label="no"), bad],
                          [T("z", "on", 2, "off")]])
    assert type(out[1]) is error, out[1]
    assert out[0] == [Committed(G, "y", "on", "off", 3)] and out[2] == [Committed(G, "z", "on", "off", 3)]
    assert await at(gj, "x") == ("on", 2) and await row(gj, G, "fresh") is None
    after = await snapshot(gj)
    assert after["gauges"][0] == before["gauges"][0]  # x, untouched
    assert len(after["events"]) == len(before["events"]) + 2
    await assert_clean(gj)


@pytest.mark.xfail(strict=True, reason="journal.batch: a NOT NULL violation is not checked in prepare; "
                   "the driver error escapes Journal.apply and fails every group of the call")
async def test_a_not_null_violation_fails_only_its_group(gj: Journal) -> None:
    await seed(gj, "y")
    no_url = Create("participants", "p1", "configured", {})  # participants.url is NOT NULL
    out = await gj.apply([[T("y", "on", 2, "off")], [no_url]])
    assert isinstance(out[1], Exception)
    assert out[0] == [Committed(G, "y", "on", "off", 3)]


# -- creates ----------------------------------------------------------------------------------

async def test_duplicates_and_if_absent(gj: Journal) -> None:
    await seed(gj, "a")
    out = await gj.apply([
        [C("a")],
        [C("a", if_absent=True, label="ignored"), T("a", "on", 2, "off")],
        [C("n1", label="one")],
        [C("n2"), C("n2")],  # the second create of n2 in its own group
        [C("n1", if_absent=True)],  # n1 is created earlier in this very call
    ])
    assert isinstance(out[0], DuplicateEntity) and out[0].entity_id == "a"
    assert out[1] == [None, Committed(G, "a", "on", "off", 3)]
    assert out[2] == [Committed(G, "n1", None, "new", 1)]
    assert isinstance(out[3], DuplicateEntity) and out[3].entity_id == "n2"
    assert out[4] == [None]
    assert await row(gj, G, "n2") is None and await n_events(gj, "n2") == 0
    found = await row(gj, G, "a")
    assert found is not None and found["label"] is None and found["version"] == 3
    assert [e["to_state"] for e in await events(gj, G, "a")] == ["new", "on", "off"]
    assert await n_events(gj, "n1") == 1
    await assert_clean(gj)


# -- one entity in several groups of one call ---------------------------------------------------

async def test_two_groups_on_one_entity_run_in_order(gj: Journal) -> None:
    await seed(gj, "a", "b")
    out = await gj.apply([
        [T("a", "on", 2, "off", hits=1)], [T("a", "off", 3, "on", hits=2)],  # v2 -> v3 -> v4
        [T("b", "off", 3, "on")], [T("b", "on", 2, "off", label="b")],  # the later step first: stale
        [C("c", label="c")], [T("c", "new", 1, "on", label="c2")],  # created then moved
        [T("d", "new", 1, "on")], [C("d")],  # moved before it exists: stale, then created
    ])
    assert out[0] == [Committed(G, "a", "on", "off", 3)] and out[1] == [Committed(G, "a", "off", "on", 4)]
    assert isinstance(out[2], StaleRow) and (out[2].actual_state, out[2].actual_version) == ("on", 2)
    assert out[3] == [Committed(G, "b", "on", "off", 3)]
    assert out[4] == [Committed(G, "c", None, "new", 1)] and out[5] == [Committed(G, "c", "new", "on", 2)]
    assert isinstance(out[6], StaleRow) and out[6].actual_state is None
    assert out[7] == [Committed(G, "d", None, "new", 1)]
    found = await row(gj, G, "a")
    assert found is not None and (found["state"], found["version"], found["hits"]) == ("on", 4, 2)
    c = await row(gj, G, "c")
    assert c is not None and (c["state"], c["label"]) == ("on", "c2")
    await assert_clean(gj)


@pytest.mark.xfail(strict=True, reason="journal.batch.apply_groups drops every group that failed after "
                   "writing in one pass, though a later one may have failed only on an earlier one's "
                   "rolled-back write (a StaleRow naming a version that was never committed)")
async def test_a_rolled_back_group_does_not_make_a_later_group_stale(gj: Journal) -> None:
    await seed(gj, "x", "y", "z")
    out = await gj.apply([
        [T("x", "on", 2, "off"), T("y", "on", 9, "off")],  # writes x, then y is stale: rolled back
        [T("z", "on", 2, "off"), T("x", "on", 2, "off")],  # valid once the first group is gone
    ])
    assert isinstance(out[0], StaleRow) and out[0].entity_id == "y"
    assert out[1] == [Committed(G, "z", "on", "off", 3), Committed(G, "x", "on", "off", 3)], out[1]


# -- fencing ----------------------------------------------------------------------------------

async def test_a_fenced_apply_with_a_lost_lease_raises_and_writes_nothing(
        gj: Journal, make_journal: Callable[..., Journal], clock: FakeClock) -> None:
    other = await open_gauge_journal(make_journal, clock=clock, actor="orch-b")
    held = await lease.acquire(gj, "leader", "orch-a", TTL)
    assert held is not None
    out = await gj.apply([[C("a")], [C("b")]], held.fence())
    assert out == [[Committed(G, "a", None, "new", 1)], [Committed(G, "b", None, "new", 1)]]
    assert {(e["actor"], e["epoch"]) for e in await events(gj, G)} == {("orch-a", 1)}

    clock.advance(TTL)  # expired, not yet taken over
    before = await snapshot(gj)
    with pytest.raises(LeaseLost, match="expired"):
        await gj.apply([[T("a", "new", 1, "on")], [C("c")]], held.fence())
    assert await snapshot(gj) == before

    taken = await lease.acquire(other, "leader", "orch-b", TTL)
    assert taken is not None and taken.epoch == 2
    before = await snapshot(gj)
    for fence in (held.fence(), Fence("leader", "orch-b", 1), Fence("nowhere", "orch-a", 1)):
        with pytest.raises(LeaseLost):
            await gj.apply([[T("a", "new", 1, "on")], [C("c")], [T("b", "new", 1, "on", hits=-1)]], fence)
        assert await snapshot(gj) == before
    assert await other.apply([[T("a", "new", 1, "on")]], taken.fence()) == [[Committed(G, "a", "new", "on", 2)]]
    await assert_clean(gj)


# -- column values through the VALUES statement -------------------------------------------------

IST = timezone(timedelta(hours=5, minutes=30))
AWKWARD: list[dict[str, Any]] = [
    {"data": {"z": 1, "a": [1.5, 2**70, -(2**80), -0.0, 1e-300, 0.1 + 0.2, "é\u2603", None, True],
              "nested": {"b": {}, "a": []}},
     "seen_at": datetime(2026, 3, 1, 17, 30, 0, 1, tzinfo=IST), "ratio": 0.1 + 0.2,
     "big": 2**62 + 1, "label": "one", "hits": -(2**31)},
    {"data": [], "seen_at": T0, "ratio": 1e308, "big": -(2**63), "label": "", "hits": 2**31 - 1},
    {"data": "just a string", "seen_at": T0 + timedelta(microseconds=999999), "ratio": 5e-324,
     "big": 0, "label": "x" * 1000, "hits": 0},
    {"data": None, "seen_at": None, "ratio": None, "big": None, "label": None, "hits": 3},
    {"data": 12345678901234567890123, "seen_at": datetime(1971, 1, 2, tzinfo=timezone.utc),
     "ratio": -2.5, "big": 9, "label": "'; drop table gauges; --", "hits": 1},
]


def expected_value(column: str, value: Any) -> Any:
    return value.astimezone(timezone.utc) if isinstance(value, datetime) else value


@pytest.mark.parametrize("column", ["label", "ratio", "big", "data", "seen_at"])
async def test_a_column_cleared_in_every_row_of_a_statement(
        gj: Journal, backend: str, column: str, request: pytest.FixtureRequest) -> None:
    if backend == "postgresql" and column != "label":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "journal.batch._values_update renders a None as a bare NULL in the VALUES list; when a "
            "column is None in every row PostgreSQL types it text and the UPDATE fails")))
    await seed(gj, "a", "b", label="l", ratio=1.5, big=2**40, data={"k": 1}, seen_at=T0)
    out = await gj.apply([[T(i, "on", 2, "off", **{column: None})] for i in ("a", "b")])
    assert out == [[Committed(G, i, "on", "off", 3)] for i in ("a", "b")]
    for i in ("a", "b"):
        found = await row(gj, G, i)
        assert found is not None and found[column] is None
    await assert_clean(gj)


async def test_json_datetime_float_and_big_int_values_round_trip(gj: Journal) -> None:
    ids = [f"v{i}" for i in range(len(AWKWARD))]
    # Creates as one multi-row INSERT, then moves as one VALUES statement (same columns each).
    assert all(isinstance(o, list) for o in await gj.apply([[C(i, **v)] for i, v in zip(ids, AWKWARD)]))
    shifted = AWKWARD[1:] + AWKWARD[:1]
    out = await gj.apply([[T(i, "new", 1, "on", **v)] for i, v in zip(ids, shifted)])
    assert out == [[Committed(G, i, "new", "on", 2)] for i in ids]
    for i, values in zip(ids, shifted):
        found = await row(gj, G, i)
        assert found is not None
        for column, value in values.items():
            got, want = found[column], expected_value(column, value)
            assert got == want and type(got) is type(want), (i, column, got, want)
        if isinstance(values["data"], dict):
            assert list(found["data"]) == ["z", "a", "nested"]  # key order kept
            assert [type(v) for v in found["data"]["a"][:3]] == [float, int, int]
    # The one-at-a-time path (WriteTx.transition) writes exactly the same rows.
    async with gj.write() as tx:
        for i, values in zip(ids, AWKWARD):
            await tx.transition(G, i, from_state="on", version=2, to_state="off", reason="moved", changes=values)
    batch_ids = [f"w{i}" for i in range(len(AWKWARD))]
    await gj.apply([[C(i, **v), T(i, "new", 1, "on", **s)] for i, v, s in zip(batch_ids, shifted, AWKWARD)])
    await gj.apply([[T(i, "on", 2, "off", **v)] for i, v in zip(batch_ids, AWKWARD)])
    for one, batched in zip(ids, batch_ids):
        a, b = await row(gj, G, one), await row(gj, G, batched)
        assert a is not None and b is not None
        assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k != "id"}
    await assert_clean(gj)
