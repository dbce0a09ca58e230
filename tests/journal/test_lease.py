"""The leader lease and fencing: one writer per epoch, take-over after a lapse, nothing from the past."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from journal import Fence, Journal, LeaseLost, lease, models
from tests.support.databases import migrate
from tests.support.backends import only_postgresql
from tests.support.journal_state import T0, FakeClock, events, row, snapshot

P = "participants"
TTL = 10.0


@pytest.fixture
def orchestrators(make_journal: Callable[..., Journal], clock: FakeClock) -> tuple[Journal, Journal]:
    """Two orchestrators on the same journal and the same (fake) clock."""
    return make_journal(clock=clock, actor="orch-a"), make_journal(clock=clock, actor="orch-b")


async def test_acquire_takes_epoch_one_and_logs_it(orchestrators: tuple[Journal, Journal]) -> None:
    a, _ = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    assert held is not None and re.fullmatch(r"[0-9a-f]{32}", held.lineage or "")
    assert held == lease.LeaseState("leader", "orch-a", 1, T0 + timedelta(seconds=TTL), held.lineage)
    assert held.fence() == Fence("leader", "orch-a", 1)
    assert await lease.read_lease(a, "leader") == held
    assert await lease.read_lease(a, "other") is None
    (ev,) = await events(a, "leases", "leader")
    assert (ev["to_state"], ev["reason"], ev["actor"], ev["epoch"]) == ("held", "acquired", "orch-a", None)
    assert ev["payload"] == {"note": {"holder": "orch-a", "epoch": 1, "lineage": held.lineage}}


async def test_renewal_keeps_the_epoch(orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, _ = orchestrators
    first = await lease.acquire(a, "leader", "orch-a", TTL)
    assert first is not None
    clock.advance(TTL - 1)
    renewed = await lease.renew(a, first.fence(), TTL)
    assert renewed.epoch == 1 and renewed.expires_at == clock.now + timedelta(seconds=TTL)
    assert await lease.read_lease(a, "leader") == renewed
    assert len(await events(a, "leases")) == 1  # renewals are not events


async def test_the_same_holder_name_never_inherits_a_live_epoch(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    """A restarted process with the same configured id waits for the lapse and takes epoch + 1."""
    a, b = orchestrators
    first = await lease.acquire(a, "leader", "orch-a", TTL)
    assert first is not None and first.epoch == 1
    assert await lease.acquire(b, "leader", "orch-a", TTL) is None
    clock.advance(TTL + 1)
    again = await lease.acquire(b, "leader", "orch-a", TTL)
    assert again is not None and again.epoch == 2
    with pytest.raises(LeaseLost):
        async with a.write(first.fence()) as tx:
            await tx.create(P, "p1", reason="old incarnation", values={"url": "u"})


async def test_another_holder_gets_none_while_the_lease_is_live(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, b = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    before = await snapshot(a)
    assert await lease.acquire(b, "leader", "orch-b", TTL) is None
    clock.advance(TTL - 0.000001)
    assert await lease.acquire(b, "leader", "orch-b", TTL) is None
    assert await snapshot(a) == before
    assert await lease.read_lease(b, "leader") == held


async def test_take_over_after_lapse_increments_the_epoch_and_logs_it(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, b = orchestrators
    first = await lease.acquire(a, "leader", "orch-a", TTL)
    assert first is not None
    clock.advance(TTL)  # expires_at <= now: lapsed
    taken = await lease.acquire(b, "leader", "orch-b", TTL)
    assert taken == lease.LeaseState("leader", "orch-b", 2, clock.now + timedelta(seconds=TTL), first.lineage)
    assert await lease.acquire(a, "leader", "orch-a", TTL) is None
    ev = (await events(b, "leases", "leader"))[-1]
    assert (ev["reason"], ev["actor"]) == ("taken over after lapse", "orch-b")
    assert ev["payload"]["note"] == {
        "holder": "orch-b", "epoch": 2, "previous_holder": "orch-a", "previous_epoch": 1,
        "previous_expired_at": (T0 + timedelta(seconds=TTL)).isoformat()}


async def test_a_lapsed_holder_taking_it_back_gets_a_new_epoch(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, _ = orchestrators
    await lease.acquire(a, "leader", "orch-a", TTL)
    clock.advance(TTL + 5)
    back = await lease.acquire(a, "leader", "orch-a", TTL)
    assert back is not None and back.epoch == 2


async def test_a_fenced_write_with_the_old_epoch_raises_lease_lost_and_writes_nothing(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, b = orchestrators
    old = await lease.acquire(a, "leader", "orch-a", TTL)
    assert old is not None
    async with a.write(old.fence()) as tx:
        await tx.create(P, "p1", reason="configured", values={"url": "u"})
    clock.advance(TTL + 1)
    new = await lease.acquire(b, "leader", "orch-b", TTL)
    assert new is not None and new.epoch == 2
    before = await snapshot(a)
    with pytest.raises(LeaseLost) as info:
        async with a.write(old.fence()) as tx:
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="late")
    assert (info.value.epoch, info.value.current_holder, info.value.current_epoch) == (1, "orch-b", 2)
    # The same holder name with the old epoch is refused too (a restarted process reusing its name).
    with pytest.raises(LeaseLost):
        async with a.write(Fence("leader", "orch-b", 1)) as tx:
            await tx.create(P, "p2", reason="late", values={"url": "u"})
    with pytest.raises(LeaseLost):
        await lease.renew(a, old.fence(), TTL)
    assert await snapshot(a) == before
    async with b.write(new.fence()) as tx:
        await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="new leader")
    found = await row(b, P, "p1")
    assert found is not None and found["state"] == "healthy"
    assert [(e["actor"], e["epoch"]) for e in await events(b, P)] == [("orch-a", 1), ("orch-b", 2)]


async def test_an_expired_lease_fences_even_before_anyone_takes_over(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, _ = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    assert held is not None
    clock.advance(TTL)
    before = await snapshot(a)
    with pytest.raises(LeaseLost, match="expired"):
        async with a.write(held.fence()) as tx:
            await tx.create(P, "p1", reason="too late", values={"url": "u"})
    with pytest.raises(LeaseLost, match="no lease row"):
        async with a.write(Fence("nobody-took-this", "orch-a", 1)) as tx:
            await tx.create(P, "p1", reason="x", values={"url": "u"})
    assert await snapshot(a) == before


async def test_release_lets_a_standby_take_over_at_once(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    a, b = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    assert held is not None
    assert await lease.acquire(b, "leader", "orch-b", TTL) is None
    assert await lease.release(a, held.fence()) is True
    taken = await lease.acquire(b, "leader", "orch-b", TTL)  # same instant: no waiting for the TTL
    assert taken is not None and taken.epoch == 2
    assert await lease.release(a, held.fence()) is False  # a stale fence cannot release the new lease
    assert (await lease.read_lease(b, "leader")) == taken
    assert [e["reason"] for e in await events(b, "leases")] == [
        "acquired", "released on shutdown", "taken over after lapse"]


async def test_concurrent_first_acquire_has_exactly_one_winner(make_journal: Callable[..., Journal]) -> None:
    journals = [make_journal(actor=f"orch-{i}") for i in range(4)]
    for j in journals:  # warm the pools so the candidates really overlap
        assert await lease.acquire(j, f"warm-{id(j)}", "x", TTL) is not None
    for attempt in range(10):
        name = f"leader-{attempt}"
        results = await asyncio.gather(*(lease.acquire(j, name, f"orch-{i}", TTL)
                                         for i, j in enumerate(journals)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1 and winners[0].epoch == 1, results
        assert await lease.read_lease(journals[0], name) == winners[0]


@only_postgresql
async def test_take_over_waits_for_a_fenced_write_already_under_way(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    """PostgreSQL: the fence check's share lock (taken with the first write) makes a take-over
    wait for the old epoch's transaction, so no write of epoch 1 can land after epoch 2 began."""
    a, b = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    assert held is not None
    async with a.write(held.fence()) as tx:
        await tx.create(P, "p1", reason="old epoch, in flight", values={"url": "u"})  # fence checked here
        clock.advance(TTL + 1)
        takeover = asyncio.create_task(lease.acquire(b, "leader", "orch-b", TTL))
        await _wait_until_blocked_on_a_lock(b)
        assert not takeover.done()
    taken = await asyncio.wait_for(takeover, 30)
    assert taken is not None and taken.epoch == 2
    order = [(e["entity_kind"], e["reason"]) for e in await events(b)]
    assert order == [("leases", "acquired"), (P, "old epoch, in flight"), ("leases", "taken over after lapse")]


