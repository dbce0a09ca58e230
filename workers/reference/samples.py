"""The reference task's training sample: what a finished rollout of the reference environment becomes
in a training job (``training.batching.sample: workers.reference.samples:episode``).

The rollout's input is ``{"prompt", "turns"}`` and its result ``{"actions", "checks", "reward"}``
(``workers.reference.environment``). The sample is the prompt, the episode's actions joined as the
completion the policy produced (text: the reference trainer turns it into token ids with the same
tokenizer as the engine), the reward, and where it came from (rollout id and weight version). Plain
Python: the orchestrator calls it, and it must not import torch there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def episode(rollout: Mapping[str, Any]) -> dict[str, Any]:
    """The sample of one finished reference rollout; raises ``ValueError`` naming what is missing."""
    task, result = rollout.get("task"), rollout.get("result")
    if not isinstance(task, Mapping) or not isinstance(task.get("prompt"), str) or not task["prompt"]:
        raise ValueError("its input has no non-empty 'prompt'")
    if not isinstance(result, Mapping) or not isinstance(result.get("actions"), list) or not result["actions"]:
        raise ValueError("its result has no non-empty 'actions'")
    if not all(isinstance(a, str) for a in result["actions"]):
        raise ValueError("its result's 'actions' are not all text")
    return {"rollout_id": rollout["id"], "weight_version": rollout.get("weight_version"), "prompt": task["prompt"],
            "completion": "".join(result["actions"]), "reward": float(result["reward"])}


__all__ = ["episode"]
