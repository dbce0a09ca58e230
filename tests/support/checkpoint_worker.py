"""Subprocess entry point for the checkpoint crash harness: run the orchestrator until a checkpoint ends.

    python -m tests.support.checkpoint_worker JOURNAL_URL CHECKPOINT_DIR CHECKPOINT_ID NAME=URL...

Waits for every named participant to be healthy, starts the checkpoint if the journal does not hold
it yet, and runs until it is terminal. ``TIDELOG_CRASH_AT`` (if set) kills it with SIGKILL right
after that commit. Exit 0 when the checkpoint is terminal; 3 on a time-out.
"""

from __future__ import annotations

import asyncio
import sys

import sqlalchemy as sa

from engine.clock import SystemClock
from engine.config import Settings
from engine.controllers.checkpoint import start_checkpoint
from engine.service import Orchestrator, open_journal
from journal import WriteTx, models
from journal.writes import to_row
from tests.support.reference_procs import TOKEN


async def main(journal_url: str, checkpoint_dir: str, checkpoint_id: str, participants: dict[str, str]) -> int:
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 1.0, "lease_renew_s": 0.25, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 5},
        "dispatcher": {"poll_s": 0.2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 60},
        "checkpoint": {"prepare_timeout_s": 10, "commit_timeout_s": 20, "resume_timeout_s": 10},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "logging": {"level": "WARNING"},
    })
    clock = SystemClock()
    journal = open_journal(settings, clock)
    orch = Orchestrator(settings, journal=journal, clock=clock)
    await orch.start()
    p, c = models.participants, models.checkpoints
    try:
        for _ in range(1200):
            async with journal.read() as conn:
                row = (await conn.execute(sa.select(c.c.state).where(c.c.id == checkpoint_id))).first()
                healthy = (await conn.execute(sa.select(p).where(p.c.state == "healthy"))).all()
            if row is not None and row.state in ("done", "aborted", "failed"):
                return 0
            if row is None and len(healthy) == len(participants) and orch.is_leader:
                members = [to_row("participants", r._mapping) for r in healthy]

                async def start(tx: WriteTx) -> None:
                    await start_checkpoint(tx, checkpoint_id, checkpoint_dir, members)
                await orch.committer.run(start)
            await asyncio.sleep(0.05)
        return 3
    finally:
        await orch.stop()


if __name__ == "__main__":
    named = dict(arg.split("=", 1) for arg in sys.argv[4:])
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], named)))
