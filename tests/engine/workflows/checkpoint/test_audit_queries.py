"""docs/audit.md's "Did any commit include an attempt retired before it?" query, on journals built
row by row (both backends): it names a checkpoint whose scope was recorded after a retire of one of
its attempts finished, and nothing when the retire finished later or a forget came in between."""

from __future__ import annotations

from typing import Any

from engine.workflows.checkpoint.retirement import request_retirement
from journal import Journal
from tests.support.workflows import audit_rows
from workers.protocol import EpisodeId

QUERY = "commits-including-retired-attempts"


class Rows:
    """Rows moved through their machines' edges with ``tx.create`` / ``tx.transition``."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.at: dict[tuple[str, str], tuple[str, int]] = {}

    async def create(self, kind: str, entity_id: str, state: str, values: dict[str, Any]) -> None:
        async with self.journal.write() as tx:
            await tx.create(kind, entity_id, reason="test", values=values)
        self.at[(kind, entity_id)] = (state, 1)

    async def move(self, kind: str, entity_id: str, *to_states: str, **changes: Any) -> None:
        for to_state in to_states:
            state, version = self.at[(kind, entity_id)]
            async with self.journal.write() as tx:
                await tx.transition(kind, entity_id, from_state=state, version=version, to_state=to_state,
                                    reason="test", changes=changes)
            self.at[(kind, entity_id)] = (to_state, version + 1)

    async def checkpoint(self, checkpoint_id: str) -> None:
        """A checkpoint up to ``committing``, its scope not recorded yet."""
        await self.create("checkpoints", checkpoint_id, "preparing", {"checkpoint_dir": "/ckpts"})
        await self.move("checkpoints", checkpoint_id, "prepared", "committing")

    async def scope(self, checkpoint_id: str, keys: list[str]) -> None:
        """The environment's commit fixed the scope (``committing -> committing``); then published and done."""
        await self.move("checkpoints", checkpoint_id, "committing", scope=keys, restarts=[])
        await self.move("checkpoints", checkpoint_id, "committed", "published", "resuming", "done")

    async def request(self, retirement_id: str, *, episodes: list[EpisodeId] | None = None,
                      forget: list[str] | None = None) -> None:
        async with self.journal.write() as tx:
            if forget is None:
                await request_retirement(tx, retirement_id, "retire", episodes=episodes or [])
            else:
                await request_retirement(tx, retirement_id, "forget", rollout_ids=forget)
        self.at[("retirements", retirement_id)] = ("queued", 1)


async def test_a_scope_recorded_after_a_retire_finished_that_holds_its_attempts_is_named(journal: Journal) -> None:
    rows = Rows(journal)
    await rows.request("rt-1", episodes=[EpisodeId(rollout_id="r1", attempt=1), EpisodeId(rollout_id="q")])
    await rows.move("retirements", "rt-1", "running", "done")
    await rows.checkpoint("ck-1")
    # r1 and r1-a1 were retired (attempt 1 and every earlier one) and q (attempt 0); r1-a2 was not,
    # nor r10, r1-abc or q-a1 (other rollouts, or a later attempt).
    await rows.scope("ck-1", ["q", "q-a1", "r0", "r1", "r1-a1", "r1-a2", "r10", "r1-abc"])
    found = await audit_rows(journal, QUERY)
    assert [(r["checkpoint_id"], r["capture_key"], r["retirement_id"]) for r in found] == [
        ("ck-1", "q", "rt-1"), ("ck-1", "r1", "rt-1"), ("ck-1", "r1-a1", "rt-1")]
    assert all(r["state"] == "done" and r["retired_seq"] < r["scope_seq"] for r in found)
    assert {(r["rollout_id"], r["retired_up_to"]) for r in found} == {("q", 0), ("r1", 1)}


async def test_a_retire_that_finished_after_the_scope_or_was_forgotten_before_it_is_not_named(
        journal: Journal) -> None:
    rows = Rows(journal)
    # Requested and running before the scope was recorded, done only after: not a violation.
    await rows.request("rt-1", episodes=[EpisodeId(rollout_id="r1", attempt=2)])
    await rows.move("retirements", "rt-1", "running")
    await rows.checkpoint("ck-1")
    await rows.scope("ck-1", ["r1", "r1-a2"])
    await rows.move("retirements", "rt-1", "done")
    # Retired, then forgotten: a checkpoint after the forget may hold the rollout again.
    await rows.request("rt-2", episodes=[EpisodeId(rollout_id="r2")])
    await rows.move("retirements", "rt-2", "running", "done")
    await rows.request("fg-2", forget=["r2"])
    await rows.move("retirements", "fg-2", "running", "done")
    # A failed retire retired nothing it reports.
    await rows.request("rt-3", episodes=[EpisodeId(rollout_id="r3")])
    await rows.move("retirements", "rt-3", "running", "failed")
    await rows.checkpoint("ck-2")
    await rows.scope("ck-2", ["r2", "r3"])
    assert await audit_rows(journal, QUERY) == []
    # The same journal does answer once a later checkpoint holds an attempt retired before it.
    await rows.checkpoint("ck-3")
    await rows.scope("ck-3", ["r1-a1", "r1-a3"])
    found = await audit_rows(journal, QUERY)
    assert [(r["checkpoint_id"], r["capture_key"], r["retirement_id"]) for r in found] == [("ck-3", "r1-a1", "rt-1")]
