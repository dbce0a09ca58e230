"""The dispatcher's database retries (tenacity): a shared body read and an outcome write survive hiccups."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import sqlalchemy as sa
from aiohttp import web

from engine.runtime.dispatcher import BODY_READ_TRIES
from engine.runtime.rpc import RpcClient
from journal import Journal, audit, outbox
from tests.engine.runtime.test_dispatcher import Scripted, make_dispatcher, remote, wait_settled  # noqa: F401


_hooks: list[Any] = []


@pytest.fixture(autouse=True)
def _remove_hooks() -> Iterator[None]:
    yield
    while _hooks:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", _hooks.pop())


def fail_statements(journal: Journal, needle: str, times: int) -> list[str]:
    """Make the next ``times`` statements whose SQL contains ``needle`` fail.

    A ``before_cursor_execute`` hook on every SQLAlchemy engine of this process (the journal's
    async engine and, on SQLite, its writer's own engine), removed after the test.
    """
    failed: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if needle in statement and len(failed) < times:
            failed.append(statement)
            raise OSError("database hiccup (injected)")

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", before)
    _hooks.append(before)
    return failed


async def send_shared(journal: Journal, remote: Scripted, *, hiccups: int) -> tuple[Any, list[str]]:
    rpc = RpcClient(token=None, transport_tries=1)
    d, committer, _ = await make_dispatcher(journal, rpc)
    shared = outbox.Body.of({"checkpoint_id": "ck"})
    async with journal.write() as tx:
        await tx.create("participants", "owner", reason="owner", values={"url": remote.url})
        row = await tx.get("participants", "owner")
        assert row is not None
        # One attempt only: if the body read gave up, the call would fail unsent.
        intent = outbox.Intent.for_row(row, target=remote.url, method="POST", path="/s", shared=shared,
                                       max_attempts=1)
        await outbox.ensure_all(tx, [(intent, "test")])
    failed = fail_statements(journal, "FROM rpc_bodies", hiccups)
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, [intent.id])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    return rows[intent.id], failed


async def test_a_shared_body_read_is_retried_through_database_hiccups(journal: Journal, remote: Scripted) -> None:
    row, failed = await send_shared(journal, remote, hiccups=BODY_READ_TRIES - 1)
    assert len(failed) == BODY_READ_TRIES - 1
    assert row.state == "succeeded" and row["attempts"] == 1 and remote.calls == {"s": 1}
    assert await audit.verify(journal) == []


async def test_a_shared_body_read_gives_up_after_body_read_tries(journal: Journal, remote: Scripted) -> None:
    row, failed = await send_shared(journal, remote, hiccups=BODY_READ_TRIES)
    assert len(failed) == BODY_READ_TRIES
    assert row.state == "failed" and row["error"]["sent"] is False
    assert "shared body unavailable" in row["error"]["detail"] and "database hiccup" in row["error"]["detail"]
    assert remote.calls == {}


async def test_an_outcome_write_is_retried_through_database_hiccups(journal: Journal) -> None:
    failed: list[list[str]] = []

    async def answer(request: web.Request) -> web.Response:
        # The claim has committed: from here on the next writes to rpc_calls are the outcome's.
        failed.append(fail_statements(journal, "UPDATE rpc_calls", 4))
        return web.json_response({"ok": True, "body": await request.json()})

    app = web.Application()
    app.router.add_post("/answer", answer)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    rpc = RpcClient(token=None, transport_tries=1)
    d, committer, _ = await make_dispatcher(journal, rpc)
    async with journal.write() as tx:
        await tx.create("participants", "owner", reason="owner", values={"url": url})
        row = await tx.get("participants", "owner")
        assert row is not None
        intent = outbox.Intent.for_row(row, target=url, method="POST", path="/answer", body={"p": 1},
                                       max_attempts=1)
        await outbox.ensure_all(tx, [(intent, "test")])
    task = asyncio.create_task(d.run())
    try:
        rows = await wait_settled(journal, [intent.id])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
        await runner.cleanup()
    # Four of the five tries of the outcome write failed; the fifth recorded it.
    assert rows[intent.id].state == "succeeded" and rows[intent.id]["attempts"] == 1
    assert rows[intent.id]["result"] == {"ok": True, "body": {"p": 1}}
    assert [len(f) for f in failed] == [4]
    assert await audit.verify(journal) == []
