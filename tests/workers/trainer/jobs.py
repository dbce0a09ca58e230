"""Jobs of the reference task for the trainer tests: real batches, built deterministically."""

from __future__ import annotations

from typing import Any

from workers.policy import encode


def make_job(job_id: str, salt: int = 0) -> dict[str, Any]:
    """A batch of four scored rollouts; the reward favours completions rich in ``a``."""
    completions = ["aab", "bca", "aaa", "cab"]
    rollouts = []
    for index, text in enumerate(completions):
        completion = encode(text)
        completion[0] = (completion[0] + salt) % 27
        rollouts.append({"prompt": "ab c", "completion": completion,
                         "reward": float(text.count("a")) - 0.25 * index})
    return {"job_id": job_id, "rollouts": rollouts, "scenario_step": 3}
