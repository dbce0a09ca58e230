"""Fixtures of the inference-engine tests: a real engine process and adapters that talk to it.

``target`` is the engine under test, one per session:

- by default the reference engine, started as a real process
  (``python -m workers.inference.reference --port 0 --model-dir DIR --enable-test-faults``)
  serving ``Policy(seed=0)`` as version ``initial``; ``Policy(seed=1)`` saved as ``other``
  is the weights directory that changes its generations;
- with ``TIDELOG_SGLANG_URL`` set (``bench/gpu_smoke.sh``), a real SGLang server at that URL.
  Its weights path and version are read from ``/model_info``; ``TIDELOG_SGLANG_OTHER_MODEL``
  may name a second checkpoint of the same architecture. Tests that need the reference
  engine's test routes skip there, saying so.

``engine`` is a fresh :class:`SGLangEngine` per test whose HTTP requests are recorded
(``calls``: ``(method, path)`` in order) through an aiohttp trace hook on a real session.
Before each test the target is put back to its initial state through its public routes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from workers.inference import SGLangConfig, SGLangEngine

from .engines import EngineProc, Recorded, Target


def _sglang_target(url: str) -> Target:
    import json
    import urllib.request
    with urllib.request.urlopen(url.rstrip("/") + "/model_info", timeout=30) as resp:
        info = json.loads(resp.read())
    return Target(url.rstrip("/"), "sglang", str(info["model_path"]), str(info.get("weight_version")),
                  os.environ.get("TIDELOG_SGLANG_OTHER_MODEL") or None)


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    external = os.environ.get("TIDELOG_SGLANG_URL")
    if external:
        yield _sglang_target(external)
        return
    from workers.policy import Policy, save_weights
    root = tmp_path_factory.mktemp("inference")
    save_weights(Policy(seed=0), root / "initial", "initial")
    save_weights(Policy(seed=1), root / "other", "other")
    proc = EngineProc(["--port", "0", "--model-dir", str(root / "initial"), "--enable-test-faults",
                       "--health-check-timeout", "0.5"], root / "engine.log").start()
    try:
        yield Target(proc.url, "reference", str(root / "initial"), "initial", str(root / "other"),
                     log=root / "engine.log")
    finally:
        proc.kill()


async def reset(target: Target) -> None:
    """Back to the initial state through public routes: running, resident, initial weights."""
    async with aiohttp.ClientSession() as http:
        async def post(path: str, body: dict[str, Any] | None = None) -> None:
            async with http.post(target.url + path, json=body if body is not None else {},
                                 timeout=aiohttp.ClientTimeout(total=120)) as resp:
                assert resp.status == 200, f"reset: {path} answered {resp.status}: {await resp.text()}"
        if target.kind == "reference":
            await post("/slow_down", {"forward_sleep_time": None})
            await post("/resume_memory_occupation", {})
        await post("/continue_generation")
        async with http.get(target.url + "/model_info") as resp:
            version = (await resp.json())["weight_version"]
        if version != target.initial_version:
            await post("/update_weights_from_disk", {"model_path": target.initial_dir,
                                                     "weight_version": target.initial_version})


@pytest.fixture
async def recorded() -> Recorded:
    return Recorded()


@pytest.fixture
async def http(recorded: Recorded) -> AsyncIterator[aiohttp.ClientSession]:
    trace = aiohttp.TraceConfig()

    async def on_start(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                       params: aiohttp.TraceRequestStartParams) -> None:
        recorded.calls.append((params.method, params.url.path))
    trace.on_request_start.append(on_start)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        yield session


@pytest.fixture
async def engine(target: Target, http: aiohttp.ClientSession) -> AsyncIterator[SGLangEngine]:
    await reset(target)
    adapter = SGLangEngine(SGLangConfig(target.url, timeout=30.0, flush_attempts=20, flush_interval=0.05),
                           session=http)
    try:
        yield adapter
    finally:
        await adapter.close()
