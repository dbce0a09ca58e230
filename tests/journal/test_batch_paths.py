"""Fencing and column values on both PostgreSQL batch paths of ``Journal.apply``.

- ``one statement``: every group a single transition of one kind setting the same
  columns (journal.batch_pg: VALUES, fence, UPDATE and event INSERT in one
  self-committing statement);
- ``transaction``: any other batch (journal.batch: the operations one by one inside
  a transaction, fenced by its first statement).

On SQLite both shapes run the same inline statements; the tests run there too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from journal import Committed, Fence, Journal, LeaseLost, Transition, audit, lease
from tests.support.gauges import G, C, T, open_gauge_journal, seed
from tests.support.journal_state import T0, FakeClock, events, row, snapshot

TTL = 10.0
PATHS = ["one statement", "transaction"]


def shaped(ops: Sequence[Transition], path: str) -> list[list[Transition]]:
    """The same transitions as single-op groups (one statement) or in pairs (never one statement)."""
    if path == "one statement":
        return [[op] for op in ops]
    assert len(ops) >= 2
    return [list(ops[k:k + 2]) for k in range(0, len(ops), 2)]


def flat(outcomes: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for o in outcomes:
        assert isinstance(o, list), o
        out.extend(o)
    return out


@pytest.fixture
async def gj(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return await open_gauge_journal(make_journal, clock=clock, actor="orch-a")


# -- fencing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
async def test_a_fenced_apply_with_a_lost_lease_raises_and_writes_nothing(
        gj: Journal, make_journal: Callable[..., Journal], clock: FakeClock, path: str) -> None:
    other = await open_gauge_journal(make_journal, clock=clock, actor="orch-b")
    held = await lease.acquire(gj, "leader", "orch-a", TTL)
    assert held is not None
    await seed(gj, "a", "b", "c", "d")
    moves = [T(i, "on", 2, "off", hits=7) for i in ("a", "b")]
    assert flat(await gj.apply(shaped(moves, path), held.fence())) == [
        Committed(G, i, "on", "off", 3) for i in ("a", "b")]
    assert [(e["actor"], e["epoch"]) for e in (await events(gj, G))[-2:]] == [("orch-a", 1)] * 2

    late = [T(i, "on", 2, "off", hits=8) for i in ("c", "d")]
    clock.advance(TTL)  # expired, not yet taken over
    before = await snapshot(gj)
    with pytest.raises(LeaseLost):
        await gj.apply(shaped(late, path), held.fence())
    assert await snapshot(gj) == before

    taken = await lease.acquire(other, "leader", "orch-b", TTL)
    assert taken is not None and taken.epoch == 2
    before = await snapshot(gj)
    for fence in (held.fence(), Fence("leader", "orch-b", 1), Fence("nowhere", "orch-a", 1)):
        with pytest.raises(LeaseLost) as info:
            await gj.apply(shaped(late, path), fence)
        assert info.value.epoch == 1
        # Stale operations too: the lost lease is what the caller must hear about.
        with pytest.raises(LeaseLost):
            await gj.apply(shaped([T(i, "on", 9, "off", hits=8) for i in ("c", "d")], path), fence)
        assert await snapshot(gj) == before
    assert flat(await other.apply(shaped(late, path), taken.fence())) == [
        Committed(G, i, "on", "off", 3) for i in ("c", "d")]
    assert [(e["actor"], e["epoch"]) for e in (await events(gj, G))[-2:]] == [("orch-b", 2)] * 2
    assert await audit.verify(gj) == []


# -- column values ----------------------------------------------------------------------------

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
    {"data": {"k": "v"}, "seen_at": T0, "ratio": 1, "big": 2**63 - 1, "label": "\u00e9", "hits": 2},
]


def expected_value(column: str, value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc)
    if column == "ratio" and isinstance(value, int):
        return float(value)  # a float column gives back a float
    return value


@pytest.mark.parametrize("path", PATHS)
async def test_json_datetime_float_and_big_int_values_round_trip(gj: Journal, path: str) -> None:
    n = len(AWKWARD)
    ref, ids = [f"r{i}" for i in range(n)], [f"b{i}" for i in range(n)]
    shifted = AWKWARD[1:] + AWKWARD[:1]
    # Creates (PostgreSQL: one multi-row INSERT) carry the values too.
    created = await gj.apply([[C(i, **v)] for i, v in zip(ref + ids, AWKWARD + AWKWARD)])
    assert flat(created) == [Committed(G, i, None, "new", 1) for i in ref + ids]
    for i, values in zip(ids, AWKWARD):
        found = await row(gj, G, i)
        assert found is not None and all(found[k] == expected_value(k, v) for k, v in values.items()), i
    # Reference: one compare-and-set statement per transition (WriteTx.transition).
    async with gj.write() as tx:
        for i, values in zip(ref, shifted):
            await tx.transition(G, i, from_state="new", version=1, to_state="on", reason="moved", changes=values)
    out = await gj.apply(shaped([T(i, "new", 1, "on", **v) for i, v in zip(ids, shifted)], path))
    assert flat(out) == [Committed(G, i, "new", "on", 2) for i in ids]
    for r, b, values in zip(ref, ids, shifted):
        want, got = await row(gj, G, r), await row(gj, G, b)
        assert want is not None and got is not None
        for column, value in values.items():
            expected = expected_value(column, value)
            assert got[column] == expected and type(got[column]) is type(expected), (b, column, got[column])
        assert {k: v for k, v in got.items() if k != "id"} == {k: v for k, v in want.items() if k != "id"}
    first = await row(gj, G, ids[-1])  # got AWKWARD[0]
    assert first is not None and list(first["data"]) == ["z", "a", "nested"]  # key order kept
    assert [type(v) for v in first["data"]["a"][:4]] == [float, int, int, float]
    assert first["data"]["a"][1] == 2**70 and str(first["data"]["a"][3]) == "-0.0"
    assert await audit.verify(gj) == []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("column", ["label", "ratio", "big", "data", "seen_at"])
async def test_a_column_cleared_in_every_row_of_a_statement(
        gj: Journal, path: str, column: str) -> None:
    ids = ("a", "b", "c", "d")
    await seed(gj, *ids, label="l", ratio=1.5, big=2**40, data={"k": 1}, seen_at=T0)
    out = await gj.apply(shaped([T(i, "on", 2, "off", **{column: None}) for i in ids], path))
    assert flat(out) == [Committed(G, i, "on", "off", 3) for i in ids]
    for i in ids:
        found = await row(gj, G, i)
        assert found is not None and found[column] is None
    assert await audit.verify(gj) == []
