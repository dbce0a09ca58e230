"""Fencing reaches the participants: a real reference participant keeps the highest orchestrator epoch
it has seen per lineage (one journal's line of leaders; durably, beside its retire marks) and
refuses an older one on every mutating route, control and data, with a typed 409 that changes
nothing; a journal made again (another lineage) starts a fence of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.reference_procs import TOKEN, ParticipantClient, Procs, deadline
from workers.protocol import CONTROL_PREFIX, EPOCH_HEADER, LINEAGE_HEADER

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {TOKEN}"}
RETIRE = {"checkpoint_id": "retire-1", "episode_ids": [{"rollout_id": "r1", "attempt": 0}]}
FORGET = {"checkpoint_id": "forget-1", "rollout_ids": ["r1"]}
PREPARE = {"checkpoint_id": "ck-1"}
LINE = "a" * 32  # the lineage of the journal these calls come from


async def send(base: str, path: str, body: dict[str, Any], *, epoch: int | str | None,
               token: bool = True, lineage: str | None = LINE) -> tuple[int, dict[str, Any]]:
    headers = {**(AUTH if token else {})}
    if epoch is not None:
        headers[EPOCH_HEADER] = str(epoch)
    if lineage is not None:
        headers[LINEAGE_HEADER] = lineage
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


def control(op: str) -> str:
    return f"{CONTROL_PREFIX}/{op}"


async def test_an_older_epoch_is_refused_on_every_mutating_route_and_the_fence_survives_sigkill(
        procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    state = tmp_path / "env"
    env = procs.start("environment", state, "--agent", "http://127.0.0.1:9", "--resources", "http://127.0.0.1:9")
    assert (await controller.status(env.url))["epochs"] == {}

    # The leader at epoch 5 retires r1: accepted, and the participant now knows epoch 5.
    status, reply = await send(env.url, control("retire"), {**RETIRE, "deadline_ts": deadline()}, epoch=5)
    assert (status, reply) == (200, {"retired_count": 1})
    assert (await controller.status(env.url))["epochs"] == {LINE: 5}

    # A deposed leader (epoch 4) is refused everywhere, before anything is done.
    for path, body in ((control("forget"), {**FORGET, "deadline_ts": deadline()}),
                       (control("prepare"), {**PREPARE, "deadline_ts": deadline()}),
                       (control("retire"), {**RETIRE, "checkpoint_id": "retire-2", "deadline_ts": deadline(),
                                            "episode_ids": [{"rollout_id": "r2", "attempt": 3}]}),
                       ("/run", {"rollout_id": "r3", "attempt": 0, "task": {"target": 2}})):
        status, reply = await send(env.url, path, body, epoch=4)
        assert status == 409 and reply["error"]["code"] == "stale_epoch", (path, reply)
        assert "epoch 4 is older than epoch 5" in reply["error"]["detail"]
    after = await controller.status(env.url)
    assert (after["retired_rollouts"], after["phase"], after["epochs"]) == (1, "idle", {LINE: 5})  # r1 still retired
    assert after["stale_epochs_refused"] == 4  # counted, for an operator to see an old leader still calling

    # A caller without the token cannot raise the fence (nor pass it with an old epoch).
    status, _ = await send(env.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=10**17,
                           token=False)
    assert status == 401
    assert (await controller.status(env.url))["epochs"] == {LINE: 5}
    status, reply = await send(env.url, "/run", {"rollout_id": "r4", "attempt": 0, "task": {"target": 1}},
                               epoch=1, token=False)
    assert (status, reply["error"]["code"]) == (409, "stale_epoch")

    # A header that is not an epoch is a typed refusal; no header (a person, a test) is not fenced.
    for bad in ("-1", "5.0", "x", "9" * 19, "٣"):
        status, reply = await send(env.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=bad)
        assert (status, reply["error"]["code"]) == (422, "invalid_request"), (bad, reply)
    for bad in ("x" * 65, "a b", "a/b", "é"):
        status, reply = await send(env.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=9,
                                   lineage=bad)
        assert (status, reply["error"]["code"]) == (422, "invalid_request"), (bad, reply)

    # Another journal (its own lineage) starts at epoch 1 and is not refused: a journal made again
    # is a new line of leaders, not a deposed one.
    other = "b" * 32
    status, reply = await send(env.url, control("forget"), {**FORGET, "checkpoint_id": "forget-x",
                                                            "deadline_ts": deadline()}, epoch=1, lineage=other)
    assert status == 200, reply
    assert (await controller.status(env.url))["epochs"] == {LINE: 5, other: 1}

    # Restarted on the same state, it still knows epoch 5; the new leader (6) goes through.
    env.kill()
    env = procs.start("environment", state, "--agent", "http://127.0.0.1:9", "--resources", "http://127.0.0.1:9")
    restarted = await controller.status(env.url)
    assert restarted["epochs"] == {LINE: 5, other: 1}  # both remembered after SIGKILL
    assert restarted["stale_epochs_refused"] == 0  # the count is this process's
    status, reply = await send(env.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=4)
    assert (status, reply["error"]["code"]) == (409, "stale_epoch")
    status, reply = await send(env.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=6)
    assert status == 200, reply
    assert (await controller.status(env.url))["epochs"][LINE] == 6
    status, reply = await send(env.url, control("forget"), {**FORGET, "checkpoint_id": "forget-2",
                                                            "deadline_ts": deadline()}, epoch=None)
    assert status == 200, reply
    assert (await controller.status(env.url))["retired_rollouts"] == 0  # r1 was forgotten at epoch 6


async def test_a_model_server_fences_its_data_routes_too(procs: Procs, controller: ParticipantClient,
                                                          tmp_path: Path) -> None:
    model = procs.start("model", tmp_path / "model")
    status, _ = await send(model.url, control("forget"), {**FORGET, "deadline_ts": deadline()}, epoch=3)
    assert status == 200
    path = "/ng-rollout/r1/v1/chat/completions"
    status, reply = await send(model.url, path, {"messages": [{"role": "user", "content": "hi"}]}, epoch=2)
    assert (status, reply["error"]["code"]) == (409, "stale_epoch")
    status, reply = await send(model.url, path, {"messages": [{"role": "user", "content": "hi"}]}, epoch=3)
    assert status == 200, reply
