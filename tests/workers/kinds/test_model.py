"""The policy-model participant over real HTTP: held responses, the capture ledger, scoped commits,
restore into a fresh model server only, and retire.

Each test runs a tiny model server: ``POST /ng-rollout/<key>/v1/chat/completions`` admits a call
through :meth:`PolicyModelParticipant.call`, records the body's rows, then (when told) waits before
delivering and while streaming, so the test can hold a call at each point. ``POST /ledger/<key>``
reads an attempt's delivered rows back.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.workers.kinds.harness import KindServer, error_code, until
from workers.participant import storage
from workers.participant.kinds import PolicyModelParticipant
from workers.protocol import EpisodeId


class FakeModelServer:
    def __init__(self, model: PolicyModelParticipant) -> None:
        self.model = model
        self.generated: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.deliver: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.streaming: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.finish: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/ng-rollout/{key}/v1/chat/completions", self.chat)
        app.router.add_post("/ledger/{key}", self.ledger)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        body = await request.json()
        async with self.model.call(EpisodeId.from_capture_key(key)) as ticket:
            for row in body.get("rows", []):
                ticket.record(row)
            self.generated[key].set()
            if body.get("wait_deliver"):
                await self.deliver[key].wait()
            if body.get("fail"):
                return web.json_response({"error": "backend failed"}, status=502)
            await ticket.start_response()
            resp = web.StreamResponse()
            resp.content_type = "text/plain"
            await resp.prepare(request)
            await resp.write(b"first ")
            self.streaming[key].set()
            if body.get("wait_finish"):
                await self.finish[key].wait()
            await resp.write(b"done")
            await resp.write_eof()
            return resp

    async def ledger(self, request: web.Request) -> web.Response:
        return web.json_response(self.model.ledger(EpisodeId.from_capture_key(request.match_info["key"])))


Server = KindServer[PolicyModelParticipant]
Make = Callable[..., Awaitable[tuple[Server, FakeModelServer]]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    servers: list[Server] = []

    async def build(name: str = "m1", instance: str = "policy-0") -> tuple[Server, FakeModelServer]:
        participant = PolicyModelParticipant(instance)
        server = KindServer(participant, tmp_path / f"state-{name}", lease_grace_seconds=60)
        fake = FakeModelServer(participant)
        fake.mount(server.app)
        servers.append(await server.start())
        return server, fake
    yield build
    for server in servers:
        await server.stop()


def chat(key: str) -> str:
    return f"/ng-rollout/{key}/v1/chat/completions"


def scope(*keys: str) -> list[dict[str, Any]]:
    return [EpisodeId.from_capture_key(k).model_dump() for k in keys]


def read_back(checkpoint_dir: Path, instance: str = "policy-0") -> dict[str, dict[str, Any]]:
    _, records = storage.read_records(checkpoint_dir, "model", instance, lambda r: r)
    return {EpisodeId.model_validate(r["episode_id"]).capture_key: r for r in records}


async def test_held_response_does_not_block_prepare_and_is_left_out_of_the_commit(make: Make,
                                                                                 tmp_path: Path) -> None:
    srv, fake = await make()
    # a: delivered and finished before the checkpoint.
    status, text, _ = await srv.post(chat("a"), {"rows": [{"call": 1, "staging_key": "sk-a1"}]})
    assert (status, text) == (200, "first done")
    # b: its response is streaming when the checkpoint closes.
    call_b = asyncio.create_task(srv.post(chat("b"), {"rows": [{"call": 1, "staging_keys": ["sk-b2", "sk-b1"]}],
                                                      "wait_finish": True}))
    await fake.streaming["b"].wait()
    # c: generated (its row recorded), response not started yet.
    call_c = asyncio.create_task(srv.post(chat("c"), {"rows": [{"call": 1, "staging_key": "sk-c1"}],
                                                      "wait_deliver": True}))
    await fake.generated["c"].wait()

    prepare = asyncio.create_task(srv.ok("prepare", "ck-1"))
    await until(lambda: srv.control.phase == "preparing")
    fake.deliver["c"].set()  # c now tries to deliver: held
    await until(lambda: srv.participant.readiness().counts["held"] == 1)
    report = (await srv.status())["report"]
    assert report["ready"] is False and report["blockers"] == ["b"] and report["blocker_count"] == 1
    assert report["counts"] == {"inflight": 2, "held": 1, "streaming": 1}
    await asyncio.sleep(0.05)
    assert not prepare.done(), "a streaming response blocks prepare"

    # A new call while the gate is closed is refused.
    status, body, _ = await srv.post(chat("d"), {"rows": []})
    assert status == 409 and error_code(body) == "checkpoint_parked"

    fake.finish["b"].set()
    assert (await prepare)["phase"] == "prepared"
    assert (await call_b)[:2] == (200, "first done")
    assert not call_c.done(), "the held response is not delivered while the checkpoint is open"

    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("a", "b", "c"))
    assert reply["episode_ids"] == ["a", "b"]
    assert reply["staging_keys"] == ["sk-a1", "sk-b1", "sk-b2"]
    assert reply["staging_keys_by_episode"] == {"a": ["sk-a1"], "b": ["sk-b1", "sk-b2"]}
    stored = read_back(tmp_path / "ckpt")
    assert stored["b"] == {"episode_id": {"rollout_id": "b", "attempt": 0},
                           "rows": [{"call": 1, "staging_keys": ["sk-b2", "sk-b1"]}], "generation_cuts": []}
    assert "c" not in stored

    await srv.ok("resume", "ck-1")
    assert (await call_c)[:2] == (200, "first done")
    status, rows, _ = await srv.post("/ledger/c")
    assert rows == [{"call": 1, "staging_key": "sk-c1"}], "delivered after resume, the row counts"


async def test_a_call_that_ends_undelivered_drops_its_rows(make: Make) -> None:
    srv, _ = await make()
    assert (await srv.post(chat("u"), {"rows": [{"call": 1}]}))[0] == 200
    status, _, _ = await srv.post(chat("u"), {"rows": [{"call": 2}], "fail": True})
    assert status == 502
    status, rows, _ = await srv.post("/ledger/u")
    assert rows == [{"call": 1}]
    assert (await srv.status())["served_calls"] == 2


async def test_model_commit_requires_a_scope(make: Make, tmp_path: Path) -> None:
    srv, _ = await make()
    await srv.post(chat("a"), {"rows": [{"call": 1}]})
    await srv.ok("prepare", "ck-1")
    status, body = await srv.ctl("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"))
    assert status == 422 and error_code(body) == "invalid_request"
    assert "requires episode_ids" in body["error"]["detail"]
    assert not (tmp_path / "ckpt" / "gym" / "model" / "policy-0" / "manifest.json").exists()
    # The refusal pinned nothing: the same checkpoint id commits once the scope is given.
    reply = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("a"))
    assert reply["episode_ids"] == ["a"]


async def test_commit_restore_round_trip_into_a_fresh_model_server(make: Make, tmp_path: Path) -> None:
    srv, _ = await make("m1")
    rows_a = [{"z": 1, "a": 2, "big": 2**70, "staging_key": "sk-a"}, {"text": "héllo", "nested": [1, [2.5]]}]
    await srv.post(chat("a"), {"rows": rows_a[:1]})
    await srv.post(chat("a"), {"rows": rows_a[1:]})
    await srv.post(chat("b"), {"rows": [{"call": "b1"}]})
    await srv.post(chat("gone"), {"rows": [{"call": "x"}]})  # finished, not continued
    await srv.ok("prepare", "ck-1")
    committed = await srv.ok("commit", "ck-1", checkpoint_dir=str(tmp_path / "ckpt"),
                             episode_ids=scope("a", "b"))
    assert committed["episode_ids"] == ["a", "b"]
    await srv.ok("resume", "ck-1")

    # A fresh process: new participant, new control plane, the same checkpoint directory.
    fresh, _ = await make("m2")
    restored = await fresh.ok("restore", "ck-r", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("a", "b"))
    assert restored["restored"] == ["a-a1", "b-a1"] and restored["source_checkpoint_id"] == "ck-1"
    status, rows, _ = await fresh.post("/ledger/a-a1")
    assert rows == rows_a and list(rows[0]) == ["z", "a", "big", "staging_key"]
    assert fresh.participant.ledger(EpisodeId(rollout_id="a", attempt=1)) == rows_a
    assert [e.capture_key for e in fresh.participant.restored_pending()] == ["a-a1", "b-a1"]
    # Admission stays closed until resume; the replaced attempt is refused for good.
    status, body, _ = await fresh.post(chat("a-a1"), {"rows": []})
    assert status == 409 and error_code(body) == "checkpoint_parked"
    await fresh.ok("resume", "ck-r")
    status, body, _ = await fresh.post(chat("a"), {"rows": []})
    assert status == 409 and error_code(body) == "stale_attempt"
    assert (await fresh.post(chat("a-a1"), {"rows": [{"call": "a-a1#1"}]}))[0] == 200

    # The next checkpoint re-exports the restored rows and deletes the unclaimed, unscoped ledger.
    await fresh.ok("prepare", "ck-2")
    again = await fresh.ok("commit", "ck-2", checkpoint_dir=str(tmp_path / "ckpt2"), episode_ids=scope("a-a1"))
    assert again["episode_ids"] == ["a-a1"] and again["staging_keys"] == ["sk-a"]
    assert read_back(tmp_path / "ckpt2")["a-a1"]["rows"] == [*rows_a, {"call": "a-a1#1"}]
    assert fresh.participant.ledger(EpisodeId(rollout_id="b", attempt=1)) == []
    assert fresh.participant.restored_pending() == []
    await fresh.ok("resume", "ck-2")

    # A model server that has served a call cannot take a restore.
    status, body = await srv.ctl("restore", "ck-r2", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("a"))
    assert status == 409 and error_code(body) == "invalid_phase"
    assert "freshly started model server" in body["error"]["detail"]


async def test_retire_cancels_calls_and_refuses_the_attempt_until_forget(make: Make) -> None:
    srv, fake = await make()
    await srv.post(chat("r"), {"rows": [{"call": 1}]})
    call = asyncio.create_task(srv.post(chat("r"), {"rows": [{"call": 2}], "wait_deliver": True}))
    await fake.generated["r"].wait()
    reply = await srv.ok("retire", "ck-x", episode_ids=scope("r"))
    assert reply["retired_count"] == 1
    status, body, _ = await call
    assert status == 409 and error_code(body) == "stale_attempt"
    assert srv.participant.readiness().counts["inflight"] == 0
    status, rows, _ = await srv.post("/ledger/r")
    assert rows == []
    status, body, _ = await srv.post(chat("r"), {"rows": []})
    assert status == 409 and error_code(body) == "stale_attempt"
    assert (await srv.status())["retired_rollouts"] == 1
    assert (await srv.post(chat("r-a1"), {"rows": []}))[0] == 200
    await srv.ok("forget", "ck-x", rollout_ids=["r"])
    assert (await srv.post(chat("r"), {"rows": []}))[0] == 200


async def test_an_invalid_restored_record_is_refused_by_name(make: Make, tmp_path: Path) -> None:
    bad = {"episode_id": {"rollout_id": "a", "attempt": 0}, "rows": [], "generation_cuts": [{"c": 1}, {"c": 2}]}
    storage.write_records(tmp_path / "ckpt", "model", "policy-0", "ck-1", [("a", bad)])
    fresh, _ = await make("m2")
    status, body = await fresh.ctl("restore", "ck-r", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=scope("a"))
    assert status == 422 and error_code(body) == "invalid_checkpoint_state"
    assert "'a'" in body["error"]["detail"] and "generation cuts" in body["error"]["detail"]
    assert fresh.control.phase == "idle" and fresh.participant.restored_pending() == []
    # Still a fresh model server, admission open: a later restore of a good checkpoint works.
    good = {"episode_id": {"rollout_id": "a", "attempt": 0}, "rows": [{"call": 1}], "generation_cuts": []}
    storage.write_records(tmp_path / "ckpt2", "model", "policy-0", "ck-2", [("a", good)])
    restored = await fresh.ok("restore", "ck-r2", checkpoint_dir=str(tmp_path / "ckpt2"), episode_ids=scope("a"))
    assert restored["restored"] == ["a-a1"]
    assert fresh.participant.ledger(EpisodeId(rollout_id="a", attempt=1)) == [{"call": 1}]
