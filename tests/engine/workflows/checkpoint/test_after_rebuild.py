"""engine.workflows.checkpoint.after_rebuild: readiness waits for a rebuild's restore as the journal
has it, on both backends — for an orchestrator that took over while it runs too (it never asked for
it), and not for an operator's restore."""

from __future__ import annotations

from typing import Any

from engine.workflows.checkpoint.after_rebuild import REBUILD_PREFIX, AfterRebuild
from engine.workflows.checkpoint.restore import start_restore
from journal import Journal


def taken_over(journal: Journal) -> AfterRebuild:
    """The checkpoint family's part as built by an orchestrator that did not ask for any restore."""
    async def write(step: Any) -> Any:
        async with journal.write() as tx:
            return await step(tx)
    return AfterRebuild(write, journal.read, "/nonexistent")


async def move(journal: Journal, restore_id: str, *states: str) -> None:
    for to_state in states:
        async with journal.write() as tx:
            row = await tx.get("restores", restore_id)
            assert row is not None
            await tx.transition("restores", restore_id, from_state=row.state, version=row.version, to_state=to_state,
                                reason=f"moved by the test to {to_state}")


async def test_a_rebuilds_restore_holds_readiness_for_whoever_leads_until_it_ends(journal: Journal) -> None:
    after = taken_over(journal)
    assert after.restore_id is None and await after.held() is None
    async with journal.write() as tx:
        await start_restore(tx, "operator-restore", "/ckpts", "ck-0", [])
    assert await after.held() is None  # an operator's restore does not hold readiness
    async with journal.write() as tx:
        await start_restore(tx, f"{REBUILD_PREFIX}a", "/ckpts", "ck-1", [])
    assert await after.held() == (f"the participants are being restored from checkpoint ck-1 (restore "
                                  f"{REBUILD_PREFIX}a is restoring)")
    await move(journal, f"{REBUILD_PREFIX}a", "resuming")
    assert "is resuming" in (await after.held() or "")
    await move(journal, f"{REBUILD_PREFIX}a", "done")
    assert await after.held() is None
    # A failed one (rolled back) ends the wait too.
    async with journal.write() as tx:
        await start_restore(tx, f"{REBUILD_PREFIX}b", "/ckpts", "ck-2", [])
    assert f"{REBUILD_PREFIX}b is restoring" in (await after.held() or "")
    await move(journal, f"{REBUILD_PREFIX}b", "rolling_back", "failed")
    assert await after.held() is None
