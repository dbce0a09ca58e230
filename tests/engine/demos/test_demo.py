"""``tidelog demo`` end to end on both journal backends: real processes, rollouts submitted and
dispatched by the orchestrator, a checkpoint mid-episode, the orchestrator and every participant
SIGKILLed, a restore, and every rollout finished from its boundary as its next attempt with no
environment step run again or lost (the demo exits 1 otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def test_the_demo_continues_every_episode_without_repeating_a_step(journal_url: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "engine.cli", "demo", "--workdir", str(tmp_path / "demo"),
                           "--journal-url", journal_url, "--episodes", "3", "--turns", "3", "--step-delay", "0.2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "episodes continued from their checkpointed boundary: 3 of 3" in out, out
    assert "steps run again or lost: 0" in out
    kept, ran = (int(x) for x in out.split("environment steps: ")[1].split(" kept by the checkpoint, ")[0:1]
                 + [out.split(" kept by the checkpoint, ")[1].split(" run after")[0]])
    assert kept + ran == 3 * (2 * 3 + 1)  # every step of every episode, once
    assert "SELECT seq, ts, entity_kind" in out
