"""The reference trainer and engine on CUDA: one short prepared check for a GPU machine.

    .venv/bin/python bench/gpu_reference.py [--steps 5]

Needs torch with CUDA and transformers (not SGLang). Without a CUDA device it says it cannot run
and exits 0. On one:

1. a ``Trainer(device="cuda")`` takes ``--steps`` optimizer steps on reference jobs (timed), saves a
   checkpoint, and a second CUDA trainer loads it and reports the same step and job;
2. the trained weights are prepared as a publication would (a Hugging Face directory);
3. a reference engine process (``python -m workers.inference.reference --device cuda``) started on
   the seed-0 weights loads them with ``update_weights_from_disk`` and a weight version, is paused,
   continued, and generates greedily for three prompts;
4. ``AutoModelForCausalLM.from_pretrained`` of the same directory on CUDA generates greedily for the
   same prompts.

It prints what it did and ends with one JSON line: the step time, whether the engine serves the
version, and whether the two generations agree token for token. Exit 1 if either check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["ab c", "the quick brown fox", "zzz"]
TOKENS = 12


async def engine_generations(url: str, directory: Path) -> tuple[str | None, list[list[int]]]:
    import aiohttp

    from workers.inference import SGLangConfig, SGLangEngine

    engine = SGLangEngine(SGLangConfig(url, timeout=60, weight_update_timeout=300))
    try:
        await engine.pause_generation("retract")
        await engine.update_weights_from_disk(str(directory), "gpu:1")
        await engine.continue_generation()
        version = await engine.weight_version()
        out = []
        async with aiohttp.ClientSession() as http:
            for prompt in PROMPTS:
                async with http.post(f"{url}/generate", json={
                        "text": prompt, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}}) as resp:
                    out.append(list((await resp.json())["output_ids"]))
        return version, out
    finally:
        await engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu_reference: cannot run here: no CUDA device visible to this interpreter; nothing checked")
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.zygote import start_server
    from tests.workers.trainer.jobs import make_job
    from workers.policy import Policy, save_weights
    from workers.trainer.worker import Trainer

    work = Path(tempfile.mkdtemp(prefix="tidelog-gpu-"))
    trainer = Trainer(seed=0, device="cuda", state_dir=str(work / "trainer"))
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        trainer.train(make_job(f"gpu-job-{step}", step))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ckpt = str(work / "last.ckpt")
    trainer.save_checkpoint(ckpt, f"gpu-job-{args.steps - 1}")
    second = Trainer(seed=0, device="cuda")
    info = second.load_checkpoint(ckpt)
    print(f"gpu_reference: {args.steps} steps on {trainer.device}, median "
          f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms; a second trainer loaded step {info['step']}")
    target = work / "weights" / "gpu-1"
    trainer.prepare_weights({"version": "gpu:1", "directory": str(target)})
    save_weights(Policy(seed=0), work / "initial", "initial")
    proc, url = start_server("workers.inference.reference", ["--port", "0", "--model-dir", str(work / "initial"),
                                                              "--device", "cuda"],
                             env=dict(os.environ), cwd=ROOT, log=work / "engine.log", timeout=300,
                             what="reference engine on cuda")
    try:
        version, served = asyncio.run(engine_generations(url, target))
    finally:
        proc.kill()
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).to("cuda")
    plain = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to("cuda")
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False)
        plain.append(seq[0, ids.shape[1]:].tolist())
    agree = plain == served
    print(f"gpu_reference: engine serves {version}; from_pretrained on cuda generates the same tokens: {agree}")
    print(json.dumps({"device": torch.cuda.get_device_name(0), "steps": args.steps,
                      "step_ms_median": round(sorted(times)[len(times) // 2] * 1e3, 2),
                      "engine_version": version, "generations_agree": agree}))
    return 0 if agree and version == "gpu:1" else 1


if __name__ == "__main__":
    sys.exit(main())
