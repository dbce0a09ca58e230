"""Subprocess entry point for the workflow crash harness: run the orchestrator until one workflow ends.

    python -m tests.support.workflow_worker JOURNAL_URL WORKFLOW ARGS... -- NAME=URL...

    checkpoint ID DIR [RETIRE] [rollouts=A,B,...]
                                start checkpoint ID into DIR (if the journal does not hold it yet); with
                                RETIRE (a rollout id), first retire its attempt 0 as retirement
                                ``pre-ID`` and start the checkpoint only once that retirement is done;
                                with ``rollouts=``, record those rollouts as dispatched (attempt 0,
                                by the caller's own code: the test sends their /run) in the write
                                that starts the checkpoint, since a checkpoint's scope is the journal's
    restore ID DIR CHECKPOINT [rollouts=A,B,...]
                                restore CHECKPOINT from DIR as restore ID (``rollouts=`` as for a
                                checkpoint: recorded in the write that starts it)
    retire ID ROLLOUT ATTEMPT   retire ROLLOUT up to ATTEMPT as retirement ID
    forget ID ROLLOUT           forget ROLLOUT as retirement ID
    rollouts TAG                submit the rollouts of :func:`rollout_tasks` (two that finish, one the
                                environment refuses, ``rollouts.max_failures`` 2) and run until every
                                one is ``forgotten``

Waits for every named participant to be healthy, starts the workflow if its row does not exist,
and runs until the row is terminal. ``TIDELOG_CRASH_AT`` (if set) kills it with SIGKILL right after
that commit. Every row is created only if it does not exist yet, so a run after a crash picks up
where the crashed one stopped. Exit 0 when the row is terminal; 3 on a time-out; 4 when the
retirement a checkpoint waits for failed.
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa

from engine.runtime.clock import SystemClock
from engine.config import Settings
from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.workflows.checkpoint.restore import resolve_checkpoint, start_restore
from engine.workflows.checkpoint.retirement import request_retirement
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts
from engine.runtime.service import Orchestrator, open_journal
from journal import WriteTx, models
from journal.writes import to_row
from tests.support.reference_procs import TOKEN
from workers.protocol import EpisodeId

TABLES = {"checkpoint": models.checkpoints, "restore": models.restores, "retire": models.retirements,
          "forget": models.retirements, "rollouts": models.rollouts}
TERMINAL = ("done", "aborted", "failed")


def rollout_tasks(tag: str) -> dict[str, dict[str, Any]]:
    """The ``rollouts`` workflow's tasks: two of two turns, and one the environment refuses (an
    empty prompt: a typed error every time)."""
    return {f"{tag}-g0": {"prompt": f"{tag} 0", "turns": 2}, f"{tag}-g1": {"prompt": f"{tag} 1", "turns": 2},
            f"{tag}-bad": {"prompt": "", "turns": 1}}


async def rollouts_state(conn: Any, tag: str) -> Any:
    """Like a workflow row's state: ``None`` before the submission, ``done`` once every one is forgotten."""
    ids = sorted(rollout_tasks(tag))
    t = models.rollouts
    states = dict((await conn.execute(sa.select(t.c.id, t.c.state).where(t.c.id.in_(ids)))).all())
    if not states:
        return None
    return SimpleNamespace(state="done" if all(states.get(i) == "forgotten" for i in ids) else "running")


async def main(journal_url: str, workflow: str, args: list[str], participants: dict[str, str]) -> int:
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 1.0, "lease_renew_s": 0.25, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 5},
        "dispatcher": {"poll_s": 0.2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 2, "probe_tries": 2, "interval_s": 60},
        # A test of a publish past the commit deadline shortens the prepare and commit deadlines.
        "checkpoint": {"prepare_timeout_s": float(os.environ.get("TIDELOG_WORKER_PREPARE_TIMEOUT_S", "10")),
                       "resume_timeout_s": 10,
                       "commit_timeout_s": float(os.environ.get("TIDELOG_WORKER_COMMIT_TIMEOUT_S", "20")),
                       "restore_timeout_s": 30, "retire_timeout_s": 20},
        "rollouts": {"max_failures": 2, "forget_retry_s": 0.5},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "logging": {"level": "WARNING"},
    })
    clock = SystemClock()
    journal = open_journal(settings, clock)
    orch = Orchestrator(settings, journal=journal, clock=clock)
    await orch.start()
    recorded = [rid for a in args if a.startswith("rollouts=") for rid in a.split("=", 1)[1].split(",") if rid]
    args = [a for a in args if not a.startswith("rollouts=")]
    p, t, entity_id = models.participants, TABLES[workflow], args[0]
    rt = models.retirements
    pre = f"pre-{entity_id}" if workflow == "checkpoint" and len(args) > 2 else None
    try:
        for _ in range(1200):
            async with journal.read() as conn:
                row = (await rollouts_state(conn, entity_id) if workflow == "rollouts" else
                       (await conn.execute(sa.select(t.c.state).where(t.c.id == entity_id))).first())
                healthy = (await conn.execute(sa.select(p).where(p.c.state == "healthy"))).all()
                retired = None if pre is None else (await conn.execute(
                    sa.select(rt.c.state, rt.c.detail).where(rt.c.id == pre))).first()
            if row is not None and row.state in TERMINAL:
                return 0
            if row is None and len(healthy) == len(participants) and orch.is_leader:
                if pre is not None and retired is None:  # first retire, then (once done) checkpoint
                    retirement_id, episode = pre, EpisodeId(rollout_id=args[2], attempt=0)
                    await orch.committer.run(
                        lambda tx: request_retirement(tx, retirement_id, "retire", episodes=[episode]))
                elif retired is not None and retired.state != "done":
                    if retired.state in TERMINAL:
                        print(f"retirement {pre} ended {retired.state}: {retired.detail}", file=sys.stderr)
                        return 4
                else:
                    members = [to_row("participants", r._mapping) for r in healthy]
                    await orch.committer.run(lambda tx: start(tx, workflow, args, members, recorded))
            await asyncio.sleep(0.05)
        return 3
    finally:
        await orch.stop()


async def start(tx: WriteTx, workflow: str, args: list[str], members: list[Any], recorded: list[str]) -> None:
    for rid in recorded:
        await tx.create("rollouts", rid, reason="dispatched by the caller", state="dispatched",
                        values={"attempt": 0, "task": {"prompt": f"recorded {rid}", "turns": 1}})
    if workflow == "checkpoint":
        await start_checkpoint(tx, args[0], args[1], members, max_tries=1)
    elif workflow == "restore":
        checkpoint_id, scope = resolve_checkpoint(args[1], args[2])
        await start_restore(tx, args[0], args[1], checkpoint_id, scope)
    elif workflow == "rollouts":
        await submit_rollouts(tx, [check_task({"rollout_id": rid, "input": task}, i)
                                   for i, (rid, task) in enumerate(rollout_tasks(args[0]).items())])
    elif workflow == "retire":
        await request_retirement(tx, args[0], "retire", episodes=[EpisodeId(rollout_id=args[1], attempt=int(args[2]))])
    else:
        await request_retirement(tx, args[0], "forget", rollout_ids=[args[1]])


if __name__ == "__main__":
    split = sys.argv.index("--")
    named = dict(arg.split("=", 1) for arg in sys.argv[split + 1:])
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:split], named)))
