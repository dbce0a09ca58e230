"""The engines rows at election (issue 13, defect 12): ``sync_engines`` makes every live row
``unverified`` — claiming no version — in the write that syncs the rows with the configuration, and
the machine lets a row leave ``unverified`` only for what a look at the engine finds. Both journal
backends; the journal's own transition primitive throughout."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.training.engine_gate import NOT_YET_KNOWN, UNVERIFIED, sync_engines
from journal import IllegalTransition, Journal, audit, machines, models

KIND = "engines"


async def rows(journal: Journal) -> dict[str, dict[str, Any]]:
    t = models.engines
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(t))).all()}


async def event_count(journal: Journal) -> int:
    async with journal.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(models.events))).scalar() or 0)


def test_every_live_state_goes_unverified_and_only_a_look_leaves_it() -> None:
    m = machines.ENGINES
    assert UNVERIFIED in m.states and UNVERIFIED not in m.initial and UNVERIFIED not in m.terminal
    assert {s for s in m.states if UNVERIFIED in m.allowed(s)} == m.states - {"retired", UNVERIFIED}
    assert m.allowed(UNVERIFIED) == {"serving", "paused", "uncertain", "unreachable", "retired"}
    assert set(NOT_YET_KNOWN) == {"registered", UNVERIFIED}


async def test_an_election_makes_every_live_engine_row_unverified(journal: Journal) -> None:
    config = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2", "c": "http://127.0.0.1:3",
              "d": "http://127.0.0.1:4", "e": "http://127.0.0.1:5"}
    async with journal.write() as tx:
        assert sorted(await sync_engines(tx, "dep", config)) == [f"dep/{n}" for n in "abcde"]
        # Another deployment's rows are not this sync's to touch.
        await sync_engines(tx, "other", {"a": "http://127.0.0.1:9"})
    # What an earlier leader's gate recorded: a serving, b paused, c unreachable, d left registered.
    async with journal.write() as tx:
        await tx.transition(KIND, "dep/a", from_state="registered", version=1, to_state="serving", reason="t",
                            changes={"serving_version": "x:1", "health": "ok"})
        await tx.transition(KIND, "dep/b", from_state="registered", version=1, to_state="paused", reason="t",
                            changes={"serving_version": "x:1", "health": "ok", "paused": True})
        await tx.transition(KIND, "dep/c", from_state="registered", version=1, to_state="unreachable",
                            reason="t", changes={"health": "unreachable"})
        await tx.transition(KIND, "other/a", from_state="registered", version=1, to_state="serving", reason="t",
                            changes={"serving_version": "y:1", "health": "ok"})
    # The next election: e's URL changed, f is new, d was removed... and a, b, c, e stay configured.
    again = {"a": config["a"], "b": config["b"], "c": config["c"], "e": "http://127.0.0.1:55",
             "f": "http://127.0.0.1:6"}
    async with journal.write() as tx:
        touched = await sync_engines(tx, "dep", again)
    assert sorted(touched) == [f"dep/{n}" for n in "abcdef"]
    got = await rows(journal)
    for name, was in (("a", "serving, serving x:1, health ok"), ("b", "paused, serving x:1, health ok"),
                      ("c", "unreachable, serving nothing known, health unreachable")):
        r = got[f"dep/{name}"]
        assert (r["state"], r["serving_version"], r["health"]) == (UNVERIFIED, None, None), r
        assert r["detail"].endswith(f"recorded it {was}"), r["detail"]
    assert got["dep/b"]["paused"] is True  # the last value recorded; not a claim the reader may trust
    assert (got["dep/d"]["state"], got["dep/e"]["state"], got["dep/f"]["state"]) == ("retired", "registered",
                                                                                    "registered")
    assert got["dep/e"]["url"] == again["e"]
    assert (got["other/a"]["state"], got["other/a"]["serving_version"]) == ("serving", "y:1")
    # An election before the gate looked finds them unverified already: nothing to write for them.
    before = await event_count(journal)
    async with journal.write() as tx:
        touched = await sync_engines(tx, "dep", again)
    assert sorted(touched) == ["dep/e", "dep/f"]  # registered by the last election: now unverified
    assert await event_count(journal) == before + 2
    assert {r["state"] for i, r in (await rows(journal)).items() if i.startswith("dep/") and i != "dep/d"} == {
        UNVERIFIED}
    # Leaving unverified is the gate's look; it is never re-entered without one.
    with pytest.raises(IllegalTransition):
        async with journal.write() as tx:
            await tx.transition(KIND, "dep/a", from_state=UNVERIFIED, version=3, to_state=UNVERIFIED, reason="t")
    async with journal.write() as tx:
        await tx.transition(KIND, "dep/a", from_state=UNVERIFIED, version=3, to_state="serving",
                            reason="looked", changes={"serving_version": "x:1", "health": "ok"})
    assert await audit.verify(journal) == []
