"""The checkpoint family on virtual time: the deadlines a checkpoint writes into its row and sends to
its participants, the wait bounds it computes from them, and the ids the API mints all come from
the injectable clock (``Context.clock`` / ``orch.clock``), never from the wall clock.

The virtual clock starts on 2030-01-01, years away from now, so a deadline read from the wall clock
could not pass for one read from the virtual clock. A real journal on both backends, a real lease
fence and a real group committer; no dispatcher is attached, so the calls stay in the journal.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from engine.http.shell import new_id
from engine.runtime.clock import VirtualClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.reconciler import Context
from engine.workflows.checkpoint.checkpoint import (
    CALL_MARGIN_S,
    CheckpointController,
    CheckpointTimeouts,
    start_checkpoint,
)
from journal import Journal, WriteTx, lease, models
from journal.writes import Row

START = datetime(2030, 1, 1, tzinfo=timezone.utc)
PREPARE_S = 30.0


@pytest.fixture
async def ctx(make_journal: Callable[..., Journal]) -> AsyncIterator[Context]:
    clock = VirtualClock(START)
    journal = make_journal(clock=clock.now, actor="orch-virtual")
    held = await lease.acquire(journal, "leader", "orch-virtual", 3600.0)
    assert held is not None
    fence = held.fence()
    committer = GroupCommitter(journal, lambda: fence)
    try:
        yield Context(journal, committer, clock)
    finally:
        await committer.close()


def test_virtual_time_is_the_start_plus_the_offset() -> None:
    clock = VirtualClock(START)
    assert clock.time() == START.timestamp()
    assert clock.now().timestamp() == clock.time()


async def test_the_clock_moves_time_only_on_advance() -> None:
    clock = VirtualClock(START)
    await clock.advance(12.5)
    assert clock.time() == START.timestamp() + 12.5


def test_an_id_is_minted_from_the_given_time() -> None:
    cid = new_id("ck", VirtualClock(START).now())
    assert cid.startswith("ck-20300101T000000Z-") and len(cid) == len("ck-20300101T000000Z-") + 4


async def test_a_checkpoint_deadline_comes_from_the_virtual_clock(ctx: Context) -> None:
    clock = ctx.clock
    assert isinstance(clock, VirtualClock)
    participants = [Row("participants", f"p-{kind}", "healthy", 1, {"kind": kind, "url": f"http://127.0.0.1:9/{kind}"})
                    for kind in ("environment", "model")]

    async def start(tx: WriteTx) -> None:
        await start_checkpoint(tx, "ck-v", "/nonexistent/ckpts", participants)
    await ctx.write(start)
    await clock.advance(7.0)  # the deadline is set at the first reconcile, not at creation

    controller = CheckpointController(CheckpointTimeouts(prepare_timeout_s=PREPARE_S))
    assert (await controller.reconcile(ctx, "ck-v")).requeue_after is None
    now = clock.time()
    assert now == START.timestamp() + 7.0
    row = await ctx.get("checkpoints", "ck-v")
    assert row is not None and row.state == "preparing" and row["stage"] == 0
    assert row["deadline_ts"] == now + PREPARE_S

    # The stage's call carries that deadline, and its timeout is measured on the same clock.
    t = models.rpc_calls
    async with ctx.journal.read() as conn:
        calls = [dict(r._mapping) for r in (await conn.execute(
            sa.select(t).where(t.c.entity_kind == "checkpoints", t.c.entity_id == "ck-v"))).all()]
    assert [c["target"] for c in calls] == ["http://127.0.0.1:9/environment"]
    call: dict[str, Any] = calls[0]
    assert call["timeout_s"] == pytest.approx(PREPARE_S + CALL_MARGIN_S)
    async with ctx.journal.read() as conn:
        content = (await conn.execute(sa.select(models.rpc_bodies.c.content)
                                      .where(models.rpc_bodies.c.id == call["body_id"]))).scalar_one()
    assert json.loads(content) == {"checkpoint_id": "ck-v", "deadline_ts": now + PREPARE_S}

    # Still open, before its deadline on the virtual clock: the controller waits for it, and
    # looks again once the call must have settled, measured on the virtual clock.
    await clock.advance(10.0)
    assert controller.waiting("ck-v")
    wait = (await controller.reconcile(ctx, "ck-v")).requeue_after
    assert wait == pytest.approx(PREPARE_S - 10.0 + CALL_MARGIN_S + 1.0)
    # Past the deadline plus the margin on the virtual clock, it no longer waits.
    await clock.advance(PREPARE_S - 10.0 + CALL_MARGIN_S)
    assert not controller.waiting("ck-v")
