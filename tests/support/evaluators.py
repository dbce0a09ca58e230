"""Evaluators of ``training.commit: evaluate`` defined only in the tests, named by import path.

Each appends what it was given to ``log`` (a JSON line per call) so a test can see the candidate and
the incumbent the gate passed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _note(log: str | None, candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> int:
    if log is None:
        return 0
    with open(log, "a") as f:
        f.write(json.dumps({"candidate": candidate, "incumbent": incumbent}) + "\n")
    return len(Path(log).read_text().splitlines())


def reject_all(candidate: dict[str, Any], incumbent: dict[str, Any] | None, *, why: str,
               log: str | None = None) -> dict[str, Any]:
    _note(log, candidate, incumbent)
    return {"decision": "reject", "reason": why, "metrics": {"eval_reward": 0.25, "episodes": 8}}


class CommitAfterAFailure:
    """Raises on its first call (logged), then commits with the candidate's step as a metric."""

    def __init__(self, log: str) -> None:
        self.log = log

    def evaluate(self, candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> dict[str, Any]:
        if _note(self.log, candidate, incumbent) == 1:
            raise RuntimeError("evaluation cluster unreachable")
        return {"decision": "commit", "reason": "better than the incumbent",
                "metrics": {"candidate_step": candidate["metrics"]["step"]}}


def malformed(candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> Any:
    return {"decision": "ship it", "reason": "looks fine"}


def slow(candidate: dict[str, Any], incumbent: dict[str, Any] | None, *, seconds: float, log: str) -> dict[str, Any]:
    """Commits after ``seconds``: longer than the gate's timeout, to show a late reply is waited for, not
    asked for twice."""
    import time
    _note(log, candidate, incumbent)
    time.sleep(seconds)
    return {"decision": "commit", "reason": "slow but sure"}
