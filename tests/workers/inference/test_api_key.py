"""The SGLang adapter against a keyed engine and an older one, real reference engine processes on loopback:

- ``--api-key-env`` (the key from the environment, as SGLang's ``--api-key``): a call without the
  key is refused 401 (and the adapter says so without the key in its message), the health path
  needs none, the adapter configured with the key drives it; the key is in no repr.
- ``--legacy-model-info`` (only ``/get_model_info``, as older SGLang builds): ``model_info`` falls
  back to it, remembers it, and ``weight_version`` reads through it.
- the orchestrator's configuration: an engine's ``api_key`` or ``TIDELOG_ENGINE_API_KEY`` reaches the
  adapter, and an invalid key value is never echoed in a configuration error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from engine.config import ConfigError, Settings, load
from engine.workflows.training.wiring import build_training
from tests.workers.inference.engines import EngineProc
from workers.inference import EngineCallError, SGLangConfig, SGLangEngine
from workers.policy import Policy, save_weights

KEY = "sk-reference-engine-0123456789"


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    save_weights(Policy(seed=0), tmp_path / "initial", "initial")
    return tmp_path / "initial"


@pytest.fixture
def keyed(tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineProc]:
    monkeypatch.setenv("ENGINE_KEY_FOR_TEST", KEY)
    proc = EngineProc(["--port", "0", "--model-dir", str(weights), "--api-key-env", "ENGINE_KEY_FOR_TEST"],
                      tmp_path / "keyed.log").start()
    try:
        yield proc
    finally:
        proc.kill()


async def test_a_keyed_engine_refuses_calls_without_the_key_and_serves_them_with_it(keyed: EngineProc) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{keyed.url}/health") as resp:
            assert resp.status == 200  # health needs no key, as SGLang's
        async with http.get(f"{keyed.url}/model_info", headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}
    bare = SGLangEngine(SGLangConfig(keyed.url, timeout=10))
    try:
        with pytest.raises(EngineCallError) as refused:
            await bare.pause_generation("retract")
        assert refused.value.status == 401 and KEY not in str(refused.value)
    finally:
        await bare.close()
    config = SGLangConfig(keyed.url, timeout=10, api_key=KEY)
    assert KEY not in repr(config)
    engine = SGLangEngine(config)
    try:
        await engine.pause_generation("retract")
        assert await engine.weight_version() == "initial"
        await engine.continue_generation()
    finally:
        await engine.close()


async def test_an_older_engine_is_asked_its_model_info_at_get_model_info(tmp_path: Path, weights: Path) -> None:
    proc = EngineProc(["--port", "0", "--model-dir", str(weights), "--legacy-model-info"],
                      tmp_path / "legacy.log").start()
    paths: list[str] = []

    async def sent(_session: Any, _ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams) -> None:
        paths.append(params.url.path)
    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(sent)
    async with aiohttp.ClientSession(trace_configs=[trace]) as http:
        engine = SGLangEngine(SGLangConfig(proc.url, timeout=10), session=http)
        try:
            info = await engine.model_info()
            assert info["weight_version"] == "initial" and info["model_path"] == str(weights)
            assert await engine.weight_version() == "initial"
        finally:
            await engine.close()
            proc.kill()
    # /model_info is not there (404); the adapter falls back once and then asks the old path only.
    assert paths == ["/model_info", "/get_model_info", "/get_model_info"]


def test_the_configured_key_reaches_the_adapter_and_is_never_echoed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"enabled": True, "engines": [{"name": "a", "url": "http://127.0.0.1:9", "api_key": "own-key"},
                                         {"name": "b", "url": "http://127.0.0.1:10"}]}
    monkeypatch.delenv("TIDELOG_ENGINE_API_KEY", raising=False)
    engines = build_training(Settings.model_validate({"training": base})).engines
    assert [e.config.api_key for e in engines.values()] == ["own-key", None]  # type: ignore[attr-defined]
    monkeypatch.setenv("TIDELOG_ENGINE_API_KEY", KEY)
    engines = build_training(Settings.model_validate({"training": base})).engines
    assert [e.config.api_key for e in engines.values()] == ["own-key", KEY]  # type: ignore[attr-defined]
    path = tmp_path / "c.yaml"
    # A key YAML reads as a number is refused, and its digits are not echoed in the error.
    path.write_text("training:\n  engines:\n  - {name: a, url: 'http://h:1', api_key: 98765432109876}\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert "training.engines.0.api_key" in str(err.value) and "98765432109876" not in str(err.value)
