"""Subprocess entry point for the crash harness: run the orchestrator until every pipeline ends.

    python -m tests.support.pipeline_worker JOURNAL_URL TARGET_URL

``TIDELOG_CRASH_AT`` (if set) kills it with SIGKILL right after that commit.
Exit 0 when every pipeline is terminal; 3 on a time-out.
"""

from __future__ import annotations

import asyncio
import sys

import sqlalchemy as sa

from engine.runtime.clock import SystemClock
from engine.config import Settings
from engine.runtime.service import Orchestrator, open_journal
from tests.support import pipeline


async def main(journal_url: str, target: str) -> int:
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 1.0, "lease_renew_s": 0.25, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 5},
        "dispatcher": {"poll_s": 0.2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "logging": {"level": "WARNING"},
    })
    clock = SystemClock()
    journal = open_journal(settings, clock)
    pipeline.register(journal)
    orch = Orchestrator(settings, journal=journal, clock=clock,
                        controllers=[pipeline.PipelineController(target)], unbuilt=["discovery"])
    await orch.start()
    try:
        for _ in range(600):
            async with journal.read() as conn:
                open_rows = (await conn.execute(sa.select(sa.func.count()).select_from(pipeline.table)
                                                .where(pipeline.table.c.state.notin_(["done", "failed"])))).scalar()
            if open_rows == 0:
                return 0
            await asyncio.sleep(0.05)
        return 3
    finally:
        await orch.stop()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2])))
