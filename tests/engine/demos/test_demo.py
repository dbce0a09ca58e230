"""``tidelog demo`` end to end on both journal backends: real processes, the four participants the
orchestrator's stack (one configuration file), rollouts submitted and dispatched by the orchestrator,
a checkpoint mid-episode, the orchestrator SIGKILLed and its participants dying with it, a restore
that waits for the next orchestrator to bring the stack back from the journal, and every rollout
finished from its boundary as its next attempt with no environment step run again or lost (the demo
exits 1 otherwise)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from journal import Journal, models

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
    assert "its 4 of 4 participants died with it (owner loss)" in out, out
    # From the journal: each participant was launched by two owners, the first one's run ended by its
    # death, and the restore picked its members only once every service was ready again.
    events = asyncio.run(_events(journal_url))
    for kind in ("environment", "model", "agent", "resources"):
        mine = [(a, b, reason) for k, name, a, b, reason, _ in events if k == "services" and name == kind]
        assert [b for _, b, _ in mine].count("starting") == 2, mine
        assert any(a == "ready" and b == "failed" and "owner lease" in reason for a, b, reason in mine), mine
    # The restore went on only once the next orchestrator's stack was whole: the first moment after
    # its request at which every service was ready again (a later rebuild, by the health monitor or a
    # lease lost on a loaded machine, does not move it).
    requested = next(seq for k, name, _, b, _, seq in events if k == "restores" and b == "restoring")
    up: set[str] = set()
    whole = None
    for k, name, _, b, _, seq in events:
        if k == "services" and seq > requested and b == "ready":
            up.add(name)
            if len(up) == 4:
                whole = seq
                break
    resumed = next(seq for k, name, _, b, _, seq in events if k == "restores" and b == "resuming")
    assert whole is not None and resumed > whole, events


async def _events(url: str) -> list[tuple[str, str, str | None, str, str, int]]:
    journal = Journal.open(url)
    try:
        e = models.events
        async with journal.read() as conn:
            rows = (await conn.execute(sa.select(e.c.entity_kind, e.c.entity_id, e.c.from_state, e.c.to_state,
                                                 e.c.reason, e.c.seq).where(
                e.c.entity_kind.in_(("services", "restores"))).order_by(e.c.seq))).all()
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]
    finally:
        await journal.dispose()
