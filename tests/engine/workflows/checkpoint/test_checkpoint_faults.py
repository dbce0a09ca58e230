"""Faults during a checkpoint, through the whole orchestrator on both backends: a participant that is
down, one that never answers, one that answers 500, and one whose lease expires mid-checkpoint. Each
checkpoint ends cleanly — aborted, every member resumed, every reachable participant idle — within
its deadlines, with the reason in the journal."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.workflows.checkpoint.checkpoint import start_checkpoint
from engine.runtime.service import Orchestrator
from journal import Journal, WriteTx, models
from journal.writes import to_row
from tests.support.fault_participant import FaultyParticipant
from tests.support.reference_procs import TOKEN, ParticipantClient, Procs, Stack, start_stack

KINDS = ("environment", "model", "agent", "resources")
pytestmark = pytest.mark.slow




def settings(journal_url: str, participants: dict[str, str], prepare_timeout_s: float) -> Settings:
    return Settings.model_validate({
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "control": {"token": TOKEN},
        "discovery": {"probe_timeout_s": 1, "probe_tries": 1, "interval_s": 600},
        "checkpoint": {"prepare_timeout_s": prepare_timeout_s, "commit_timeout_s": 5, "resume_timeout_s": 3},
        "participants": [{"name": n, "url": u} for n, u in participants.items()],
        "logging": {"level": "ERROR"},
    })


async def checkpoint_with(journal_url: str, stack: Stack, faulty: FaultyParticipant, directory: Path, *,
                          prepare_timeout_s: float, before: Any = None, until: str = "ck-f"
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint ``ck-f`` of the stack and ``faulty``; the row of ``until`` (``ck-f`` or a retry of
    it) once it ended, and that checkpoint's members by participant."""
    named = {f"{k}-0": stack.url(k) for k in KINDS} | {"faulty-0": faulty.url}
    orch = Orchestrator(settings(journal_url, named, prepare_timeout_s))
    await orch.start()
    p, c, m = models.participants, models.checkpoints, models.checkpoint_members
    try:
        end = time.monotonic() + 20
        while True:
            async with orch.journal.read() as conn:
                healthy = (await conn.execute(sa.select(p).where(p.c.state == "healthy"))).all()
            if len(healthy) == len(named):
                break
            assert time.monotonic() < end, "participants never became healthy"
            await asyncio.sleep(0.05)
        if before is not None:
            await before()
        members = [to_row("participants", r._mapping) for r in healthy]

        async def start(tx: WriteTx) -> None:
            await start_checkpoint(tx, "ck-f", str(directory), members)
        await orch.committer.run(start)
        end = time.monotonic() + 40
        while True:
            async with orch.journal.read() as conn:
                row = (await conn.execute(sa.select(c).where(c.c.id == until))).first()
                rows = (await conn.execute(sa.select(m).where(m.c.checkpoint_id == until))).all()
            if row is not None and row.state in ("done", "aborted", "failed"):
                return dict(row._mapping), {r.participant: dict(r._mapping) for r in rows}
            assert time.monotonic() < end, f"checkpoint {until} stuck in {None if row is None else row.state}"
            await asyncio.sleep(0.05)
    finally:
        await orch.stop()


@pytest.fixture
async def stack(procs: Procs, tmp_path: Path) -> Stack:
    return await start_stack(procs, {k: tmp_path / "state" / k for k in KINDS})


async def assert_ended_cleanly(row: dict[str, Any], members: dict[str, Any], stack: Stack,
                               controller: ParticipantClient, reason: str) -> None:
    assert row["state"] == "aborted", row
    assert "faulty-0" in row["detail"] and reason in row["detail"], row["detail"]
    assert all(m["state"] == "resumed" for m in members.values()), members
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle" and status["checkpoint_id"] is None, (kind, status)


