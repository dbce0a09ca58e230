"""Managed recovery of the stack on real processes, both journal backends, the policy on virtual
time: a service SIGKILLed once the stack was ready removes readiness, the stack is stopped and
rebuilt after 1, 2 and 4 s (virtual), and the fourth failure within five minutes stops the
supervisor with readiness absent and the reason in the journal; past the window, rebuilds are
allowed again. The stack runs in this process (``Stack.run`` with an unfenced journal write), so the
clock is the test's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from journal import Journal, WriteTx, models

from engine.config import Settings
from engine.runtime.clock import VirtualClock
from engine.runtime.service import open_journal
from engine.workflows.deployment.plan import Plan
from engine.runtime.restarts import RestartPolicy
from engine.config.deployment import DeploymentSettingsModel
from engine.workflows.deployment.stack import Stack

from tests.engine.workflows.deployment.test_stack import alive, gone_soon, service

pytestmark = pytest.mark.slow


async def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not {what} within {timeout} s"
        await asyncio.sleep(0.02)


async def rows(journal: Journal) -> dict[str, dict[str, Any]]:
    t = models.services
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(t))).all()}


def writer(journal: Journal) -> Callable[[Callable[[WriteTx], Awaitable[Any]]], Awaitable[Any]]:
    async def write(step: Callable[[WriteTx], Awaitable[Any]]) -> Any:
        async with journal.write() as tx:
            return await step(tx)
    return write


def test_the_policy_counts_rebuilds_within_its_window() -> None:
    p = RestartPolicy(3, 300.0, (1.0, 2.0, 4.0))
    assert [p.allow(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert p.allow(299.0) is None  # the fourth failure within five minutes
    assert p.allow(300.5) == 4.0  # the first rebuild (t=0) left the window; two remain in it
    assert p.allow(301.0) is None
    assert RestartPolicy(0).allow(0.0) is None  # fail-stop
    assert "exceeded 3 restarts within 300 s" in p.refusal()


async def test_rebuilds_within_the_policy_then_the_supervisor_stops(journal_url: str, tmp_path: Path) -> None:
    clock = VirtualClock()
    settings = DeploymentSettingsModel.model_validate({
        "run_dir": str(tmp_path / "run"), "stop_grace_s": 5,
        "services": {"a": service(tmp_path, "a", "--child"), "b": service(tmp_path, "b", depends_on=["a"])}})
    journal = open_journal(Settings.model_validate({"journal": {"url": journal_url}}), clock)
    stack = Stack(Plan.build(settings), "test-owner", clock)
    task = asyncio.create_task(stack.run(writer(journal)))
    try:
        await until(lambda: stack.state == "ready", "ready")
        seen: list[int] = []
        for n, delay in enumerate((1.0, 2.0, 4.0), start=1):
            record = json.loads((tmp_path / "a.json").read_text())
            seen += [record["pid"], record["child"]]
            os.kill(record["pid"], signal.SIGKILL)
            await until(lambda: stack.rebuild_at is not None, f"waiting for rebuild {n}")
            # Readiness is absent while the stack is rebuilt; every old process is gone first.
            assert stack.not_ready() is not None and "service a failed: exited with code 137" in stack.not_ready()
            assert gone_soon(seen, 1.0) == []
            found = await rows(journal)
            assert found["a"]["state"] == "restarting" and found["a"]["restarts"] == n
            assert found["b"]["state"] == "pending"
            await asyncio.sleep(0.3)
            assert stack.state == "recovering", "the rebuild did not wait for its delay"
            await clock.advance(delay)
            await until(lambda: stack.state == "ready", f"ready after rebuild {n}")
            assert json.loads((tmp_path / "a.json").read_text())["pid"] not in seen
        # The fourth failure within five minutes (7 s of virtual time so far).
        record = json.loads((tmp_path / "a.json").read_text())
        os.kill(record["pid"], signal.SIGKILL)
        await until(lambda: stack.state == "failed", "stopped")
        assert "exceeded 3 restarts within 300 s (deployment.recovery): the supervisor stopped" in str(stack.not_ready())
        found = await rows(journal)
        assert found["a"]["state"] == "failed" and "exceeded 3 restarts" in found["a"]["detail"]
        assert found["b"]["state"] == "stopped"
        b = json.loads((tmp_path / "b.json").read_text())
        assert gone_soon([record["pid"], record["child"], b["pid"]]) == []
        # An operator brings it up again; past the window, a failure is rebuilt again.
        stack.request("up")
        await until(lambda: stack.state == "ready", "up again")
        await clock.advance(301.0)
        record = json.loads((tmp_path / "a.json").read_text())
        os.kill(record["pid"], signal.SIGKILL)
        await until(lambda: stack.rebuild_at is not None, "a rebuild past the window")
        await clock.advance(1.0)
        await until(lambda: stack.state == "ready", "ready past the window")
        assert (await rows(journal))["a"]["restarts"] == 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await journal.dispose()
    a = json.loads((tmp_path / "a.json").read_text())
    assert gone_soon([a["pid"], a["child"]]) == [] and not alive(a["pid"])


async def test_a_rebuild_that_cannot_start_stops_the_supervisor(journal_url: str, tmp_path: Path) -> None:
    clock = VirtualClock()
    flag = tmp_path / "broken"
    # b starts only while the flag file is absent: its rebuild fails at once.
    b = {"command": [sys.executable, "-c", f"import os, sys, time; sys.exit(5) if os.path.exists({str(flag)!r}) "
                                           f"else time.sleep(600)"]}
    settings = DeploymentSettingsModel.model_validate({
        "run_dir": str(tmp_path / "run"), "services": {"a": service(tmp_path, "a"), "b": b}})
    journal = open_journal(Settings.model_validate({"journal": {"url": journal_url}}), clock)
    stack = Stack(Plan.build(settings), "test-owner", clock)
    task = asyncio.create_task(stack.run(writer(journal)))
    try:
        await until(lambda: stack.state == "ready", "ready")
        flag.touch()
        os.kill(json.loads((tmp_path / "a.json").read_text())["pid"], signal.SIGKILL)
        await until(lambda: stack.rebuild_at is not None, "waiting for the rebuild")
        await clock.advance(1.0)
        await until(lambda: stack.state == "failed", "stopped")
        assert "service b failed: exited with code 5" in str(stack.not_ready())
        found = await rows(journal)
        assert found["b"]["state"] == "failed" and found["b"]["exit_code"] == 5
        assert found["a"]["state"] in ("stopped", "failed")
        assert stack.procs == {}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await journal.dispose()


async def test_a_hung_service_fails_its_health_check_and_the_stack_is_rebuilt(journal_url: str,
                                                                              tmp_path: Path) -> None:
    """SIGSTOP: the process is alive (no exit to see) but answers nothing; the health monitor's
    check fails, the service is retired (its group killed) and the stack rebuilt."""
    from engine.runtime.clock import SystemClock  # noqa: PLC0415 - real time for the monitor's schedule

    settings = DeploymentSettingsModel.model_validate({
        "run_dir": str(tmp_path / "run"), "recovery": {"delays_s": [0.1]},
        # A 3 s timeout: the hung process never answers, and a healthy one on a loaded machine does.
        "health": {"interval_s": 0.2, "timeout_s": 3.0, "first_wait_s": 0.2},
        "services": {"a": service(tmp_path, "a"), "b": service(tmp_path, "b", depends_on=["a"])}})
    journal = open_journal(Settings.model_validate({"journal": {"url": journal_url}}))
    stack = Stack(Plan.build(settings), "test-owner", SystemClock())
    task = asyncio.create_task(stack.run(writer(journal)))
    try:
        await until(lambda: stack.state == "ready", "ready")
        hung = json.loads((tmp_path / "a.json").read_text())["pid"]
        os.kill(hung, signal.SIGSTOP)
        await until(lambda: stack.state != "ready", "the hang noticed")
        await until(lambda: stack.state == "ready", "ready again")
        assert json.loads((tmp_path / "a.json").read_text())["pid"] != hung
        assert gone_soon([hung]) == [], "the hung process was not killed"
        t = models.events
        async with journal.read() as conn:
            said = [r.reason for r in (await conn.execute(sa.select(t.c.reason).where(
                t.c.entity_kind == "services", t.c.entity_id == "a", t.c.to_state == "failed"))).all()]
        assert said and said[0].startswith("failed its health check (GET http://127.0.0.1:"), said
        assert (await rows(journal))["a"]["restarts"] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await journal.dispose()
