"""Runs of same-shaped operations written at once (``journal.writes.runs``): on SQLite one
``executemany``, on PostgreSQL one statement that writes the rows and their events.

A run is written whole or not at all: a stale row or an existing id in it rolls the run back to a
savepoint and its operations go one by one, so each keeps the outcome it would have alone. Every
test runs on both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from journal import Committed, DuplicateEntity, Journal, StaleRow, audit
from journal.writes import MAX_RUN, MIN_RUN, runs
from tests.support.gauges import G, C, T, open_gauge_journal, seed
from tests.support.journal_state import FakeClock, events, row


@pytest.fixture
async def gj(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return await open_gauge_journal(make_journal, clock=clock, actor="orch-a")


@contextmanager
def executemanys(journal: Journal) -> Iterator[list[str]]:
    """The SQL of every ``executemany`` the SQLite writer runs inside the block (none on PostgreSQL)."""
    seen: list[str] = []
    writer = journal._sqlite_writer  # noqa: SLF001 - the one place the SQLite write connection lives
    if writer is None:
        yield seen
        return

    def listen(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        if executemany:
            seen.append(statement)
    sa.event.listen(writer.engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        sa.event.remove(writer.engine, "before_cursor_execute", listen)


def test_runs_split_ops_into_spans_of_one_shape() -> None:
    ops = [T(f"g{i}", "on", 2, "off", hits=i) for i in range(5)] + [T("x", "on", 2, "off")] + [
        C(f"n{i}") for i in range(MIN_RUN)] + [T("g0", "off", 3, "on"), T("g0", "on", 4, "off")]
    assert runs(ops) == [(0, 5), (5, 6), (6, 6 + MIN_RUN), (10, 11), (11, 12)]
    assert runs([T(f"g{i}", "on", 2, "off") for i in range(MAX_RUN + 3)]) == [(0, MAX_RUN), (MAX_RUN, MAX_RUN + 1),
                                                                              (MAX_RUN + 1, MAX_RUN + 2),
                                                                              (MAX_RUN + 2, MAX_RUN + 3)]
    # The same entity twice in a row ends the run: its second transition depends on the first.
    same = [T(f"g{i}", "on", 2, "off") for i in range(3)] + [T("g0", "off", 3, "on")]
    assert runs(same) == [(0, 1), (1, 2), (2, 3), (3, 4)]


async def test_a_run_of_transitions_commits_each_with_its_event(gj: Journal) -> None:
    ids = [f"g{i}" for i in range(8)]
    await seed(gj, *ids)
    with executemanys(gj) as seen:
        out = await gj.apply([[T(i, "on", 2, "off", hits=n)] for n, i in enumerate(ids)])
    assert out == [[Committed(G, i, "on", "off", 3)] for i in ids]
    if gj.backend == "sqlite":
        assert [s.split()[0] for s in seen] == ["UPDATE", "INSERT"], seen  # the run, then the events
    for n, i in enumerate(ids):
        assert (await row(gj, G, i) or {})["hits"] == n
        assert [e["to_state"] for e in await events(gj, G, i)] == ["new", "on", "off"]
    assert await audit.verify(gj) == []


async def test_a_stale_row_in_a_run_fails_alone(gj: Journal) -> None:
    ids = [f"g{i}" for i in range(8)]
    await seed(gj, *ids)
    ops = [[T(i, "on", 9 if i == "g5" else 2, "off", hits=1)] for i in ids]
    out = await gj.apply(ops)
    assert isinstance(out[5], StaleRow) and out[5].entity_id == "g5" and out[5].actual_version == 2
    assert all(o == [Committed(G, i, "on", "off", 3)] for i, o in zip(ids, out) if i != "g5")
    assert (await row(gj, G, "g5") or {})["hits"] == 0 and len(await events(gj, G, "g5")) == 2
    assert await audit.verify(gj) == []


async def test_write_tx_apply_runs_creates_and_keeps_if_absent(gj: Journal) -> None:
    await seed(gj, "n1", "n4")
    async with gj.write() as tx:
        out = await tx.apply([C(f"n{i}", if_absent=True, label=f"l{i}") for i in range(6)])
    assert [o is None for o in out] == [False, True, False, False, True, False]
    assert (await row(gj, G, "n1") or {})["state"] == "on"  # left alone
    for i in (0, 2, 3, 5):
        assert (await row(gj, G, f"n{i}") or {})["label"] == f"l{i}"
        assert len(await events(gj, G, f"n{i}")) == 1
    assert len(await events(gj, G, "n4")) == 2
    assert await audit.verify(gj) == []


async def test_write_tx_apply_raises_for_a_duplicate_or_stale_row_in_a_run(gj: Journal) -> None:
    await seed(gj, "d2")
    with pytest.raises(DuplicateEntity):
        async with gj.write() as tx:
            await tx.apply([C(f"d{i}") for i in range(5)])
    assert await row(gj, G, "d0") is None  # the transaction rolled back whole
    await seed(gj, "s0", "s1", "s2", "s3")
    with pytest.raises(StaleRow):
        async with gj.write() as tx:
            await tx.apply([T(f"s{i}", "on", 7 if i == 2 else 2, "off") for i in range(4)])
    assert [(await row(gj, G, f"s{i}") or {})["state"] for i in range(4)] == ["on"] * 4
    assert await audit.verify(gj) == []


async def test_write_tx_apply_runs_transitions_then_creates_with_their_events(gj: Journal) -> None:
    await seed(gj, *(f"t{i}" for i in range(5)))
    async with gj.write() as tx:
        out = await tx.apply([T(f"t{i}", "on", 2, "off", hits=i) for i in range(5)]
                             + [C(f"c{i}", label="x") for i in range(5)])
    assert out[:5] == [Committed(G, f"t{i}", "on", "off", 3) for i in range(5)]
    assert out[5:] == [Committed(G, f"c{i}", None, "new", 1) for i in range(5)]
    for i in range(5):
        assert (await row(gj, G, f"t{i}") or {})["hits"] == i
        assert [e["to_state"] for e in await events(gj, G, f"t{i}")] == ["new", "on", "off"]
        assert [e["payload"]["set"]["label"] for e in await events(gj, G, f"c{i}")] == ["x"]
    assert await audit.verify(gj) == []


@pytest.mark.parametrize("size", [5, 7, 13])
async def test_a_batch_between_statement_sizes_writes_exactly_its_rows(gj: Journal, size: int) -> None:
    # PostgreSQL pads a batch to the next statement size with rows of NULLs; they must write nothing.
    ids = [f"p{i}" for i in range(size)]
    async with gj.write() as tx:
        out = await tx.apply([C(i, label=i) for i in ids])
    assert out == [Committed(G, i, None, "new", 1) for i in ids]
    assert await gj.apply([[T(i, "new", 1, "on", hits=n)] for n, i in enumerate(ids)]) == [
        [Committed(G, i, "new", "on", 2)] for i in ids]
    async with gj.read() as conn:
        e = sa.table("events", sa.column("entity_id"), sa.column("entity_kind"))
        counted = (await conn.execute(sa.select(sa.func.count()).select_from(e).where(e.c.entity_kind == G))).scalar()
        rows = (await conn.execute(sa.text("SELECT count(*) FROM gauges"))).scalar()
    assert (counted, rows) == (2 * size, size)
    assert await audit.verify(gj) == []
