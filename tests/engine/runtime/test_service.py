"""The orchestrator's own resilience: a loop that dies makes the leader step down and come back."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from journal import lease


async def test_a_dead_loop_steps_down_and_recovery_restarts_it(journal_url: str) -> None:
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"id": "orch-x", "lease_ttl_s": 1.0, "lease_renew_s": 0.2, "shutdown_grace_s": 1},
        "logging": {"level": "CRITICAL"}})
    orch = Orchestrator(settings)
    real_run = orch.dispatcher.run
    failures = [RuntimeError("injected: the dispatcher hits a bug once")]

    async def flaky_run() -> None:
        # Fault injection: the first dispatcher loop dies; later ones are the real thing.
        if failures:
            raise failures.pop()
        await real_run()

    orch.dispatcher.run = flaky_run  # type: ignore[method-assign]
    await orch.start()
    try:
        for _ in range(200):
            held = await lease.read_lease(orch.journal, "orchestrator")
            if held is not None and held.epoch == 2 and orch.is_leader and orch.working():
                break
            await asyncio.sleep(0.05)
        assert held is not None and held.epoch == 2, "the leader did not step down and come back"
        assert orch.is_leader and orch.working()
    finally:
        await orch.stop()


async def test_a_cancelled_submission_is_not_committed(journal_url: str) -> None:
    from engine.runtime.committer import GroupCommitter
    from journal import Journal

    journal = Journal.open(journal_url)
    held = await lease.acquire(journal, "orchestrator", "orch-y", 60)
    assert held is not None
    committer = GroupCommitter(journal, held.fence)
    ran: list[str] = []

    async def write(tx):  # type: ignore[no-untyped-def]
        ran.append("write")
        await tx.create("participants", "p1", reason="configured", values={"url": "http://h"})

    try:
        task = asyncio.create_task(committer.run(write))
        await asyncio.sleep(0)  # queued, not yet committed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async def nothing(tx):  # type: ignore[no-untyped-def]
            return "still committing"

        assert await committer.run(nothing) == "still committing"  # the loop goes on
        assert ran == []
        assert (await journal.fetch(sa.text("SELECT count(*) FROM participants"))).scalar() == 0
    finally:
        await committer.close()
        await journal.dispose()