@pytest.mark.parametrize("fault,reason", [("error", "500"), ("hang", "no reply")])
async def test_a_participant_that_fails_or_never_answers_aborts_the_checkpoint(
        journal_url: str, stack: Stack, controller: ParticipantClient, tmp_path: Path, fault: str, reason: str) -> None:
    faulty = await FaultyParticipant(fault, tmp_path / "faulty").start()
    try:
        row, members = await checkpoint_with(journal_url, stack, faulty, tmp_path / "ckpts", prepare_timeout_s=1.0)
    finally:
        await faulty.stop()
    await assert_ended_cleanly(row, members, stack, controller, reason)
    assert members["faulty-0"]["state"] == "resumed" and "prepare" in faulty.calls


async def test_a_participant_that_is_down_aborts_the_checkpoint(
        journal_url: str, stack: Stack, controller: ParticipantClient, tmp_path: Path) -> None:
    faulty = await FaultyParticipant("none", tmp_path / "faulty").start()
    row, members = await checkpoint_with(journal_url, stack, faulty, tmp_path / "ckpts", prepare_timeout_s=1.0,
                                         before=faulty.stop)
    await assert_ended_cleanly(row, members, stack, controller, "failed")
    assert members["faulty-0"]["detail"] is not None


async def test_a_lease_that_expires_mid_checkpoint_aborts_it(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    # The environment's lease lasts 0.3 s past its stage deadline; the slow resources-stage member
    # holds the orchestrator past it, so the environment resumes by itself and its commit is stale.
    model, resources = await asyncio.gather(procs.astart("model", tmp_path / "m"),
                                            procs.astart("resources", tmp_path / "r"))
    agent = await procs.astart("agent", tmp_path / "a", "--model", model.url)
    env = await procs.astart("environment", tmp_path / "e", "--agent", agent.url, "--resources", resources.url,
                             "--lease-grace-seconds", "0.3")
    stack = Stack({"environment": env, "model": model, "agent": agent, "resources": resources})
    faulty = await FaultyParticipant("slow", tmp_path / "faulty", delay_s=2.0).start()
    try:
        row, members = await checkpoint_with(journal_url, stack, faulty, tmp_path / "ckpts", prepare_timeout_s=0.5)
    finally:
        await faulty.stop()
    assert row["state"] == "aborted", row
    assert "environment-0" in row["detail"] and "stale_checkpoint" in row["detail"], row["detail"]
    assert members["environment-0"]["state"] == "resumed"
    for kind in KINDS:
        assert (await controller.status(stack.url(kind)))["phase"] == "idle"


async def test_a_failed_export_resumes_everyone_and_prepares_again_under_a_new_id(
        journal_url: str, stack: Stack, controller: ParticipantClient, tmp_path: Path) -> None:
    faulty = await FaultyParticipant("export_failed", tmp_path / "faulty", checkpoint_root=tmp_path).start()
    try:
        row, members = await checkpoint_with(journal_url, stack, faulty, tmp_path / "ckpts", prepare_timeout_s=5.0,
                                             until="ck-f-try2")
        async with Journal.open(journal_url).read() as conn:
            first = (await conn.execute(sa.select(models.checkpoints).where(models.checkpoints.c.id == "ck-f"))).one()
            retirements = (await conn.execute(sa.select(models.retirements.c.id))).scalars().all()
    finally:
        await faulty.stop()
    assert (first.state, first.retry_reason, first.blockers) == ("aborted", "export_failed", None), first
    assert "faulty-0 did not commit: HTTP 409 export_failed" in first.detail, first.detail
    assert faulty.failed_export == "ck-f"
    # The retry prepared again under its own id and was published; nothing was retired.
    assert (row["state"], row["retry_of"], row["try_number"]) == ("done", "ck-f", 2), (row["detail"], row)
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == "ck-f-try2"
    assert all(m["state"] == "resumed" for m in members.values()) and len(members) == len(KINDS) + 1
    assert retirements == []
    for kind in KINDS:
        status = await controller.status(stack.url(kind))
        assert status["phase"] == "idle" and status["checkpoint_id"] is None, (kind, status)
