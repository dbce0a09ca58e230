"""The outbox of RPC intents: deterministic ids, claiming, settling, recovery after a crash."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta

import pytest

from journal import IllegalTransition, Journal, StaleRow, audit, outbox
from journal.outbox import Intent
from tests.support.backends import only_postgresql
from tests.support.journal_state import T0, FakeClock, events, row, snapshot

K = "rpc_calls"
BASE = Intent("participants", "p1", "healthy", 3, "http://p1:9000", "POST", "/ng-control/v1/checkpoint",
              body={"episode": 7, "keys": ["b", "a"]})


@pytest.fixture
def journal(make_journal: Callable[..., Journal], clock: FakeClock) -> Journal:
    return make_journal(clock=clock)


async def ensure(journal: Journal, *intents: Intent) -> list[str]:
    async with journal.write() as tx:
        return [await outbox.ensure(tx, i, reason="decided") for i in intents]


async def claim(journal: Journal, limit: int = 10) -> list[outbox.Row]:
    async with journal.write() as tx:
        return await outbox.claim_due(tx, limit=limit)


async def test_ensure_is_idempotent(journal: Journal) -> None:
    (first,) = await ensure(journal, BASE)
    before = await snapshot(journal)
    # The same decision again (another reconcile pass, or a restarted orchestrator) is the same intent,
    # even with a different body or settings: the id is what it does, decided where.
    (second,) = await ensure(journal, dataclasses.replace(BASE, body={"other": 1}, timeout_s=99.0))
    (third,) = await ensure(journal, dataclasses.replace(BASE, method="post"))
    assert first == second == third == BASE.id
    assert await snapshot(journal) == before
    found = await row(journal, K, first)
    assert found is not None
    assert (found["state"], found["version"], found["attempts"], found["method"]) == ("pending", 1, 0, "POST")
    assert (found["entity_kind"], found["entity_id"], found["body"]) == ("participants", "p1", BASE.body)
    assert found["next_attempt_at"] == T0
    assert len(await events(journal, K, first)) == 1


async def test_id_differs_with_what_the_call_does(journal: Journal) -> None:
    variants = [dataclasses.replace(BASE, **{name: value}) for name, value in [
        ("owner_kind", "trainers"), ("owner_id", "p2"), ("owner_state", "unreachable"), ("owner_version", 4),
        ("target", "http://p1:9001"), ("method", "PUT"), ("path", "/ng-control/v1/restore")]]
    ids = await ensure(journal, BASE, *variants)
    assert len(set(ids)) == len(ids) == 8
    assert ids == [BASE.id] + [v.id for v in variants]
    assert len(await events(journal, K)) == 8


def test_id_is_a_stable_function_of_the_decision() -> None:
    assert BASE.id == outbox.intent_id("participants", "p1", "healthy", 3, "http://p1:9000", "post",
                                       "/ng-control/v1/checkpoint")
    assert len(BASE.id) == 64 and int(BASE.id, 16) >= 0
    # Field boundaries are unambiguous: moving text between fields changes the id.
    assert outbox.intent_id("a", "bc", "s", 1, "t", "GET", "/") != outbox.intent_id("ab", "c", "s", 1, "t", "GET", "/")


async def test_for_row_owns_the_intent_at_the_rows_state_and_version(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create("participants", "p1", reason="configured", values={"url": "http://p1"})
        current = await tx.get("participants", "p1")
        assert current is not None
        intent = Intent.for_row(current, target="http://p1", method="GET", path="/health")
    assert (intent.owner_kind, intent.owner_id, intent.owner_state, intent.owner_version) == (
        "participants", "p1", "pending", 1)


async def test_ensure_refuses_nonsense_settings(journal: Journal) -> None:
    before = await snapshot(journal)
    for bad in ({"timeout_s": 0}, {"timeout_s": -1.0}, {"max_attempts": 0}):
        with pytest.raises(ValueError):
            await ensure(journal, dataclasses.replace(BASE, **bad))  # type: ignore[arg-type]
    assert await snapshot(journal) == before


async def test_claim_due_moves_pending_to_inflight_and_counts_attempts(journal: Journal) -> None:
    ids = await ensure(journal, *(dataclasses.replace(BASE, path=f"/c/{i}") for i in range(5)))
    claimed = await claim(journal, limit=3)
    assert len(claimed) == 3
    for call in claimed:
        assert (call.state, call.version, call["attempts"]) == ("inflight", 2, 1)
        stored = await row(journal, K, call.id)
        assert stored is not None and (stored["state"], stored["version"], stored["attempts"]) == ("inflight", 2, 1)
    rest = await claim(journal, limit=10)
    assert len(rest) == 2 and {c.id for c in claimed} | {c.id for c in rest} == set(ids)
    assert await claim(journal) == []
    reasons = [e["reason"] for e in await events(journal, K) if e["to_state"] == "inflight"]
    assert reasons == ["attempt 1 of 5"] * 5
    assert await audit.verify(journal) == []


async def test_claim_due_respects_next_attempt_at(journal: Journal, clock: FakeClock) -> None:
    (now_id, later_id) = await ensure(journal, BASE, dataclasses.replace(BASE, path="/later"))
    (first, second) = await claim(journal)
    async with journal.write() as tx:
        await outbox.retry_later(tx, first, {"error": "connection reset"}, at=clock.now + timedelta(seconds=30))
        await outbox.retry_later(tx, second, {"error": "timeout"}, at=clock.now + timedelta(seconds=60))
        assert await outbox.next_due(tx) == clock.now + timedelta(seconds=30)
    async with journal.read() as conn:
        assert await outbox.next_due(conn) == clock.now + timedelta(seconds=30)
    assert await claim(journal) == []
    clock.advance(30)
    (due,) = await claim(journal)
    assert due.id == first.id and due["attempts"] == 2
    clock.advance(29.999999)
    assert await claim(journal) == []
    clock.advance(0.000001)
    (last,) = await claim(journal)
    assert last.id == second.id
    async with journal.write() as tx:
        assert await outbox.next_due(tx) is None


async def test_claim_due_takes_the_earliest_due_first(journal: Journal, clock: FakeClock) -> None:
    ids = await ensure(journal, *(dataclasses.replace(BASE, path=f"/c/{i}") for i in range(3)))
    calls = {c.id: c for c in await claim(journal)}
    async with journal.write() as tx:
        for offset, call_id in zip([3, 1, 2], ids):
            await outbox.retry_later(tx, calls[call_id], {"e": 1}, at=clock.now + timedelta(seconds=offset))
    clock.advance(5)
    assert [c.id for c in await claim(journal, limit=2)] == [ids[1], ids[2]]


async def test_succeed_fail_and_retry_later(journal: Journal, clock: FakeClock) -> None:
    ids = await ensure(journal, *(dataclasses.replace(BASE, path=f"/c/{i}") for i in range(4)))
    calls = {c.id: c for c in await claim(journal)}
    async with journal.write() as tx:
        await outbox.succeed(tx, calls[ids[0]], {"saved": True, "bytes": 2**40})
        await outbox.fail(tx, calls[ids[1]], {"code": "E_INCOMPATIBLE", "status": 409}, reason="typed protocol error")
        await outbox.retry_later(tx, calls[ids[2]], {"error": "connection refused"}, at=clock.now + timedelta(seconds=1))
    done, failed, retry = [await row(journal, K, i) for i in ids[:3]]
    assert done is not None and (done["state"], done["result"], done["error"]) == (
        "succeeded", {"saved": True, "bytes": 2**40}, None)
    assert failed is not None and (failed["state"], failed["error"]) == (
        "failed", {"code": "E_INCOMPATIBLE", "status": 409})
    assert retry is not None and (retry["state"], retry["attempts"], retry["error"]) == (
        "pending", 1, {"error": "connection refused"})
    assert retry["next_attempt_at"] == clock.now + timedelta(seconds=1)
    # A pending call can be given up without being sent; a settled one cannot move again.
    async with journal.write() as tx:
        await outbox.fail(tx, outbox.Row(K, ids[2], "pending", 3, {}), {"error": "gave up"}, reason="cancelled")
    with pytest.raises(IllegalTransition):
        async with journal.write() as tx:
            await outbox.succeed(tx, outbox.Row(K, ids[0], "succeeded", 3, {}), {})
    # A stale copy of a claimed call (another dispatcher settled it) is refused.
    with pytest.raises(StaleRow):
        async with journal.write() as tx:
            await outbox.succeed(tx, calls[ids[1]], {"late": True})
    assert await audit.verify(journal) == []


async def test_backoff_doubles_up_to_the_cap() -> None:
    assert [outbox.backoff(n, base_s=0.5, cap_s=5).total_seconds() for n in range(0, 7)] == [
        0.5, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


async def test_recover_inflight_resends_repeatable_calls_and_flags_the_others(
        journal: Journal, clock: FakeClock) -> None:
    probe = BASE
    step = dataclasses.replace(BASE, path="/train/step", repeatable=False, pool="data")
    waiting = dataclasses.replace(BASE, path="/waiting")
    settled = dataclasses.replace(BASE, path="/settled")
    await ensure(journal, probe, step, settled)
    calls = {c.id: c for c in await claim(journal)}
    async with journal.write() as tx:
        await outbox.succeed(tx, calls[settled.id], {"ok": True})
    await ensure(journal, waiting)
    clock.advance(60)  # the dispatcher died; a new leader starts
    async with journal.write() as tx:
        recovered = {r.id: r for r in await outbox.recover_inflight(tx)}
    assert set(recovered) == {probe.id, step.id}
    assert (recovered[probe.id].state, recovered[step.id].state) == ("pending", "ambiguous")
    found_probe, found_step, found_waiting, found_settled = [
        await row(journal, K, i.id) for i in (probe, step, waiting, settled)]
    assert found_probe is not None and (found_probe["state"], found_probe["version"]) == ("pending", 3)
    assert found_probe["next_attempt_at"] == clock.now and found_probe["attempts"] == 1
    assert found_step is not None and (found_step["state"], found_step["version"]) == ("ambiguous", 3)
    assert found_waiting is not None and found_waiting["state"] == "pending"
    assert found_settled is not None and found_settled["state"] == "succeeded"
    # The repeatable call is claimed again under the same id (the idempotency key); the other never is.
    again = await claim(journal)
    assert {c.id for c in again} == {probe.id, waiting.id}
    assert {c.id: c["attempts"] for c in again}[probe.id] == 2
    # An ambiguous call is settled from evidence, never re-sent.
    async with journal.write() as tx:
        current = await outbox.get(tx, step.id)
        assert current is not None and current.state == "ambiguous"
        await outbox.succeed(tx, current, {"evidence": "checkpoint step 12 present"})
    async with journal.write() as tx:
        assert await outbox.recover_inflight(tx) != []  # the re-claimed ones, again
    assert await audit.verify(journal) == []


@only_postgresql
async def test_a_claimer_skips_intents_another_claimer_holds(make_journal: Callable[..., Journal]) -> None:
    first, second = make_journal(), make_journal()
    ids = set(await ensure(first, *(dataclasses.replace(BASE, path=f"/c/{i}") for i in range(10))))
    async with first.write() as tx:
        held = await outbox.claim_due(tx, limit=4)  # locks its four rows until this transaction ends
        # Without SKIP LOCKED the second claimer would wait for this transaction: wait_for turns a hang
        # into a failure.
        other = await asyncio.wait_for(claim(second, limit=10), 30)
    assert len(held) == 4 and len(other) == 6
    assert {c.id for c in held} | {c.id for c in other} == ids
    assert not {c.id for c in held} & {c.id for c in other}


@only_postgresql
async def test_concurrent_claimers_never_claim_the_same_intent(make_journal: Callable[..., Journal]) -> None:
    claimers = [make_journal() for _ in range(4)]
    ids = set(await ensure(claimers[0], *(dataclasses.replace(BASE, path=f"/c/{i}") for i in range(60))))
    got: list[list[str]] = [[] for _ in claimers]

    async def drain(index: int) -> None:
        while True:
            batch = await claim(claimers[index], limit=3)
            if not batch:
                return
            got[index].extend(c.id for c in batch)

    await asyncio.wait_for(asyncio.gather(*(drain(i) for i in range(len(claimers)))), 60)
    everything = [i for batch in got for i in batch]
    assert sorted(everything) == sorted(ids)  # each intent claimed exactly once
    for call_id in ids:
        found = await row(claimers[0], K, call_id)
        assert found is not None and (found["state"], found["attempts"]) == ("inflight", 1)
    assert await audit.verify(claimers[0]) == []