@only_postgresql
async def test_a_write_after_the_take_over_is_refused(
        orchestrators: tuple[Journal, Journal], clock: FakeClock) -> None:
    """A fenced transaction that had not written yet when the lease was taken over writes nothing."""
    a, b = orchestrators
    held = await lease.acquire(a, "leader", "orch-a", TTL)
    assert held is not None
    async with a.write() as tx:
        await tx.create(P, "p1", reason="configured", values={"url": "u"})
    before = await events(b)
    with pytest.raises(LeaseLost):
        async with a.write(held.fence()) as tx:
            clock.advance(TTL + 1)
            taken = await lease.acquire(b, "leader", "orch-b", TTL)
            assert taken is not None and taken.epoch == 2
            await tx.transition(P, "p1", from_state="pending", version=1, to_state="healthy", reason="late")
    after = await events(b)
    assert [e["reason"] for e in after[len(before):]] == ["taken over after lapse"]


async def _wait_until_blocked_on_a_lock(journal: Journal) -> None:
    """Poll pg_stat_activity until some backend of this database waits on a lock (no timing assertion)."""
    query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'")
    for _ in range(3000):
        async with journal.read() as conn:
            if (await conn.execute(query)).scalar():
                return
        await asyncio.sleep(0.01)
    raise AssertionError("the take-over never waited for the lease row lock")


