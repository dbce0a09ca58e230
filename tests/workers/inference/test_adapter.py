"""``SGLangEngine`` against a real engine process: the reference engine, or SGLang on a GPU host.

These tests use only routes SGLang has, so ``bench/gpu_smoke.sh`` runs them unchanged against
a real SGLang server (``TIDELOG_SGLANG_URL``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from workers.inference import (REGIONS, EngineCallError, EngineConfigError, RegionState, SGLangConfig,
                               SGLangEngine)

from .engines import Recorded, Target, until


async def queued(engine: SGLangEngine, target: Target, n: int) -> None:
    """Wait until ``n`` requests wait in the engine (the reference engine reports its queue)."""
    if target.kind != "reference":
        await asyncio.sleep(2.0)  # SGLang exposes no portable queue length; give the request time
        return

    async def waiting() -> bool:
        states = (await engine.server_info())["internal_states"][0]
        return bool(states["num_waiting_reqs"] >= n)
    await until(waiting, what=f"{n} waiting requests")


async def test_reports_the_serving_weight_version_on_both_routes(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    assert await engine.weight_version() == target.initial_version
    async with http.get(target.url + "/get_weight_version") as resp:
        assert (await resp.json())["weight_version"] == target.initial_version
    info = await engine.model_info()
    assert info["is_generation"] is True
    assert info["model_path"] == target.initial_dir


async def test_generation_is_deterministic_and_reports_its_version(engine: SGLangEngine,
                                                                   target: Target) -> None:
    first = await engine.generate("the cat sat on", 12)
    second = await engine.generate("the cat sat on", 12)
    assert first.text == second.text and first.output_ids == second.output_ids
    assert len(first.output_ids) == 12
    assert first.finish_reason["type"] == "length"
    assert first.weight_version == target.initial_version


async def test_pause_blocks_new_generation_until_continue(engine: SGLangEngine, target: Target) -> None:
    expected = await engine.generate("pause me", 8)
    await engine.pause_generation("retract")
    task = asyncio.create_task(engine.generate("pause me", 8))
    try:
        await queued(engine, target, 1)
        await asyncio.sleep(0.2)  # the request is queued; it must still be held back
        assert not task.done(), "a request that arrived while paused ran anyway"
        await engine.continue_generation()
        result = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert result.output_ids == expected.output_ids
    assert result.finish_reason["type"] == "length"


async def test_weight_update_from_disk_changes_generations_and_the_reported_version(
        engine: SGLangEngine, target: Target, http: aiohttp.ClientSession) -> None:
    before = await engine.generate("hello world", 16)
    source = target.other_dir or target.initial_dir  # SGLang without a second checkpoint: same weights
    update = await engine.update_weights_from_disk(source, "v-next")
    assert update.num_paused_requests == 0
    assert await engine.weight_version() == "v-next"
    async with http.get(target.url + "/get_weight_version") as resp:
        assert (await resp.json())["weight_version"] == "v-next"
    after = await engine.generate("hello world", 16)
    assert after.weight_version == "v-next"
    if target.other_dir is not None:
        assert after.output_ids != before.output_ids, "new weights did not change the generation"
    await engine.update_weights_from_disk(target.initial_dir, "v-back")
    assert (await engine.generate("hello world", 16)).output_ids == before.output_ids


async def test_set_weight_version_relabels_without_touching_weights(engine: SGLangEngine) -> None:
    before = await engine.generate("relabel", 8)
    await engine.set_weight_version("label-7")
    assert await engine.weight_version() == "label-7"
    after = await engine.generate("relabel", 8)
    assert after.weight_version == "label-7"
    assert after.output_ids == before.output_ids


@pytest.mark.parametrize("region", REGIONS)
async def test_release_and_resume_of_each_region_is_idempotent(
        engine: SGLangEngine, recorded: Recorded, region: str) -> None:
    expected = await engine.generate("memory", 8)
    recorded.calls.clear()
    assert await engine.release_memory([region]) == (region,)
    # The release path flushes the cache first, then releases exactly that region.
    assert recorded.paths() == ["/flush_cache", "/release_memory_occupation"]
    assert engine.memory[region] is RegionState.RELEASED
    assert all(state is RegionState.RESIDENT for r, state in engine.memory.items() if r != region)

    recorded.calls.clear()
    assert await engine.release_memory([region]) == ()
    assert recorded.calls == [], "a repeated release reached the engine"

    assert await engine.resume_memory([region]) == (region,)
    assert recorded.paths() == ["/resume_memory_occupation"]
    recorded.calls.clear()
    assert await engine.resume_memory([region]) == ()
    assert recorded.calls == [], "a repeated resume reached the engine"
    assert (await engine.generate("memory", 8)).output_ids == expected.output_ids


async def test_release_all_then_resume_acts_only_on_what_is_left(engine: SGLangEngine,
                                                                recorded: Recorded) -> None:
    assert await engine.release_memory(["kv_cache"]) == ("kv_cache",)
    assert await engine.release_memory() == ("weights", "cuda_graph")
    assert set(engine.memory.values()) == {RegionState.RELEASED}
    assert await engine.resume_memory(["weights"]) == ("weights",)
    recorded.calls.clear()
    assert await engine.resume_memory() == ("kv_cache", "cuda_graph")
    assert recorded.paths() == ["/resume_memory_occupation"]
    assert (await engine.generate("all back", 4)).finish_reason["type"] == "length"


async def test_bad_input_fails_before_any_request(engine: SGLangEngine, recorded: Recorded) -> None:
    with pytest.raises(EngineConfigError, match="regions"):
        await engine.release_memory(["weights", "activations"])
    with pytest.raises(EngineConfigError, match="mode"):
        await engine.pause_generation("drain")
    with pytest.raises(EngineConfigError, match="weight_version"):
        await engine.update_weights_from_disk("/some/dir", "")
    assert recorded.calls == []
    assert engine.uncertain is None


async def test_a_refused_weight_update_raises_and_keeps_the_served_weights(
        engine: SGLangEngine, target: Target, tmp_path: object) -> None:
    before = await engine.generate("keep", 8)
    with pytest.raises(EngineCallError) as err:
        await engine.update_weights_from_disk(f"{tmp_path}/no-such-weights", "v-bad")
    assert err.value.status == 400
    assert await engine.weight_version() == target.initial_version
    assert (await engine.generate("keep", 8)).output_ids == before.output_ids
    assert engine.uncertain is None  # a clean refusal is not an unknown state


async def test_health_reflects_whether_the_engine_can_generate(engine: SGLangEngine,
                                                               target: Target) -> None:
    assert await engine.health(timeout=30) is True
    target.require_reference("its short --health-check-timeout makes a paused probe answer 503 fast")
    await engine.pause_generation("retract")
    assert await engine.health(timeout=30) is False  # the 1-token probe waits behind the pause
    await engine.continue_generation()
    assert await engine.health(timeout=30) is True


async def test_the_api_key_goes_with_every_request_also_on_a_borrowed_session(
        target: Target, engine: SGLangEngine) -> None:
    # ``engine`` only puts the target back to its initial state (running, resident).
    sent: list[str | None] = []
    trace = aiohttp.TraceConfig()

    async def on_start(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                       params: aiohttp.TraceRequestStartParams) -> None:
        sent.append(params.headers.get("Authorization"))
    trace.on_request_start.append(on_start)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        adapter = SGLangEngine(SGLangConfig(target.url, api_key="sk-tidelog"), session=session)
        await adapter.weight_version()
        assert await adapter.health(timeout=30) is True
    assert sent == ["Bearer sk-tidelog", "Bearer sk-tidelog"]
