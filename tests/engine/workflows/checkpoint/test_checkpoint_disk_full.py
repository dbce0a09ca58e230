"""A publish that cannot write its files (issue 13, defect 5), through the whole orchestrator against
the four reference participants as real processes, on both journal backends.

The checkpoint directory is a small tmpfs this test mounts (the test machines run the tests as root;
where mounting is refused the test is skipped with the reason printed). A first checkpoint is
published; during a second, right when its row reaches ``committed`` — the participants' records
are written, the manifest not yet — a commit listener in this process fills the tmpfs (or remounts
it read-only). The publish then fails: the checkpoint must end ``aborted`` within its deadlines,
the path and the OS error in ``detail`` and in its event, every participant resumed, ``LATEST``
still naming the first checkpoint, no ``checkpoint.json`` and no temporary file left behind, and
``audit.verify`` clean.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.runtime.service import Orchestrator
from journal import Committed, audit, models
from tests.support.reference_procs import ParticipantClient, Procs, start_stack
from tests.support.tmpfs import fill, mounted_tmpfs, remount_read_only
from tests.support.workflows import events, run_checkpoint, settings, state_dirs, table, until

pytestmark = pytest.mark.slow

KINDS = ("environment", "model", "agent", "resources")
#: What each way of breaking the disk makes the manifest's write fail with.
FAULTS = {"full": ("No space left on device", "ENOSPC"), "read-only": ("Read-only file system", "EROFS")}


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", "8m") as where:
        yield where


def break_disk(where: Path, fault: str) -> None:
    if fault == "full":
        assert fill(where) > 0
    else:
        remount_read_only(where)


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_publish_that_cannot_write_aborts_and_resumes_everyone(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path, tmpfs: Path, fault: str,
        caplog: pytest.LogCaptureFixture) -> None:
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=0.2)
    orch = Orchestrator(settings(journal_url, stack))
    await orch.start()
    broken: list[str] = []
    run: asyncio.Task[dict[str, Any]] | None = None

    def on_commit(committed: Sequence[Committed]) -> None:
        # Runs in the orchestrator's process right after the commit, before the publish is tried.
        if not broken and any(c.kind == "checkpoints" and c.entity_id == "ck-2" and c.to_state == "committed"
                              for c in committed):
            break_disk(tmpfs, fault)
            broken.append(fault)
    try:
        first = await run_checkpoint(orch, stack, "ck-1", tmpfs)
        assert first["state"] == "done", first
        assert (tmpfs / "LATEST").read_text() == "ck-1\n"

        # An episode in flight, so the second checkpoint holds it and its records are written.
        run = asyncio.create_task(controller.run(stack.url("environment"), "r0", {"prompt": "p", "turns": 3}))

        async def in_flight() -> bool:
            return "r0" in (await controller.status(stack.url("environment"))).get("executions", {})
        await until(in_flight)
        orch.journal.add_commit_listener(on_commit)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            row = await run_checkpoint(orch, stack, "ck-2", tmpfs)
        trail = await events(orch, "checkpoints", "ck-2")
        members = {m["participant"]: m for m in (await table(orch, models.checkpoint_members)).values()
                   if m["checkpoint_id"] == "ck-2"}
        mismatches = await audit.verify(orch.journal)
        result = await run
    finally:
        await orch.stop()
        if run is not None and not run.done():
            run.cancel()

    assert broken == [fault]
    message, code = FAULTS[fault]
    # The reason is in the row and in the event that aborted it.
    assert row["state"] == "aborted", row
    manifest = tmpfs / "ck-2" / "checkpoint.json"
    assert str(manifest) in row["detail"] and message in row["detail"] and code in row["detail"], row["detail"]
    states = [e["to_state"] for e in trail]
    assert states[-4:] == ["committing", "committed", "aborting", "aborted"], states
    aborting = trail[-2]
    assert aborting["from_state"] == "committed" and aborting["reason"] == row["detail"]
    assert aborting["payload"]["set"]["detail"] == row["detail"]
    # Within its deadlines: aborted by the commit deadline, every member resumed by the fresh one.
    commit_deadline = next(e["payload"]["set"]["deadline_ts"] for e in trail if e["from_state"] == "prepared")
    assert aborting["ts"].timestamp() <= commit_deadline
    assert trail[-1]["ts"].timestamp() <= row["deadline_ts"]
    assert all(m["state"] == "resumed" for m in members.values()), members
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle" and status["checkpoint_id"] is None, (kind, status)
    assert result["rollout_id"] == "r0" and len(result["actions"]) == 3  # the episode went on
    # Not published: LATEST still names the first checkpoint; no manifest, no temporary file.
    assert (tmpfs / "LATEST").read_text() == "ck-1\n"
    assert not manifest.exists()
    assert sorted(p.name for p in tmpfs.rglob("*.tmp")) == []
    assert (tmpfs / "ck-1" / "checkpoint.json").exists()
    assert mismatches == []
    # One log line, no traceback.
    lines = [r for r in caplog.records if "ck-2" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and message in lines[0].getMessage(), lines
