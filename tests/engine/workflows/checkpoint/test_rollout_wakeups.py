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

from engine.runtime.clock import SystemClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.reconciler import Context
from engine.workflows.checkpoint import rollouts as rollouts_module
from engine.workflows.checkpoint.rollouts import RolloutController
from journal import Committed, Journal, WriteTx, lease


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
