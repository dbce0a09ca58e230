"""The reference engine's own behaviour, and failures only it can be made to produce.

Fault injection: a real engine cannot be made to fail a release on demand on a CPU, so these
tests arm the reference engine's test-only ``POST /_test/fail_next`` route (the process runs
with ``--enable-test-faults``); the failure then comes over real HTTP from the real process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from workers.inference import (EngineCallError, EngineTimeoutError, EngineUncertainError, SGLangConfig,
                               SGLangEngine)
from workers.inference.reference import load_state
from workers.policy import MODEL_FILE, Policy, decode, encode, save_weights

from .engines import EngineProc, Recorded, Target, until


@pytest.fixture(autouse=True)
def _reference_only(target: Target) -> None:
    target.require_reference("test-only routes and internal states")


async def post(http: aiohttp.ClientSession, target: Target, path: str,
               body: Any = None) -> tuple[int, Any]:
    async with http.post(target.url + path, json=body) as resp:
        text = await resp.text()
        return resp.status, (await resp.json() if resp.content_type == "application/json" else text)


async def stats(engine: SGLangEngine) -> dict[str, Any]:
    states: dict[str, Any] = (await engine.server_info())["internal_states"][0]
    return states


async def arm(http: aiohttp.ClientSession, target: Target, path: str, mode: str,
              seconds: float = 30.0) -> None:
    status, _ = await post(http, target, "/_test/fail_next", {"path": path, "mode": mode, "seconds": seconds})
    assert status == 200


def greedy(prompt: str, n: int, seed: int = 0) -> list[int]:
    return Policy(seed=seed).generate(encode(prompt), n)


async def test_generate_answers_sglang_shape_with_the_policy_tokens(engine: SGLangEngine, target: Target,
                                                                   http: aiohttp.ClientSession) -> None:
    status, body = await post(http, target, "/generate",
                              {"text": "abc", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert status == 200
    assert set(body) == {"text", "output_ids", "meta_info"}
    assert body["output_ids"] == greedy("abc", 5)
    assert body["text"] == decode(body["output_ids"])
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 5)
    assert meta["weight_version"] == "initial"


async def test_flush_cache_empties_the_prefix_cache(engine: SGLangEngine) -> None:
    await engine.generate("cache me", 3)
    assert (await engine.generate("cache me", 3)).meta_info["cached_tokens"] == len("cache me")
    await engine.flush_cache()
    assert (await engine.generate("cache me", 3)).meta_info["cached_tokens"] == 0


async def test_bodies_are_validated_with_sglang_error_shapes(target: Target, http: aiohttp.ClientSession,
                                                             engine: SGLangEngine) -> None:
    status, body = await post(http, target, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and body["object"] == "error" and "mode" in body["message"]
    status, body = await post(http, target, "/release_memory_occupation", {"tags": ["activations"]})
    assert status == 400 and "activations" in body["error"]["message"]
    status, body = await post(http, target, "/update_weights_from_disk", {"model_path": "/x", "bogus": 1})
    assert status == 400 and "bogus" in body["message"]
    status, body = await post(http, target, "/generate", {"sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "text" in body["error"]["message"]
    assert (await stats(engine))["paused"] is False  # nothing above took effect


async def test_a_truncated_weights_directory_is_refused_with_success_false(
        target: Target, http: aiohttp.ClientSession, tmp_path: Path, engine: SGLangEngine) -> None:
    save_weights(Policy(seed=3), tmp_path / "w", "v3")
    data = (tmp_path / "w" / MODEL_FILE).read_bytes()
    (tmp_path / "w" / MODEL_FILE).write_bytes(data[: len(data) // 2])
    status, body = await post(http, target, "/update_weights_from_disk",
                              {"model_path": str(tmp_path / "w"), "weight_version": "v3"})
    assert status == 400
    assert body["success"] is False and "sha256" in body["message"]
    assert await engine.weight_version() == "initial"


async def test_retract_moves_in_flight_requests_back_so_the_cache_can_flush(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    await post(http, target, "/slow_down", {"forward_sleep_time": 0.01})
    task = asyncio.create_task(engine.generate("retracted", 400))
    try:
        await until(lambda: _running(engine, 1), what="the request to run")
        await engine.pause_generation("retract")
        await until(lambda: _waiting(engine, 1), what="the request to be retracted")
        await engine.flush_cache()  # allowed: nothing is running
        assert await engine.release_memory(["kv_cache"]) == ("kv_cache",)
        assert await engine.resume_memory(["kv_cache"]) == ("kv_cache",)
        await post(http, target, "/slow_down", {"forward_sleep_time": None})
        await engine.continue_generation()
        result = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert result.finish_reason["type"] == "length"
    assert result.output_ids == greedy("retracted", 400)  # recomputed, not corrupted


async def test_in_place_keeps_requests_running_and_the_cache_cannot_flush(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    await post(http, target, "/slow_down", {"forward_sleep_time": 0.01})
    task = asyncio.create_task(engine.generate("in place", 400))
    try:
        await until(lambda: _running(engine, 1), what="the request to run")
        await engine.pause_generation("in_place")
        with pytest.raises(EngineCallError) as err:
            await engine.flush_cache(attempts=2)
        assert err.value.status == 400
        assert (await stats(engine))["num_running_reqs"] == 1
        await post(http, target, "/slow_down", {"forward_sleep_time": None})
        await engine.continue_generation()
        result = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert result.output_ids == greedy("in place", 400)


async def test_abort_finishes_in_flight_requests_as_aborted(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    await post(http, target, "/slow_down", {"forward_sleep_time": 0.01})
    task = asyncio.create_task(engine.generate("abort me", 400))
    try:
        await until(lambda: _running(engine, 1), what="the request to run")
        await engine.pause_generation("abort")
        result = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert result.finish_reason["type"] == "abort"
    assert len(result.output_ids) < 400


async def test_an_update_while_paused_reports_the_requests_it_held(
        engine: SGLangEngine, target: Target) -> None:
    await engine.pause_generation("retract")
    task = asyncio.create_task(engine.generate("held", 6))
    try:
        await until(lambda: _waiting(engine, 1), what="the request to wait")
        update = await engine.update_weights_from_disk(str(target.other_dir), "other")
        assert update.num_paused_requests == 1
        await engine.continue_generation()
        result = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert result.weight_version == "other"
    assert result.output_ids == greedy("held", 6, seed=1)  # it ran on the new weights only


@pytest.mark.parametrize("mode", ["error", "refuse", "hang"])
async def test_a_failed_region_call_leaves_the_engine_uncertain_until_replaced(
        target: Target, http: aiohttp.ClientSession, recorded: Recorded, engine: SGLangEngine,
        mode: str) -> None:
    adapter = SGLangEngine(SGLangConfig(target.url, timeout=0.5, flush_interval=0.01), session=http)
    await arm(http, target, "/release_memory_occupation", mode, seconds=3.0)
    expected = EngineTimeoutError if mode == "hang" else EngineCallError
    with pytest.raises(expected):
        await adapter.release_memory(["weights"])
    assert adapter.uncertain is not None and "release ['weights']" in adapter.uncertain
    recorded.calls.clear()
    calls = [adapter.release_memory(["weights"]), adapter.resume_memory(["weights"]),
             adapter.pause_generation(), adapter.continue_generation(), adapter.generate("x", 1),
             adapter.weight_version(), adapter.health(), adapter.flush_cache(),
             adapter.update_weights_from_disk(target.initial_dir, "again")]
    for call in calls:
        with pytest.raises(EngineUncertainError):
            await call
    assert recorded.calls == [], "an uncertain engine still sent requests"
    await adapter.close()
    # A replacement adapter (here: the operator trusts the same process again) is usable.
    assert (await engine.generate("x", 1)).finish_reason["type"] == "length"


async def test_a_failed_resume_is_uncertain_too(target: Target, http: aiohttp.ClientSession,
                                                engine: SGLangEngine) -> None:
    await engine.release_memory(["cuda_graph"])
    await arm(http, target, "/resume_memory_occupation", "error")
    with pytest.raises(EngineCallError) as err:
        await engine.resume_memory(["cuda_graph"])
    assert err.value.status == 500
    with pytest.raises(EngineUncertainError):
        await engine.resume_memory(["cuda_graph"])


async def test_a_cancelled_region_call_is_uncertain(target: Target, http: aiohttp.ClientSession,
                                                    engine: SGLangEngine) -> None:
    await arm(http, target, "/release_memory_occupation", "hang", seconds=2.0)
    call = asyncio.create_task(engine.release_memory(["kv_cache"]))
    await until(_armed_consumed(http, target), what="the hanging request to arrive")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine.uncertain is not None
    with pytest.raises(EngineUncertainError):
        await engine.weight_version()


async def test_a_borrowed_sessions_short_default_timeout_does_not_replace_the_adapters_bound(
        target: Target, http: aiohttp.ClientSession, engine: SGLangEngine) -> None:
    # The engine answers (500) after 1.5 s: within the adapter's 30 s bound, though past the
    # borrowed session's 0.2 s default, which must not apply to the adapter's requests.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as short:
        adapter = SGLangEngine(SGLangConfig(target.url, timeout=30.0), session=short)
        await arm(http, target, "/model_info", "hang", seconds=1.5)
        with pytest.raises(EngineCallError) as err:
            await adapter.model_info()
        assert not isinstance(err.value, EngineTimeoutError)
        assert err.value.status == 500 and "injected fault (hang)" in err.value.detail
        assert await adapter.weight_version() == "initial"


async def test_a_hanging_flush_is_bounded_and_not_retried(
        target: Target, http: aiohttp.ClientSession, recorded: Recorded, engine: SGLangEngine) -> None:
    adapter = SGLangEngine(SGLangConfig(target.url, timeout=0.3, flush_attempts=5, flush_interval=0.01),
                           session=http)
    await arm(http, target, "/flush_cache", "hang", seconds=3.0)
    recorded.calls.clear()
    with pytest.raises(EngineTimeoutError) as err:
        await adapter.flush_cache()
    assert err.value.timeout == 0.3 and err.value.endpoint == "POST /flush_cache"
    # Only a 400 (requests running) is retried; a call with no answer is not sent again.
    assert recorded.paths() == ["/flush_cache"]


def test_load_state_serves_the_seed_policy_or_a_weights_directory(tmp_path: Path) -> None:
    assert load_state(None, 0).weight_version == "initial"
    save_weights(Policy(seed=5), tmp_path / "w", "v5")
    state = load_state(tmp_path / "w", 0)
    assert (state.weight_version, state.model_path) == ("v5", str(tmp_path / "w"))
    (tmp_path / "w" / MODEL_FILE).write_bytes(b"truncated")
    with pytest.raises(SystemExit, match="sha256"):
        load_state(tmp_path / "w", 0)


async def _running(engine: SGLangEngine, n: int) -> bool:
    return bool((await stats(engine))["num_running_reqs"] >= n)


async def _waiting(engine: SGLangEngine, n: int) -> bool:
    s = await stats(engine)
    return bool(s["num_waiting_reqs"] >= n and s["num_running_reqs"] == 0)


def _armed_consumed(http: aiohttp.ClientSession, target: Target) -> Any:
    """A check that the armed fault was taken (the hanging request reached the engine)."""
    async def check() -> bool:
        # Arming the same path again answers which faults are pending; the route reports it.
        async with http.get(target.url + "/get_server_info") as resp:
            return "/release_memory_occupation" not in (await resp.json()).get("armed_faults", [])
    return check


async def test_history_records_pauses_loads_labels_and_continues_with_the_version_served(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    # ``engine`` puts the target back on its initial weights first.
    async with http.get(target.url + "/_test/history") as resp:
        before = len((await resp.json())["history"])
    started = time.time()
    assert (await post(http, target, "/pause_generation", {"mode": "abort"}))[0] == 200
    assert (await post(http, target, "/update_weight_version",
                       {"new_version": "label-1", "abort_all_requests": False}))[0] == 200
    assert target.other_dir is not None
    assert (await post(http, target, "/update_weights_from_disk",
                       {"model_path": target.other_dir, "weight_version": "other"}))[0] == 200
    # A load that fails (its directory does not exist) is not an event: nothing was loaded.
    assert (await post(http, target, "/update_weights_from_disk",
                       {"model_path": target.initial_dir + "-missing", "weight_version": "x"}))[0] == 400
    await arm(http, target, "/continue_generation", "error")  # an injected failure acted on nothing
    assert (await post(http, target, "/continue_generation", {}))[0] == 500
    assert (await post(http, target, "/continue_generation", {}))[0] == 200
    assert (await post(http, target, "/update_weights_from_disk",
                       {"model_path": target.initial_dir, "weight_version": target.initial_version}))[0] == 200
    async with http.get(target.url + "/_test/history") as resp:
        history = (await resp.json())["history"][before:]
    assert [entry[:2] for entry in history] == [["pause", "initial"], ["label", "label-1"], ["load", "other"],
                                                ["continue", "other"], ["load", "initial"]]
    times = [entry[2] for entry in history]
    assert times == sorted(times) and started <= times[0] and times[-1] <= time.time()


async def test_die_next_kills_the_process_before_the_route_acts(tmp_path: Path) -> None:
    """Its own process (the session's engine must live): armed on a route, the next request to it
    gets no answer and the process ends by SIGKILL; a request to another route is answered."""
    save_weights(Policy(seed=0), tmp_path / "initial", "initial")
    proc = EngineProc(["--port", "0", "--model-dir", str(tmp_path / "initial"), "--enable-test-faults"],
                      tmp_path / "engine.log").start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(proc.url + "/_test/die_next", json={"path": "/pause_generation"}) as resp:
                assert resp.status == 200 and (await resp.json()) == {"armed": "/pause_generation", "mode": "die"}
            async with http.post(proc.url + "/continue_generation", json={}) as resp:
                assert resp.status == 200  # another route is not armed
            with pytest.raises(aiohttp.ClientError):
                async with http.post(proc.url + "/pause_generation", json={"mode": "abort"}) as resp:
                    await resp.read()
        assert proc.proc is not None and proc.proc.wait(10) == -9
    finally:
        proc.kill()
    assert "dying (SIGKILL) on /pause_generation" in (tmp_path / "engine.log").read_text()


async def test_an_adapter_told_of_a_durable_record_acts_on_it(target: Target, http: aiohttp.ClientSession,
                                                              recorded: Recorded, engine: SGLangEngine) -> None:
    """``note_released``: regions a journal row recorded released are resumed for real by a new
    adapter (which otherwise takes them for resident and sends nothing); ``mark_uncertain``: a row
    recorded uncertain makes a new adapter refuse every call, sending nothing."""
    await engine.release_memory(["kv_cache", "cuda_graph"])
    fresh = SGLangEngine(SGLangConfig(target.url, timeout=5, flush_interval=0.01), session=http)
    recorded.calls.clear()
    assert await fresh.resume_memory() == ()  # believes everything resident: nothing sent
    assert recorded.paths() == []
    fresh.note_released(["cuda_graph", "kv_cache"])
    assert await fresh.resume_memory() == ("kv_cache", "cuda_graph")
    assert recorded.paths() == ["/resume_memory_occupation"]
    assert (await engine.generate("x", 1)).finish_reason["type"] == "length"  # resident again
    await fresh.close()
    doubted = SGLangEngine(SGLangConfig(target.url, timeout=5, flush_interval=0.01), session=http)
    doubted.mark_uncertain("recorded uncertain by an earlier leader")
    recorded.calls.clear()
    for call in (doubted.pause_generation(), doubted.weight_version(), doubted.release_memory()):
        with pytest.raises(EngineUncertainError, match="recorded uncertain by an earlier leader"):
            await call
    assert recorded.calls == []
    await doubted.close()
