"""``journal.readiness.deployment_held`` on both backends: no stack never holds; a declared service
that is not ready holds; a removed one does not; an engine service whose engine is not yet gated holds
dispatch but not the start of a publication; ``participants_held`` (a restore's first look) also
waits for a participant the stack serves to be probed healthy again, and ignores the others."""

from __future__ import annotations

from collections.abc import Callable

from journal import Journal, lease
from journal.readiness import deployment_held, participants_held
from tests.support.journal_state import FakeClock


async def _service(journal: Journal, name: str, state: str, *, engine: str | None = None,
                   desired: str = "up", endpoint: str | None = None) -> None:
    async with journal.write() as tx:
        await tx.create("services", name, reason="test", values={"engine": engine, "desired": desired,
                                                                 "endpoint": endpoint})
        path = {"pending": [], "starting": ["starting"], "ready": ["starting", "ready"],
                "stopped": ["stopped"]}[state]
        row = await tx.get("services", name)
        assert row is not None
        version, current = row.version, row.state
        for step in path:
            await tx.transition("services", name, from_state=current, version=version, to_state=step, reason="test")
            version, current = version + 1, step


async def _held(journal: Journal, **kw: bool) -> str | None:
    async with journal.read() as conn:
        return await deployment_held(conn, **kw)


async def test_what_holds_the_deployment(journal: Journal) -> None:
    assert await _held(journal) is None  # no stack declared
    await _service(journal, "a", "ready")
    assert await _held(journal) is None
    await _service(journal, "old", "stopped", desired="removed")
    assert await _held(journal) is None  # no longer declared: kept for its history only
    await _service(journal, "b", "starting")
    assert await _held(journal) == "the deployment is not ready (service b is starting)"


async def test_an_engine_not_yet_gated_holds_dispatch_but_not_a_publication(journal: Journal) -> None:
    async with journal.write() as tx:
        await tx.create("engines", "dep/e0", reason="configured", values={"deployment": "dep", "url": "http://e"})
    await _service(journal, "e0", "ready", engine="dep/e0")
    said = "the deployment is not ready (the engine of service e0 is registered: not yet on the committed head)"
    assert await _held(journal) == said
    assert await _held(journal, engines=False) is None
    async with journal.write() as tx:
        row = await tx.get("engines", "dep/e0")
        assert row is not None
        await tx.transition("engines", "dep/e0", from_state="registered", version=row.version, to_state="serving",
                            reason="gated", changes={"serving_version": "v"})
    assert await _held(journal) is None


async def _participant(journal: Journal, name: str, url: str, state: str) -> None:
    async with journal.write() as tx:
        row = await tx.get("participants", name)
        if row is None:
            await tx.create("participants", name, reason="configured", values={"url": url, "kind": "environment"})
            row = await tx.get("participants", name)
        assert row is not None
        if state != row.state:
            await tx.transition("participants", name, from_state=row.state, version=row.version, to_state=state,
                                reason="test")


async def _restore_held(journal: Journal) -> str | None:
    async with journal.read() as conn:
        return await participants_held(conn)


async def test_a_restore_waits_for_the_stack_and_its_participants_probed_healthy_again(journal: Journal) -> None:
    await _participant(journal, "outside-0", "http://10.0.0.9:9000", "unreachable")
    assert await _restore_held(journal) is None  # no stack: a restore goes on as before
    await _service(journal, "env", "starting", endpoint="http://127.0.0.1:9101/")
    await _participant(journal, "env-0", "http://127.0.0.1:9101", "healthy")  # what it was before the crash
    assert await _restore_held(journal) == "the deployment is not ready (service env is starting)"
    async with journal.write() as tx:
        row = await tx.get("services", "env")
        assert row is not None
        await tx.transition("services", "env", from_state="starting", version=row.version, to_state="ready",
                            reason="test")
    await _participant(journal, "env-0", "http://127.0.0.1:9101", "unreachable")  # probed while it was down
    assert await _restore_held(journal) == ("participant env-0 of the deployment is unreachable, not yet probed "
                                            "healthy again")
    await _participant(journal, "env-0", "http://127.0.0.1:9101", "healthy")
    # outside-0 is no service's endpoint: the restore does not wait for it (its rows decide as before).
    assert await _restore_held(journal) is None


async def test_a_row_ready_under_a_previous_leader_holds_until_the_new_one_moves_it(
        make_journal: Callable[..., Journal], clock: FakeClock) -> None:
    """Right after an election the rows still say what the previous leader saw: ``ready`` rows whose
    last move was under an earlier epoch hold, until the new leader's stack moves them again. The
    lease lapses on the journal's injectable clock, not by waiting."""
    journal = make_journal(clock=clock)
    first = await lease.acquire(journal, lease.ORCHESTRATOR, "orch-a", 5.0)
    assert first is not None
    async with journal.write(first.fence()) as tx:
        await tx.create("services", "env", reason="declared", values={"endpoint": "http://127.0.0.1:9101"})
        await tx.transition("services", "env", from_state="pending", version=1, to_state="starting", reason="test")
        await tx.transition("services", "env", from_state="starting", version=2, to_state="ready", reason="test")
    assert await _held(journal) is None  # the leader that moved it still leads
    clock.advance(6)  # the first lease lapses
    second = await lease.acquire(journal, lease.ORCHESTRATOR, "orch-b", 30)
    assert second is not None and second.epoch == first.epoch + 1
    said = "the deployment is not ready (service env was ready under a previous leader and is not taken over yet)"
    assert await _held(journal) == said
    assert await _restore_held(journal) == said
    async with journal.write(second.fence()) as tx:  # the new stack takes it over: gone, launched again
        for version, (a, b) in enumerate((("ready", "failed"), ("failed", "pending"), ("pending", "starting"),
                                          ("starting", "ready")), start=3):
            await tx.transition("services", "env", from_state=a, version=version, to_state=b, reason="test")
    assert await _held(journal) is None
