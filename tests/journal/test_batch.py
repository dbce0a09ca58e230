"""Group commit of declarative operations: ``Journal.apply(groups, fence)`` (journal.batch).

Every test runs on both backends. On PostgreSQL a batch of single transitions of
one shape goes as one self-committing statement (journal.batch_pg); any other
batch goes through the ``INSERT … RETURNING`` / ``UPDATE … FROM (VALUES …)``
statements and the per-operation fallback for a second operation on one entity.
Fencing and column values on both paths: test_batch_paths.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import pytest

from journal import (
    Committed,
    Create,
    DuplicateEntity,
    IllegalTransition,
    InvalidColumn,
    InvalidPayload,
    Journal,
    StaleRow,
    Transition,
    UnknownEntityKind,
    UnknownState,
    audit,
)
from tests.support.gauges import G, C, T, open_gauge_journal, seed
from tests.support.journal_state import FakeClock, events, row, snapshot

@pytest.fixture
async def gj(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return await open_gauge_journal(make_journal, clock=clock, actor="orch-a")


async def at(journal: Journal, entity_id: str) -> tuple[str, int] | None:
    found = await row(journal, G, entity_id)
    return None if found is None else (found["state"], found["version"])


async def n_events(journal: Journal, entity_id: str) -> int:
    return len(await events(journal, G, entity_id))


# -- many groups ------------------------------------------------------------------------------

async def test_many_groups_commit_with_one_event_per_operation(gj: Journal) -> None:
    ids = [f"g{i:02d}" for i in range(40)]
    created = await gj.apply([[C(i, label=i, hits=n)] for n, i in enumerate(ids)])
    assert created == [[Committed(G, i, None, "new", 1)] for i in ids]
    # Groups of two operations, with three different column sets (three VALUES statements).
    groups: list[Sequence[Transition]] = []
    for n, i in enumerate(ids):
        shapes: list[dict[str, Any]] = [{"hits": n + 100}, {"label": f"L{n}", "ratio": n / 7}, {}]
        change = shapes[n % 3]
        groups.append([T(i, "new", 1, "on", **change), T(i, "on", 2, "off")])
    moved = await gj.apply(groups)
    assert moved == [[Committed(G, i, "new", "on", 2), Committed(G, i, "on", "off", 3)] for i in ids]
    for n, i in enumerate(ids):
        found = await row(gj, G, i)
        assert found is not None and (found["state"], found["version"]) == ("off", 3)
        assert found["hits"] == (n + 100 if n % 3 == 0 else n)
        assert await n_events(gj, i) == 3
    assert len(await events(gj, G)) == 3 * len(ids)
    assert await audit.verify(gj) == []


async def test_an_empty_call_and_an_empty_group(gj: Journal) -> None:
    assert await gj.apply([]) == []
    assert await gj.apply([[], [C("e1")]]) == [[], [Committed(G, "e1", None, "new", 1)]]
    assert await audit.verify(gj) == []


async def test_single_transitions_of_one_shape(gj: Journal) -> None:
    # On PostgreSQL: the one-statement path (every group one transition, same kind and columns).
    await seed(gj, "a", "b", "c", "d")
    seen: list[Committed] = []
    gj.add_commit_listener(seen.extend)
    out = await gj.apply([[T("a", "on", 2, "off", hits=1)], [T("b", "on", 7, "off", hits=2)],
                          [T("c", "on", 2, "new", hits=3)], [T("zz", "on", 2, "off", hits=4)],
                          [T("d", "on", 2, "off", hits=5)]])
    assert out[0] == [Committed(G, "a", "on", "off", 3)] and out[4] == [Committed(G, "d", "on", "off", 3)]
    assert isinstance(out[1], StaleRow) and (out[1].actual_state, out[1].actual_version) == ("on", 2)
    assert isinstance(out[2], IllegalTransition)
    assert isinstance(out[3], StaleRow) and out[3].actual_state is None
    assert [c.entity_id for c in seen] == ["a", "d"]
    assert [(e["entity_id"], e["version"], e["payload"]) for e in (await events(gj, G))[-2:]] == [
        ("a", 3, {"set": {"hits": 1}}), ("d", 3, {"set": {"hits": 5}})]  # in group order
    for i, want in (("a", 1), ("b", 0), ("c", 0), ("d", 5)):
        assert (await row(gj, G, i) or {})["hits"] == want
    assert await row(gj, G, "zz") is None
    assert await audit.verify(gj) == []


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
    assert await audit.verify(gj) == []


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
    assert await audit.verify(gj) == []


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
    assert await audit.verify(gj) == []


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
    assert await audit.verify(gj) == []


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
    assert await audit.verify(gj) == []


async def test_a_rolled_back_group_does_not_make_a_later_group_stale(gj: Journal) -> None:
    await seed(gj, "x", "y", "z")
    out = await gj.apply([
        [T("x", "on", 2, "off"), T("y", "on", 9, "off")],  # writes x, then y is stale: rolled back
        [T("z", "on", 2, "off"), T("x", "on", 2, "off")],  # valid once the first group is gone
    ])
    assert isinstance(out[0], StaleRow) and out[0].entity_id == "y"
    assert out[1] == [Committed(G, "z", "on", "off", 3), Committed(G, "x", "on", "off", 3)], out[1]
