"""``tidelog replay``: from the events alone, what was in flight when the leader died and what the next
leader did about each entity. First on a journal written by hand under two fenced epochs (lapsed and
released hand-overs, no hand-over at all), then after a real crash: the orchestrator SIGKILLed in the
middle of a checkpoint (``TIDELOG_CRASH_AT``) against the reference participants, and restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from engine.runtime.leader import LEASE_NAME
from engine.cli.replay import render, replay
from journal import Journal, lease
from tests.engine.workflows.checkpoint.test_checkpoint_crash_points import KINDS, run_worker
from tests.support.journal_state import FakeClock
from tests.support.reference_procs import Procs, start_stack
from tests.support.workflows import state_dirs
from tests.support.zygote import shared



def tidelog(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TIDELOG_CONFIG"}
    return shared().call("engine.cli", ["--config", str(config), *args], env=env, timeout=60)


def config_for(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "tidelog.yaml"
    path.write_text(yaml.safe_dump({"journal": {"url": url}, "logging": {"level": "WARNING"}}))
    return path


async def two_epochs(journal: Journal, clock: FakeClock, *, graceful: bool) -> None:
    """Epoch 1 starts three participants and two calls; epoch 2 takes over and settles some of them."""
    first = await lease.acquire(journal, LEASE_NAME, "old-leader", 5.0)
    assert first is not None
    f1 = first.fence()
    async with journal.write(f1) as tx:
        for name in ("p-a", "p-b"):
            await tx.create("participants", name, reason="configured", values={"url": f"http://{name}:1"})
        await tx.create("retirements", "rt-1", reason="forget requested",
                        values={"op": "forget", "rollout_ids": ["r1"]})
        await tx.create("retirements", "rt-done", reason="forget requested",
                        values={"op": "forget", "rollout_ids": ["r2"]})
    clock.advance(1)
    async with journal.write(f1) as tx:
        await tx.transition("participants", "p-a", from_state="pending", version=1, to_state="healthy",
                            reason="status ok")
        await tx.transition("retirements", "rt-done", from_state="queued", version=1, to_state="running",
                            reason="no checkpoint open")
        await tx.transition("retirements", "rt-done", from_state="running", version=2, to_state="done",
                            reason="forget applied everywhere")
    if graceful:
        assert await lease.release(journal, f1)
    else:
        clock.advance(10)  # its lease lapses: it died
    second = await lease.acquire(journal, LEASE_NAME, "new-leader", 5.0)
    assert second is not None and second.epoch == first.epoch + 1
    f2 = second.fence()
    clock.advance(0.5)
    async with journal.write(f2) as tx:
        await tx.transition("retirements", "rt-1", from_state="queued", version=1, to_state="running",
                            reason="no checkpoint open")
    clock.advance(0.25)
    async with journal.write(f2) as tx:
        await tx.transition("retirements", "rt-1", from_state="running", version=2, to_state="done",
                            reason="forget applied everywhere")
        await tx.transition("participants", "p-b", from_state="pending", version=1, to_state="unreachable",
                            reason="no answer")
        await tx.create("participants", "p-new", reason="configured", values={"url": "http://p-new:1"})


async def test_replay_of_a_lapsed_leader(make_journal: Callable[..., Journal], journal_url: str,
                                         clock: FakeClock, tmp_path: Path) -> None:
    journal = make_journal(clock=clock)
    assert (await replay(journal)).note.startswith("no leadership change in the journal: no leader")
    await two_epochs(journal, clock, graceful=False)
    report = await replay(journal)
    h = report.handover
    assert h is not None
    assert (h.previous_epoch, h.previous_holder, h.new_epoch, h.new_holder, h.ended) == (
        1, "old-leader", 2, "new-leader", "lapsed")
    assert h.previous_expired_at is not None
    got = {(x.kind, x.entity_id): x for x in report.entities}
    # Non-terminal at epoch 1's last event: both participants and rt-1 (rt-done had ended; p-new came later).
    assert list(got) == [("participants", "p-a"), ("participants", "p-b"), ("retirements", "rt-1")]
    assert [(s.from_state, s.to_state, s.epoch) for s in got[("retirements", "rt-1")].after] == [
        ("queued", "running", 2), ("running", "done", 2)]
    assert got[("retirements", "rt-1")].state == "queued" and got[("retirements", "rt-1")].terminal_now
    assert got[("participants", "p-a")].after == [] and got[("participants", "p-a")].current_state == "healthy"
    assert got[("participants", "p-b")].current_state == "unreachable"
    assert h.cutoff_seq == h.taken_over.seq - 1  # the last event epoch 1 wrote (rt-done's end)
    only = await replay(journal, kind="retirements")
    assert [x.entity_id for x in only.entities] == ["rt-1"]
    text = render(report)
    assert "epoch 1 (old-leader) -> epoch 2 (new-leader)" in text and "died: its lease lapsed" in text
    assert "retirements:rt-1  was queued" in text and "queued -> running" in text and "now done" in text
    assert "participants:p-a  was healthy" in text and "epoch 2 wrote nothing for it; now healthy" in text

    cfg = config_for(tmp_path, journal_url)
    res = tidelog(cfg, "replay", "--json")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["handover"]["ended"] == "lapsed" and body["handover"]["new_epoch"] == 2
    assert [(e["kind"], e["entity_id"], e["state"], e["current_state"]) for e in body["in_flight"]] == [
        ("participants", "p-a", "healthy", "healthy"), ("participants", "p-b", "pending", "unreachable"),
        ("retirements", "rt-1", "queued", "done")]
    assert [s["to_state"] for s in body["in_flight"][2]["after"]] == ["running", "done"]
    res = tidelog(cfg, "replay")
    assert res.returncode == 0 and "retirements:rt-1  was queued" in res.stdout, res.stderr
    res = tidelog(cfg, "replay", "--epoch", "7")
    assert res.returncode == 2 and "--epoch 7: no take-over into this epoch" in res.stderr
    res = tidelog(cfg, "replay", "--kind", "widgets")
    assert res.returncode == 2 and "--kind 'widgets': not an entity kind" in res.stderr


async def test_replay_of_a_graceful_handover_and_of_a_single_leader(
        make_journal: Callable[..., Journal], clock: FakeClock) -> None:
    journal = make_journal(clock=clock)
    first = await lease.acquire(journal, LEASE_NAME, "only", 5.0)
    assert first is not None
    assert (await replay(journal)).note == "no leadership change in the journal: epoch 1 is the only one"
    assert await lease.release(journal, first.fence())
    clock.advance(1)
    await two_epochs(journal, clock, graceful=True)  # epochs 2 and 3
    report = await replay(journal)
    assert report.handover is not None and report.handover.ended == "released"
    assert (report.handover.previous_epoch, report.handover.new_epoch) == (2, 3)
    assert "released the lease (a graceful stop)" in render(report)
    # The earlier hand-over (1 -> 2): epoch 1 wrote nothing, so nothing was in flight.
    earlier = await replay(journal, epoch=2)
    assert earlier.handover is not None and earlier.handover.ended == "released" and earlier.entities == []


@pytest.mark.slow
async def test_replay_after_the_orchestrator_is_killed_mid_checkpoint(
        journal_url: str, procs: Procs, tmp_path: Path) -> None:
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=0.1)
    # SIGKILL right after the checkpoint moved to committing, then a clean restart finishes it.
    args = ["ck-crash", str(tmp_path / "ckpts")]
    codes = [await run_worker(journal_url, stack, "checkpoint", args, "checkpoints:prepared->committing")]
    codes.append(await run_worker(journal_url, stack, "checkpoint", args, None))
    assert codes == [-signal.SIGKILL, 0]
    assert (tmp_path / "ckpts" / "LATEST").read_text().strip() == "ck-crash"

    cfg = config_for(tmp_path, journal_url)
    # The take-over into epoch 2, by name: the workers' lease lasts 1 s, so on a loaded machine the
    # second leader may lose it once and take it again (epoch 3), which is not what this asks about.
    res = await asyncio.to_thread(tidelog, cfg, "replay", "--json", "--epoch", "2")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    h = body["handover"]
    assert (h["previous_epoch"], h["new_epoch"], h["ended"]) == (1, 2, "lapsed"), h
    flight = {(e["kind"], e["entity_id"]): e for e in body["in_flight"]}
    ck = flight[("checkpoints", "ck-crash")]
    # What was in flight when it died: the checkpoint, just moved to committing...
    assert ck["state"] == "committing" and ck["since"]["epoch"] == 1 and ck["since"]["seq"] <= h["cutoff_seq"]
    # ...and what the next leader did about it: the rest of the checkpoint, to done.
    assert [s["to_state"] for s in ck["after"]] == ["committing", "committed", "published", "resuming",
                                                   "done"], ck["after"]
    # Every step after it is a later leader's (2, or 3 after such a lapse), none the dead one's.
    assert all(s["epoch"] >= 2 for s in ck["after"]) and ck["current_state"] == "done" and ck["terminal_now"]
    members = {k[1]: e for k, e in flight.items() if k[0] == "checkpoint_members"}
    assert set(members) == {f"ck-crash/{k}-0" for k in KINDS}
    # The commit that moved the checkpoint to committing sent no call yet (the next look reads the
    # scope from the journal and commits it everywhere at once): every member was still prepared.
    assert {k: m["state"] for k, m in members.items()} == {f"ck-crash/{k}-0": "prepared" for k in KINDS}, members
    assert all(m["current_state"] == "resumed" for m in members.values()), members
    assert all(e["current_state"] in ("healthy",) for k, e in flight.items() if k[0] == "participants")
    assert not any(k[0] == "rpc_calls" and e["terminal_now"] is False for k, e in flight.items())

    res = await asyncio.to_thread(tidelog, cfg, "replay", "--kind", "checkpoints", "--epoch", "2")
    assert res.returncode == 0, res.stderr
    assert "epoch 1  died: its lease lapsed" in res.stdout
    assert "checkpoints:ck-crash  was committing" in res.stdout and "now done" in res.stdout
    assert "committed -> published" in res.stdout and "resuming -> done" in res.stdout
    assert "checkpoint_members" not in res.stdout