async def test_the_lineage_is_minted_once_per_journal_and_kept_by_every_leader(
        orchestrators: tuple[Journal, Journal], clock: FakeClock, make_journal: Callable[..., Journal]) -> None:
    """A journal's line of leaders has one lineage (sent beside the epoch, so a participant fences
    per journal); a take-over, a renewal and a reader all see the first leader's."""
    a, b = orchestrators
    first = await lease.acquire(a, "leader", "orch-a", TTL)
    assert first is not None and first.lineage is not None
    renewed = await lease.renew(a, first.fence(), TTL)
    assert renewed.lineage == first.lineage
    clock.advance(TTL + 1)
    taken = await lease.acquire(b, "leader", "orch-b", TTL)
    assert taken is not None and taken.epoch == 2 and taken.lineage == first.lineage
    assert (await lease.read_lease(a, "leader")) == taken
    # A row an older version wrote has none: the next take-over mints it, and it is kept from then on.
    async with a.engine.begin() as conn:
        await conn.execute(sa.update(models.leases).values(lineage=None))
    clock.advance(TTL + 1)
    minted = await lease.acquire(a, "leader", "orch-a", TTL)
    assert minted is not None and minted.lineage is not None and minted.lineage != first.lineage
    assert (await lease.read_lease(b, "leader")) == minted


async def test_two_journals_have_two_lineages(journal_url: str, tmp_path: Path, clock: FakeClock) -> None:
    """Even journals copied from one migrated template (as the PostgreSQL fixture makes them): the
    lineage is minted by each journal's first leader, not by the migration."""
    other_url = f"sqlite+aiosqlite:///{tmp_path / 'copy.db'}"
    if journal_url.startswith("sqlite"):
        shutil.copyfile(journal_url.removeprefix("sqlite+aiosqlite:///"), tmp_path / "copy.db")
    else:
        await asyncio.to_thread(migrate, other_url)
    one, two = Journal.open(journal_url, clock=clock), Journal.open(other_url, clock=clock)
    try:
        a = await lease.acquire(one, "leader", "orch-a", TTL)
        b = await lease.acquire(two, "leader", "orch-a", TTL)
        assert a is not None and b is not None and a.epoch == b.epoch == 1
        assert a.lineage != b.lineage
    finally:
        await one.dispose()
        await two.dispose()
