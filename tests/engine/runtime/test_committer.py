"""GroupCommitter on a real journal (both backends) behind a real lease fence.

Concurrent submissions (``asyncio.gather``) reach the committer's loop in one
iteration, so they share commits; each submitter still gets its own result or
its own exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from engine.runtime.clock import VirtualClock
from engine.runtime.committer import GroupCommitter, NotLeader
from engine.runtime.reconciler import Context
from journal import (
    Committed,
    Fence,
    IllegalTransition,
    Journal,
    LeaseLost,
    StaleRow,
    WriteTx,
    audit,
    lease,
)
from tests.support.backends import only_postgresql
from tests.support.gauges import G, C, T, open_gauge_journal
from tests.support.journal_state import FakeClock, events, row, snapshot

TTL = 10.0


class Leader:
    """The fence provider a committer reads before each transaction, and what it was told."""

    def __init__(self) -> None:
        self.fence: Fence | None = None
        self.lost: list[LeaseLost] = []

    def __call__(self) -> Fence | None:
        return self.fence


@pytest.fixture
async def gj(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    journal = await open_gauge_journal(make_journal, clock=clock, actor="orch-a")
    await journal.apply([[C(f"s{i:02d}")] for i in range(20)])
    return journal


@pytest.fixture
async def leader(gj: Journal) -> Leader:
    held = await lease.acquire(gj, "leader", "orch-a", TTL)
    assert held is not None
    out = Leader()
    out.fence = held.fence()
    return out


@pytest.fixture
async def committer(gj: Journal, leader: Leader) -> AsyncIterator[GroupCommitter]:
    c = GroupCommitter(gj, leader, on_lease_lost=leader.lost.append)
    try:
        yield c
    finally:
        await c.close()


def move(entity_id: str, version: int = 1, result: Any = None, **changes: Any
         ) -> Callable[[WriteTx], Any]:
    async def fn(tx: WriteTx) -> Any:
        await tx.transition(G, entity_id, from_state="new", version=version, to_state="on", reason="run",
                            changes=changes)
        return result if result is not None else entity_id
    return fn


async def state_of(journal: Journal, entity_id: str) -> tuple[str, int] | None:
    found = await row(journal, G, entity_id)
    return None if found is None else (found["state"], found["version"])


async def test_concurrent_applies_and_runs_share_commits(gj: Journal, committer: GroupCommitter) -> None:
    applies = [committer.apply(T(f"s{i:02d}", "new", 1, "on", hits=i)) for i in range(8)]
    applies.append(committer.apply(T("s08", "new", 5, "on")))  # stale
    applies.append(committer.apply(T("s09", "new", 1, "off")))  # illegal edge
    applies.append(committer.apply(C("n1"), T("n1", "new", 1, "on"), T("s10", "new", 1, "on")))
    runs = [committer.run(move(f"s{i}", result={"n": i})) for i in range(11, 17)]
    runs.append(committer.run(move("s17", version=3)))  # stale
    runs.append(committer.run(move("s18", bogus=1)))  # unknown column (its own error type)
    results = await asyncio.gather(*applies, *runs, return_exceptions=True)

    assert committer.commits < len(results)
    assert committer.commits == 2  # one Journal.apply, one run transaction
    for i in range(8):
        assert results[i] == [Committed(G, f"s{i:02d}", "new", "on", 2)]
    assert isinstance(results[8], StaleRow) and results[8].entity_id == "s08"
    assert isinstance(results[9], IllegalTransition)
    assert results[10] == [Committed(G, "n1", None, "new", 1), Committed(G, "n1", "new", "on", 2),
                           Committed(G, "s10", "new", "on", 2)]
    assert results[11:17] == [{"n": i} for i in range(11, 17)]
    assert isinstance(results[17], StaleRow) and results[17].actual_version == 1
    assert type(results[18]).__name__ == "InvalidColumn"

    for i in [*range(8), 10, *range(11, 17)]:
        assert await state_of(gj, f"s{i:02d}") == ("on", 2)
    for i in (8, 9, 17, 18, 19):
        assert await state_of(gj, f"s{i:02d}") == ("new", 1)
    assert await state_of(gj, "n1") == ("on", 2)
    fenced = [e for e in await events(gj, G) if e["reason"] != "made" or e["entity_id"] == "n1"]
    assert len(fenced) == 8 + 3 + 6
    assert {(e["actor"], e["epoch"]) for e in fenced} == {("orch-a", 1)}
    assert await audit.verify(gj) == []


async def test_submissions_beyond_max_batch_go_in_later_commits(gj: Journal, leader: Leader) -> None:
    c = GroupCommitter(gj, leader, max_batch=3)
    try:
        out = await asyncio.gather(*[c.apply(T(f"s{i:02d}", "new", 1, "on")) for i in range(7)])
        assert out == [[Committed(G, f"s{i:02d}", "new", "on", 2)] for i in range(7)]
        assert (c.commits, c.writes) == (3, 7)
        # One submission at a time: a commit each, the committer's loop is reused.
        assert await c.run(move("s07")) == "s07"
        assert await c.apply(T("s08", "new", 1, "on")) == [Committed(G, "s08", "new", "on", 2)]
        assert c.commits == 5
    finally:
        await c.close()
    assert await audit.verify(gj) == []


async def test_a_run_that_raises_after_writing_rolls_back_only_its_own_writes(
        gj: Journal, committer: GroupCommitter) -> None:
    seen: list[Committed] = []
    gj.add_commit_listener(seen.extend)

    async def boom(tx: WriteTx) -> None:
        await tx.create(G, "k2", reason="made")
        await tx.transition(G, "s02", from_state="new", version=1, to_state="on", reason="run")
        raise RuntimeError("boom after writing")

    async def make(tx: WriteTx) -> str:
        await tx.create(G, "k1", reason="made", values={"label": "kept"})
        return "made"

    results = await asyncio.gather(committer.run(make), committer.run(boom), committer.run(move("s03")),
                                   return_exceptions=True)
    assert results[0] == "made" and results[2] == "s03"
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "boom after writing"
    assert committer.commits == 1
    assert await row(gj, G, "k2") is None and await events(gj, G, "k2") == []
    assert await state_of(gj, "s02") == ("new", 1) and len(await events(gj, G, "s02")) == 1
    assert await state_of(gj, "k1") == ("new", 1) and await state_of(gj, "s03") == ("on", 2)
    assert sorted(c.entity_id for c in seen) == ["k1", "s03"]

    # Alone in its transaction (no savepoint needed), it still writes nothing.
    before = await snapshot(gj)
    with pytest.raises(RuntimeError, match="boom"):
        await committer.run(boom)
    assert await snapshot(gj) == before
    assert await audit.verify(gj) == []


async def test_without_a_fence_every_submission_gets_not_leader(gj: Journal, leader: Leader,
                                                                committer: GroupCommitter) -> None:
    leader.fence = None
    before = await snapshot(gj)
    results = await asyncio.gather(committer.apply(T("s00", "new", 1, "on")), committer.apply(C("n1")),
                                   committer.run(move("s01")), committer.run(move("s02")),
                                   return_exceptions=True)
    assert all(isinstance(r, NotLeader) for r in results), results
    assert (committer.commits, committer.writes) == (0, 0)
    assert leader.lost == []
    assert await snapshot(gj) == before


@pytest.fixture
async def taken_over(gj: Journal, committer: GroupCommitter, make_journal: Callable[..., Journal],
                     clock: FakeClock) -> Journal:
    """After one fenced commit of orch-a, orch-b takes the lapsed lease over (epoch 2)."""
    other = await open_gauge_journal(make_journal, clock=clock, actor="orch-b")
    assert await committer.apply(T("s00", "new", 1, "on")) == [Committed(G, "s00", "new", "on", 2)]
    clock.advance(TTL + 1)
    taken = await lease.acquire(other, "leader", "orch-b", TTL)
    assert taken is not None and taken.epoch == 2
    return other


def assert_all_lease_lost(results: list[Any]) -> None:
    assert all(isinstance(r, LeaseLost) for r in results), results
    assert all((r.epoch, r.current_holder, r.current_epoch) == (1, "orch-b", 2)
               for r in results if isinstance(r, LeaseLost))


async def test_after_a_take_over_every_submission_gets_lease_lost(
        gj: Journal, leader: Leader, committer: GroupCommitter, taken_over: Journal) -> None:
    before = await snapshot(gj)
    results = await asyncio.gather(committer.apply(T("s01", "new", 1, "on")), committer.apply(C("n1")),
                                   committer.run(move("s02")), return_exceptions=True)
    assert_all_lease_lost(list(results))
    assert leader.lost and all(isinstance(e, LeaseLost) for e in leader.lost)
    assert committer.commits == 1
    assert await snapshot(gj) == before


async def test_after_a_take_over_no_run_of_a_shared_transaction_commits(
        gj: Journal, leader: Leader, committer: GroupCommitter, taken_over: Journal, backend: str,
        request: pytest.FixtureRequest) -> None:
    before = await snapshot(gj)
    results = await asyncio.gather(committer.run(move("s02")), committer.run(move("s03")),
                                   committer.run(move("s04")), return_exceptions=True)
    assert_all_lease_lost(list(results))
    assert leader.lost
    assert committer.commits == 1
    assert await snapshot(gj) == before


@only_postgresql
async def test_a_fenced_run_holds_the_lease_share_locked_until_its_commit(
        gj: Journal, committer: GroupCommitter, make_journal: Callable[..., Journal]) -> None:
    probe = make_journal()
    results = await asyncio.gather(committer.run(move_and_probe("s01", probe)),
                                   committer.run(move_and_probe("s02", probe)))
    assert list(results) == ["locked", "locked"]


@only_postgresql
async def test_a_rolled_back_run_leaves_the_lease_share_locked(
        gj: Journal, committer: GroupCommitter, make_journal: Callable[..., Journal]) -> None:
    probe = make_journal()

    async def fails(tx: WriteTx) -> None:
        await tx.transition(G, "s01", from_state="new", version=1, to_state="on", reason="run")
        raise RuntimeError("after writing")

    results = await asyncio.gather(committer.run(fails), committer.run(move_and_probe("s02", probe)),
                                   return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    assert results[1] == "locked"


def move_and_probe(entity_id: str, probe: Journal) -> Callable[[WriteTx], Any]:
    """A run that moves ``entity_id``, then asks another connection whether the lease row is locked."""
    async def fn(tx: WriteTx) -> str:
        await tx.transition(G, entity_id, from_state="new", version=1, to_state="on", reason="run")
        try:
            async with probe.engine.begin() as conn:
                await conn.execute(sa.text("SELECT 1 FROM leases WHERE name = 'leader' FOR UPDATE NOWAIT"))
        except sa.exc.DBAPIError as exc:
            assert "could not obtain lock" in str(exc), exc
            return "locked"
        return "free"
    return fn


async def test_context_apply_and_get_go_through_the_committer_and_the_group_reader(
        gj: Journal, committer: GroupCommitter) -> None:
    ctx = Context(gj, committer, VirtualClock())
    out = await asyncio.gather(ctx.apply(T("s00", "new", 1, "on", label="x")), ctx.apply(T("s01", "new", 9, "on")),
                               return_exceptions=True)
    assert out[0] == [Committed(G, "s00", "new", "on", 2)] and isinstance(out[1], StaleRow)
    got = await asyncio.gather(ctx.get(G, "s00"), ctx.get(G, "s01"), ctx.get(G, "nope"))
    assert got[0] is not None and (got[0].state, got[0].version, got[0]["label"]) == ("on", 2, "x")
    assert got[1] is not None and (got[1].state, got[1].version) == ("new", 1)
    assert got[2] is None


@pytest.mark.parametrize("stale_times, tries", [(0, 5), (2, 5), (4, 5), (5, 5), (1, 1)])
async def test_run_fresh_runs_a_compare_and_set_again_while_it_is_stale(
        gj: Journal, committer: GroupCommitter, stale_times: int, tries: int) -> None:
    # The fault is injected: the function writes, then reports the row stale (as a controller moving
    # the row between an operator's read and write would), ``stale_times`` times, then succeeds.
    calls: list[int] = []

    async def fn(tx: WriteTx) -> str:
        calls.append(len(calls))
        row_now = await tx.get(G, "s00")
        assert row_now is not None
        await tx.transition(G, "s00", from_state=row_now.state, version=row_now.version, to_state="on",
                            reason="operator", changes={"hits": len(calls)})
        if len(calls) <= stale_times:
            raise StaleRow(G, "s00", row_now.state, row_now.version, "on", row_now.version + 1)
        return row_now.state

    if stale_times >= tries:
        with pytest.raises(StaleRow):
            await committer.run_fresh(fn, tries=tries)
        assert len(calls) == tries
        assert await state_of(gj, "s00") == ("new", 1)  # every stale try was rolled back
        return
    assert await committer.run_fresh(fn, tries=tries) == "new"
    assert len(calls) == stale_times + 1
    assert await state_of(gj, "s00") == ("on", 2)
    assert (await row(gj, G, "s00"))["hits"] == stale_times + 1


async def test_run_fresh_needs_at_least_one_try(committer: GroupCommitter) -> None:
    async def fn(tx: WriteTx) -> None:
        raise AssertionError("not run")

    with pytest.raises(ValueError, match="tries must be at least 1, not 0"):
        await committer.run_fresh(fn, tries=0)
