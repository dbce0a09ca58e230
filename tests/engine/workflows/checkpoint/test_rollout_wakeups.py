"""The rollout controller's wake-ups cannot be lost (both backends, a real journal and lease fence).

A pending rollout that finds dispatch held (a restore open) waits in memory until a commit wakes it.
If that commit lands while the rollout is still looking (between its read and its parking), the wake
finds nothing parked; without a second look the rollout would sleep until the next resync (30 s by
default). The interleaving is injected here (the commit listener is called from inside the read, as
the event loop may run it there); a real run cannot be made to hit that instant on demand.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from engine.runtime.clock import SystemClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.reconciler import Context
from engine.workflows.checkpoint import rollouts as rollouts_module
from engine.workflows.checkpoint.rollouts import RolloutController, RolloutSettings
from journal import Committed, Journal, WriteTx, lease, models


@pytest.fixture
async def ctx(make_journal: Callable[..., Journal]) -> AsyncIterator[Context]:
    journal = make_journal(actor="orch-wakeups")
    held = await lease.acquire(journal, "leader", "orch-wakeups", 3600.0)
    assert held is not None
    fence = held.fence()
    committer = GroupCommitter(journal, lambda: fence)
    try:
        yield Context(journal, committer, SystemClock())
    finally:
        await committer.close()


async def test_a_wake_up_that_lands_while_a_rollout_looks_is_not_lost(
        ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    async def rows(tx: WriteTx) -> None:
        await tx.create("restores", "rs-1", reason="t", values={"checkpoint_id": "ck", "checkpoint_dir": "/x",
                                                               "scope": []})
        await tx.create("rollouts", "r1", reason="t", state="pending", values={"attempt": 0, "task": {"prompt": "p"}})
    await ctx.write(rows)
    controller = RolloutController()
    woken: list[str] = []
    controller.attach(lambda kind, entity_id: woken.append(entity_id))
    real = rollouts_module.open_workflow
    during: list[bool] = []

    async def restore_ends_meanwhile(conn: Any) -> str | None:
        held = await real(conn)  # the restore is open: dispatch is held ...
        if not during:  # ... and, once, the commit that ends it is heard before the row parks
            during.append(True)
            controller.on_commit([Committed("restores", "rs-1", "resuming", "done", 3)])
        return held
    monkeypatch.setattr(rollouts_module, "open_workflow", restore_ends_meanwhile)

    result = await controller.reconcile(ctx, "r1")
    assert woken == []  # the wake found nothing parked yet
    assert result.requeue_after == 0.0  # so the row looks again at once instead of sleeping
    assert "r1" not in controller._parked

    # A look with no commit in between parks it, and the next such commit wakes it.
    result = await controller.reconcile(ctx, "r1")
    assert result.requeue_after is None and "r1" in controller._parked
    controller.on_commit([Committed("restores", "rs-1", "resuming", "done", 3)])
    assert woken == ["r1"]


def _counted_reads(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``kind:id`` the controller reads through ``ctx.get`` from now on (the reads still happen)."""
    reads: list[str] = []
    real_get = ctx.get

    async def get(kind: str, entity_id: str) -> Any:
        reads.append(f"{kind}:{entity_id}")
        return await real_get(kind, entity_id)
    monkeypatch.setattr(ctx, "get", get)
    return reads


async def _fleet(ctx: Context, envs: int, pending: int) -> None:
    async def rows(tx: WriteTx) -> None:
        for e in range(envs):
            await tx.create("participants", f"env-{e}", reason="t",
                            values={"kind": "environment", "url": f"http://127.0.0.1:{9000 + e}"})
            await tx.transition("participants", f"env-{e}", from_state="pending", version=1, to_state="healthy",
                                reason="probed")
        for i in range(pending):
            await tx.create("rollouts", f"r{i}", reason="t", state="pending", values={"attempt": 0, "task": {"n": i}})
    await ctx.write(rows)


