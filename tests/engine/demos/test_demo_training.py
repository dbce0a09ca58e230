"""The RL demo end to end (``tidelog demo-train``): real processes, an mp trainer, a
reference engine behind the commit gate, rollouts batched into jobs by the orchestrator
(``training.batching``), the orchestrator SIGKILLed twice and the trainer once.

The run must end with the reward risen, every job ``COMPLETE`` with trainer steps 1..N, the
trainer's persisted step counter at N and ``tidelog verify`` clean (the demo exits 1 otherwise) —
and, because sampling is seeded and training deterministic on the CPU, with the same reward per
round and bitwise the same published weights as the same loop run in this process with no
orchestrator, no journal and no crash (:func:`in_process`): nothing was lost or applied twice.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from journal import Journal, models

from workers.inference.serving import ReferenceEngineState
from workers.policy import MODEL_FILE, Policy, encode, save_weights
from workers.reference.model import engine_prompt, sampling_seed
from workers.reference.resources import checker
from workers.trainer.worker import Trainer

ROOT = Path(__file__).resolve().parents[3]
ROUNDS = 6
EPISODES, TURNS, TASK = 8, 3, "letter:s"  # the demo's defaults
pytestmark = pytest.mark.slow


def demo(workdir: Path, *extra: str) -> str:
    done = subprocess.run([sys.executable, "-m", "engine.cli", "demo-train", "--workdir", str(workdir),
                           "--rounds", str(ROUNDS), *extra], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rewards(out: str) -> list[float]:
    found = re.search(r"\(per round: ([0-9. ]+)\)", out)
    assert found, out
    return [float(x) for x in found.group(1).split()]


def digest(out: str) -> str:
    found = re.search(r"weights published last: sha256 ([0-9a-f]{64})", out)
    assert found, out
    return found.group(1)


async def in_process(tmp: Path) -> tuple[list[float], str]:
    """The demo's loop with no processes: the same prompts, seeded samples, checks and batches, on
    one trainer and an engine state holding its weights. Per-round rewards and the final weights'
    digest (of ``model.pt``, as ``weights.json`` records it)."""
    trainer, check, rewards = Trainer(seed=0), checker(TASK), []
    for r in range(ROUNDS):
        policy = Policy()
        policy.load_state_dict(trainer.model.state_dict())
        engine = ReferenceEngineState(policy, "v", "v")
        rollouts: list[dict[str, Any]] = []
        for k in range(EPISODES):
            prompt = f"round {r} task {k}"
            messages, actions = [{"role": "user", "content": prompt}], []
            for _ in range(TURNS):
                out = await engine.generate(engine_prompt(messages), None, 6, temperature=1.0,
                                            seed=sampling_seed(messages))
                actions.append(out["text"])
                messages.append({"role": "assistant", "content": out["text"]})
            reward = sum(check(a) for a in actions) / TURNS
            rollouts.append({"prompt": encode(prompt), "completion": encode("".join(actions)), "reward": reward})
        rewards.append(round(sum(x["reward"] for x in rollouts) / EPISODES, 2))
        trainer.train({"job_id": f"round-{r}", "scenario_step": r, "rollouts": rollouts})
    save_weights(trainer.model, tmp, "final")
    return rewards, hashlib.sha256((tmp / MODEL_FILE).read_bytes()).hexdigest()


async def test_the_rl_demo_learns_through_crashes_applying_every_step_once(journal_url: str,
                                                                           tmp_path: Path) -> None:
    out = demo(tmp_path / "demo", "--journal-url", journal_url)
    per_round = rewards(out)
    assert len(per_round) == ROUNDS
    assert sum(per_round[-2:]) > sum(per_round[:2]), per_round  # the reward rises
    assert f"jobs COMPLETE: {ROUNDS} of {ROUNDS}; their trainer steps: 1..{ROUNDS}, each once" in out
    assert f"trainer step counter (step.json): {ROUNDS} (" in out and "== jobs COMPLETE: True" in out
    assert "crashes: 3" in out
    assert out.count("! orchestrator SIGKILLed by its crash hook") == 2 and "! trainer SIGKILLed" in out
    # The fleet is each orchestrator's stack: launched by all three, the first two runs ended by
    # their owner's death (the engine gate put each fresh engine on the head: the rounds above). A
    # leader that lost its lease under load stops its stack and brings it up again when it leads
    # again: one launch more, and the demo still holds.
    services = await _service_events(journal_url)
    for name in ("engine", "model", "agent", "resources", "environment"):
        mine = [(b, reason) for n, b, reason in services if n == name]
        assert [b for b, _ in mine].count("starting") >= 3, mine
        assert sum(1 for b, reason in mine if b == "failed" and "owner lease" in reason) >= 2, mine
    # Every round's rollouts were one batch, submitted by the orchestrator (the demo submits no job);
    # the jobs the crashes interrupted were finished by the next orchestrator, not trained again.
    assert [int(n) for n in re.findall(r"\(batch b(\d+);", out)] == list(range(ROUNDS)), out
    assert out.count("finished by the next orchestrator") == 2 and "trainer killed" in out, out
    assert "tidelog verify: clean" in out
    assert "FROM events WHERE entity_kind = 'training_jobs'" in out and "FROM training_batches" in out
    # Crashes changed nothing: the same actions, rewards and weights as the loop without any.
    assert (per_round, digest(out)) == await in_process(tmp_path / "reference")


async def _service_events(url: str) -> list[tuple[str, str, str]]:
    journal = Journal.open(url)
    try:
        e = models.events
        async with journal.read() as conn:
            rows = (await conn.execute(sa.select(e.c.entity_id, e.c.to_state, e.c.reason).where(
                e.c.entity_kind == "services").order_by(e.c.seq))).all()
        return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await journal.dispose()
