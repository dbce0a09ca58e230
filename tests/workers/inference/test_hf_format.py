"""The reference model in Hugging Face format (workers/policy.py): a directory a trainer prepares for a
publication loads with ``transformers``' ``from_pretrained`` in a separate process and generates, greedily,
the same tokens as a real reference engine process serving it after ``update_weights_from_disk`` (the
call a publication makes); the tokenizer saved with it gives the task's ids."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.support.hf_generate import hf_generate
from tests.workers.inference.engines import EngineProc
from tests.workers.trainer.jobs import make_job
from workers.inference import SGLangConfig, SGLangEngine
from workers.policy import HF_FILES, META_FILE, Policy, build_tokenizer, decode, encode, save_weights
from workers.trainer.worker import Trainer

PROMPTS = ["ab c", "the quick brown fox", "zzz"]
N = 12


def test_the_tokenizer_gives_the_tasks_ids() -> None:
    tokenizer = build_tokenizer()
    for text in ("ab c", "Hello, World!", "   ", "xyz q"):
        assert tokenizer(text)["input_ids"] == encode(text)
        assert tokenizer.decode(encode(text)) == decode(encode(text))


@pytest.mark.slow
async def test_published_weights_load_with_from_pretrained_and_generate_what_the_engine_serves(
        tmp_path: Path) -> None:
    trainer = Trainer(seed=0)
    trainer.train(make_job("job-1"))
    target = tmp_path / "weights" / "abc-1"
    trainer.prepare_weights({"version": "abc:1", "directory": str(target)})
    assert sorted(p.name for p in target.iterdir()) == sorted([*HF_FILES, META_FILE])
    save_weights(Policy(seed=0), tmp_path / "initial", "initial")
    proc = EngineProc(["--port", "0", "--model-dir", str(tmp_path / "initial")], tmp_path / "engine.log").start()
    engine = SGLangEngine(SGLangConfig(proc.url, timeout=30, weight_update_timeout=60))
    try:
        await engine.update_weights_from_disk(str(target), "abc:1")
        assert await engine.weight_version() == "abc:1"
        served = []
        async with aiohttp.ClientSession() as http:
            for prompt in PROMPTS:
                async with http.post(f"{proc.url}/generate", json={
                        "text": prompt, "sampling_params": {"max_new_tokens": N, "temperature": 0}}) as resp:
                    assert resp.status == 200
                    served.append((await resp.json())["output_ids"])
    finally:
        await engine.close()
        proc.kill()
    plain = hf_generate(target, PROMPTS, N)
    assert plain["class"] == "LlamaForCausalLM"
    assert [g["prompt_ids"] for g in plain["generated"]] == [encode(p) for p in PROMPTS]
    assert [g["ids"] for g in plain["generated"]] == served
    assert [g["text"] for g in plain["generated"]] == [decode(ids) for ids in served]
    # The trained step moved the weights: the initial model generates something else for some prompt.
    initial = hf_generate(tmp_path / "initial", PROMPTS, N)
    assert [g["ids"] for g in initial["generated"]] != served
