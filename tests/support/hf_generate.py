"""Greedy generation with plain ``transformers`` from a weights directory, in a process of its own.

    python -m tests.support.hf_generate DIRECTORY MAX_NEW_TOKENS PROMPT...

loads ``AutoTokenizer`` and ``AutoModelForCausalLM`` with ``from_pretrained(DIRECTORY)`` (nothing of
Tidelog is imported) and prints one JSON object: per prompt, the generated token ids and text
(``generate(do_sample=False)``), and the model's class name. :func:`hf_generate` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def hf_generate(directory: str | Path, prompts: list[str], max_new_tokens: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.support.hf_generate", str(directory), str(max_new_tokens),
                           *prompts], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(directory: str, max_new_tokens: str, *prompts: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    out: dict[str, Any] = {"class": type(model).__name__, "generated": []}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(max_new_tokens),
                                 do_sample=False)
        new = seq[0, ids.shape[1]:].tolist()
        out["generated"].append({"prompt_ids": ids[0].tolist(), "ids": new, "text": tokenizer.decode(new)})
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
