"""GroupReader: point reads issued in one loop iteration share one query per kind (both backends)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from engine.runtime.groupread import GroupReader
from journal import Create, Journal, UnknownEntityKind
from journal.writer import Buffered
from tests.support.gauges import G, C, T, open_gauge_journal

P = "participants"


@pytest.fixture
async def gj(make_journal: Callable[..., Journal]) -> Journal:
    journal = await open_gauge_journal(make_journal)
    groups: list[list[Any]] = [[C(f"g{i:02d}", hits=i)] for i in range(30)]
    groups += [[Create(P, f"p{i}", "configured", {"url": f"http://p{i}"})] for i in range(5)]
    assert all(isinstance(o, list) for o in await journal.apply(groups))
    await journal.apply([[T(f"g{i:02d}", "new", 1, "on")] for i in range(0, 30, 3)])
    return journal


@pytest.fixture
def queries(gj: Journal) -> list[Any]:
    """Instrumentation, not a fake: every ``Journal.fetch`` still runs its real query on the
    real database; the wrapper only records the statement so the test can count round trips."""
    seen: list[Any] = []
    real = gj.fetch

    async def counting(stmt: sa.Executable, params: dict[str, Any] | None = None) -> Buffered:
        seen.append(stmt)
        return await real(stmt, params)

    gj.fetch = counting  # type: ignore[method-assign]
    return seen


async def test_concurrent_gets_share_one_query_per_kind(gj: Journal, queries: list[Any]) -> None:
    reader = GroupReader(gj)
    ids = [f"g{i:02d}" for i in range(30)] + [f"missing{i}" for i in range(10)]
    asks = [(G, i) for i in ids] + [(G, i) for i in ids[:5]]  # the same id twice too
    asks += [(P, f"p{i}") for i in range(5)] + [(P, "nobody")]
    got = await asyncio.gather(*[reader.get(kind, i) for kind, i in asks])

    assert len(queries) == 2 < len(asks)  # one per kind, however many gets
    for (kind, entity_id), found in zip(asks, got):
        if entity_id.startswith(("missing", "nobody")):
            assert found is None
            continue
        assert found is not None and (found.kind, found.id) == (kind, entity_id)
        if kind == G:
            n = int(entity_id[1:])
            on = n % 3 == 0
            assert (found.state, found.version, found["hits"]) == (("on", 2) if on else ("new", 1)) + (n,)
        else:
            assert (found.state, found.version, found["url"]) == ("pending", 1, f"http://{entity_id}")


async def test_large_batches_are_split_into_chunks(gj: Journal, queries: list[Any]) -> None:
    reader = GroupReader(gj, max_batch=7)
    ids = [f"g{i:02d}" for i in range(30)]
    got = await asyncio.gather(*[reader.get(G, i) for i in ids])
    assert [r.id if r is not None else None for r in got] == ids
    assert len(queries) == 5  # ceil(30 / 7)


async def test_reads_in_later_iterations_see_later_commits(gj: Journal, queries: list[Any]) -> None:
    reader = GroupReader(gj)
    first = await reader.get(G, "g01")
    assert first is not None and (first.state, first.version) == ("new", 1)
    await gj.apply([[T("g01", "new", 1, "on", label="later")]])
    again, other = await asyncio.gather(reader.get(G, "g01"), reader.get(G, "g02"))
    assert again is not None and (again.state, again.version, again["label"]) == ("on", 2, "later")
    assert other is not None and other.version == 1
    assert len(queries) == 2  # one per loop iteration that asked, nothing cached


async def test_an_unknown_kind_raises_in_the_caller_and_spoils_no_other_get(
        gj: Journal, queries: list[Any]) -> None:
    reader = GroupReader(gj)
    got = await asyncio.gather(reader.get(G, "g00"), reader.get("widgets", "w1"), reader.get(G, "g01"),
                               return_exceptions=True)
    assert isinstance(got[1], UnknownEntityKind) and got[1].kind == "widgets"
    assert [g.id for g in (got[0], got[2]) if not isinstance(g, BaseException) and g is not None] == ["g00", "g01"]
    assert len(queries) == 1
    with pytest.raises(UnknownEntityKind):
        await reader.get("widgets", "w1")
    assert len(queries) == 1  # refused before any query was planned


async def test_a_failed_query_fails_its_waiters_and_the_next_batch_works(
        gj: Journal, queries: list[Any]) -> None:
    reader = GroupReader(gj)
    real = gj.fetch

    # Fault injection for one query: the database is real, only this call fails.
    async def failing_once(stmt: sa.Executable, params: dict[str, Any] | None = None) -> Buffered:
        gj.fetch = real  # type: ignore[method-assign]
        raise ConnectionError("database went away")

    gj.fetch = failing_once  # type: ignore[method-assign]
    got = await asyncio.gather(reader.get(G, "g00"), reader.get(G, "g01"), return_exceptions=True)
    assert all(isinstance(g, ConnectionError) for g in got), got
    again = await reader.get(G, "g00")
    assert again is not None and again.id == "g00"
    assert len(queries) == 1