async def _states(ctx: Context) -> dict[str, tuple[str, str | None]]:
    async with ctx.journal.read() as conn:
        rows = (await conn.execute(sa.select(models.rollouts.c.id, models.rollouts.c.state,
                                             models.rollouts.c.environment))).all()
    return {r.id: (r.state, r.environment) for r in rows}


async def test_one_write_fills_every_free_slot_and_later_rows_park_without_reading(
        ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    await _fleet(ctx, envs=2, pending=10)
    controller = RolloutController(RolloutSettings(max_in_flight=6, per_environment=4))
    controller.attach(lambda kind, entity_id: None)
    commits: list[list[Committed]] = []
    ctx.journal.add_commit_listener(lambda committed: commits.append(list(committed)))
    await controller.reconcile(ctx, "r5")

    states = await _states(ctx)
    sent = sorted(i for i, (state, _) in states.items() if state == "dispatched")
    assert len(sent) == 6 and "r5" in sent  # the row that looked, and the five oldest others
    assert sorted(env for state, env in states.values() if state == "dispatched") == ["env-0"] * 3 + ["env-1"] * 3
    moves = [c for batch in commits for c in batch if c.kind == "rollouts" and c.to_state == "dispatched"]
    assert len(moves) == 6 and len(commits) == 1  # all six in one commit
    async with ctx.journal.read() as conn:
        runs = (await conn.execute(sa.select(models.rpc_calls.c.path, models.rpc_calls.c.entity_id))).all()
    assert sorted(r.entity_id for r in runs) == sent and {r.path for r in runs} == {"/run"}

    looks: list[int] = []
    real = rollouts_module.open_workflow

    async def counted(conn: Any) -> str | None:
        looks.append(1)
        return await real(conn)
    monkeypatch.setattr(rollouts_module, "open_workflow", counted)
    controller.on_commit(moves)  # the dispatch commit, as the reconciler hands it on
    first = await controller.reconcile(ctx, "r9")
    assert "r9" in controller._parked and first.requeue_after is None and len(looks) == 1
    await controller.reconcile(ctx, "r8")  # every slot is taken and no commit freed one: no read
    assert "r8" in controller._parked and len(looks) == 1

    # A lost lease forgets all of it: the next term looks afresh.
    await controller.lost()
    assert not controller._parked and controller._full_at is None
    await controller.reconcile(ctx, "r8")
    assert len(looks) == 2


async def test_the_look_a_dispatch_commit_causes_is_skipped_but_the_reply_is_read(
        ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    await _fleet(ctx, envs=1, pending=1)
    controller = RolloutController()
    controller.attach(lambda kind, entity_id: None)
    commits: list[Committed] = []
    ctx.journal.add_commit_listener(commits.extend)
    await controller.reconcile(ctx, "r0")
    controller.on_commit(commits)
    reads = _counted_reads(ctx, monkeypatch)
    await controller.reconcile(ctx, "r0")  # caused by its own dispatch: the /run is not even sent
    assert reads == []
    assert controller.waiting("r0") is False  # the /run settled: the reply's look must read
    await controller.reconcile(ctx, "r0")
    assert reads[0] == "rollouts:r0" and reads[1].startswith("rpc_calls:")


async def test_a_rollout_done_while_a_forget_batch_is_open_waits_for_the_next_without_a_look(
        ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    async def rows(tx: WriteTx) -> None:
        for i in range(2):
            await tx.create("rollouts", f"r{i}", reason="t", state="pending", values={"attempt": 0, "task": {"n": i}})
            await tx.transition("rollouts", f"r{i}", from_state="pending", version=1, to_state="dispatched", reason="t")
        await tx.transition("rollouts", "r0", from_state="dispatched", version=2, to_state="finished", reason="t")
    await ctx.write(rows)
    controller = RolloutController()
    woken: list[str] = []
    controller.attach(lambda kind, entity_id: woken.append(entity_id))
    await controller.reconcile(ctx, "r0")  # asks for the forget of r0: a batch is now open
    async with ctx.journal.read() as conn:
        batch = (await conn.execute(sa.select(models.retirements.c.id))).scalar_one()

    async def r1_finishes(tx: WriteTx) -> None:
        await tx.transition("rollouts", "r1", from_state="dispatched", version=2, to_state="finished", reason="t")
    await ctx.write(r1_finishes)
    controller.on_commit([Committed("rollouts", "r1", "dispatched", "finished", 3)])
    reads = _counted_reads(ctx, monkeypatch)
    await controller.reconcile(ctx, "r1")
    assert reads == [] and "r1" in controller._done  # it waits for the next batch, unread

    controller.on_commit([Committed("retirements", batch, "forgetting", "done", 5)])
    assert woken == ["r1"]  # the batch's end wakes it, and that look reads the row again
    await controller.reconcile(ctx, "r1")
    # (The batch's end was only announced here, so the journal still holds it open: r1 waits again.)
    assert reads == ["rollouts:r1"] and "r1" in controller._done


async def _dispatched_on(ctx: Context, env: str, ids: list[str]) -> None:
    async def rows(tx: WriteTx) -> None:
        for rid in ids:
            await tx.create("rollouts", rid, reason="t", state="pending", values={"attempt": 0, "task": {"id": rid}})
            await tx.transition("rollouts", rid, from_state="pending", version=1, to_state="dispatched",
                                reason="t", changes={"environment": env})
    await ctx.write(rows)


async def test_a_cooling_environment_bounds_the_wait_of_a_row_that_finds_the_others_full(ctx: Context) -> None:
    # env-0 is full and env-1 refused an attempt a moment ago: the row may go to env-1 once its
    # cooldown ends, which no commit announces, so it must look again then (not park until a slot frees).
    await _fleet(ctx, envs=2, pending=1)
    await _dispatched_on(ctx, "env-0", ["busy-0", "busy-1"])
    controller = RolloutController(RolloutSettings(max_in_flight=10, per_environment=2))
    controller.attach(lambda kind, entity_id: None)
    controller._cooling["env-1"] = ctx.clock.time() + 2.0
    result = await controller.reconcile(ctx, "r0")
    assert result.requeue_after is not None and 0 < result.requeue_after <= 2.0
    assert controller._full_at is None  # not remembered as "full until a commit frees a slot"


async def test_a_round_does_not_take_its_own_row_once_a_restore_pinned_it_meanwhile(ctx: Context) -> None:
    await _fleet(ctx, envs=2, pending=2)
    controller = RolloutController()
    controller.attach(lambda kind, entity_id: None)
    stale = await ctx.get("rollouts", "r0")
    assert stale is not None

    async def pin(tx: WriteTx) -> None:  # a restore's end, committed between the row's read and its round
        await tx.transition("rollouts", "r0", from_state="pending", version=stale.version, to_state="pending",
                            reason="restored", changes={"restored_on": "env-1", "attempt": 1})
    await ctx.write(pin)
    await controller._dispatch(ctx, stale)
    states = await _states(ctx)
    assert states["r0"] == ("pending", None)  # left for its own look, pinned to env-1
    assert states["r1"][0] == "dispatched"  # the round still filled a slot with another row


async def test_a_wake_up_that_finds_its_row_dispatched_is_passed_on(ctx: Context) -> None:
    await _fleet(ctx, envs=1, pending=1)
    await _dispatched_on(ctx, "env-0", ["gone"])
    controller = RolloutController()
    woken: list[str] = []
    controller.attach(lambda kind, entity_id: woken.append(entity_id))
    controller._parked.update({"gone": None, "r0": None})  # "gone" parked, then another round sent it
    controller._wake(1, controller._parked)
    assert woken == ["gone"]
    await controller.reconcile(ctx, "gone")
    assert woken == ["gone", "r0"]  # the slot's wake-up went on to a row that still waits
