"""Inference engines as services of the stack, behind the engine gate, on both journal backends (real
reference engines, a real trainer in process): every launch of an engine's service makes its
``engines`` row unverified in the same write, and the deployment is ready only once the gate has put
the new process on the committed head — after an engine is SIGKILLed and the stack rebuilt, the
replacement serves the head before readiness returns, and its history shows generation continued
only on the head."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.deployment.plan import Plan, StackConfigError
from engine.config.deployment import DeploymentSettingsModel
from engine.workflows.deployment.stack import Stack
from journal import audit, models
from tests.engine.workflows.deployment.test_stack import ROOT, service_port
from tests.support.training import payload, submit, until_state
from workers.policy import Policy, save_weights

pytestmark = pytest.mark.slow


def engine_service(port: int, initial: Path, name: str) -> dict[str, Any]:
    return {"command": [sys.executable, "-m", "workers.inference.reference", "--port", str(port), "--model-dir",
                        str(initial), "--enable-test-faults"],
            "cwd": str(ROOT), "endpoint": f"http://{{host}}:{port}", "engine": name,
            "readiness": {"http": f"${{endpoints.{name}}}/get_weight_version", "deadline_s": 120, "interval_s": 0.1}}


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def two_engine_stack(journal_url: str, tmp_path: Path) -> tuple[dict[str, int], Settings]:
    """Engines e0 and e1 as services of the stack, on the initial weights, with training (uni)."""
    initial = tmp_path / "initial"
    save_weights(Policy(seed=0), initial, "initial")
    ports: dict[str, int] = {"e0": service_port(), "e1": service_port()}
    settings = Settings.model_validate({
        "journal": {"url": journal_url},
        # A 15 s lease: a rebuild's writes need it, and a loaded machine once delayed renewals past 5 s.
        "orchestrator": {"lease_ttl_s": 15, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 30},
        "logging": {"level": "WARNING"},
        "training": {"enabled": True, "executor": "uni", "deployment": "dep",
                     "trainer": {"state_dir": str(tmp_path / "trainer")},
                     "checkpoint_dir": str(tmp_path / "checkpoints"), "weights_dir": str(tmp_path / "weights"),
                     "initial_weights": str(initial), "retry_after_s": 0.2, "publish_retry_after_s": 0.2,
                     "engines": [{"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in ports.items()]},
        "deployment": {"run_dir": str(tmp_path / "run"), "recovery": {"delays_s": [0.2]},
                       "services": {n: engine_service(p, initial, n) for n, p in ports.items()}}})
    return ports, settings


async def wait_for(check: Any, what: str, timeout: float = 120.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_rebuilt_engine_serves_the_committed_head_before_readiness_returns(journal_url: str,
                                                                                  tmp_path: Path) -> None:
    ports, settings = two_engine_stack(journal_url, tmp_path)
    orch = Orchestrator(settings, unbuilt=["discovery"])
    await orch.start()
    try:
        await wait_for(lambda: _ready(orch), "the deployment ready")
        job = await submit(orch.journal, payload(1))
        head = (await until_state(orch.journal, job, "COMPLETE"))["runtime_load_id"]
        assert all(http_json(f"http://127.0.0.1:{p}/get_weight_version")["weight_version"] == head
                   for p in ports.values())
        stack: Stack = orch.handle("deployment")
        victim = stack.procs["e0"].pid
        os.kill(victim, signal.SIGKILL)
        await wait_for(lambda: _async(stack.state != "ready"), "the failure seen")
        # Readiness returns only once both new engines were put on the committed head by the gate.
        await wait_for(lambda: _ready(orch), "the deployment ready again")
        assert stack.procs["e0"].pid != victim
        for name, port in ports.items():
            assert http_json(f"http://127.0.0.1:{port}/get_weight_version")["weight_version"] == head, name
            history = http_json(f"http://127.0.0.1:{port}/_test/history")["history"]
            continued = [version for event, version, _ in history if event == "continue"]
            assert continued and set(continued) == {head}, (name, history)
            loads = [i for i, (event, version, _) in enumerate(history) if event == "load" and version == head]
            assert loads and loads[0] < next(i for i, (e, _, _) in enumerate(history) if e == "continue"), history
        async with orch.journal.read() as conn:
            e = models.events
            said = [r.reason for r in (await conn.execute(sa.select(e.c.reason).where(
                e.c.entity_kind == "engines", e.c.entity_id == "dep/e0", e.c.to_state == "unverified")
                .order_by(e.c.seq))).all()]
        assert len(said) >= 2 and all("its service e0 was launched" in r for r in said[-2:]), said
    finally:
        await orch.stop()


async def test_an_engine_killed_during_a_publication_is_rebuilt_and_the_job_publishes(
        journal_url: str, tmp_path: Path) -> None:
    """The second job's publication SIGKILLs engine e1 at its pause (its test-only die_next: the
    process dies as the request arrives, before acting), after e0 paused. The stack is rebuilt; the
    job still reaches COMPLETE, both new engines serve its version, and neither continued generation
    on anything but a committed head, nor before it was paused and given that head."""
    phase = "/pause_generation"
    ports, settings = two_engine_stack(journal_url, tmp_path)
    orch = Orchestrator(settings, unbuilt=["discovery"])
    await orch.start()
    try:
        await wait_for(lambda: _ready(orch), "the deployment ready")
        first = await submit(orch.journal, payload(1))
        await until_state(orch.journal, first, "COMPLETE")
        stack: Stack = orch.handle("deployment")
        victim = stack.procs["e1"].pid
        req = urllib.request.Request(f"http://127.0.0.1:{ports['e1']}/_test/die_next", method="POST",
                                     data=json.dumps({"path": phase}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10):
            pass
        second = await submit(orch.journal, payload(2))
        row = await until_state(orch.journal, second, "COMPLETE", "REJECTED", "FAILED")
        assert row["state"] == "COMPLETE", row
        head = row["runtime_load_id"]
        await wait_for(lambda: _ready(orch), "the deployment ready again")
        assert stack.procs["e1"].pid != victim
        async with orch.journal.read() as conn:
            s = models.services
            restarts = {r.id: r.restarts for r in (await conn.execute(sa.select(s.c.id, s.c.restarts))).all()}
            e = models.events
            said = [r.reason for r in (await conn.execute(sa.select(e.c.reason).where(
                e.c.entity_kind == "training_jobs", e.c.entity_id == second).order_by(e.c.seq))).all()]
        assert restarts["e1"] == 1, restarts
        assert any("failed" in r for r in said), said  # the interrupted step was said, then done again
        for name, port in ports.items():
            assert http_json(f"http://127.0.0.1:{port}/get_weight_version")["weight_version"] == head, name
            # Both are new processes (the rebuild restarts the whole stack): their whole history.
            history = http_json(f"http://127.0.0.1:{port}/_test/history")["history"]
            events = [event for event, _, _ in history]
            assert events and events[0] == "pause", (name, history)
            continued = [version for event, version, _ in history if event == "continue"]
            assert continued and set(continued) == {head}, (name, history)
            first_continue = events.index("continue")
            assert ["load", head] in [[ev, v] for ev, v, _ in history[:first_continue]], (name, history)
        assert await audit.verify(orch.journal) == []
    finally:
        await orch.stop()


async def _ready(orch: Orchestrator) -> bool:
    return orch.is_leader and await orch.not_ready() is None


async def _async(value: bool) -> bool:
    return value


def test_an_engine_service_must_name_a_configured_engine_at_its_url() -> None:
    services = DeploymentSettingsModel.model_validate({"services": {
        "e": {"command": ["x"], "engine": "e0", "endpoint": "http://{host}:9000"}}})
    with pytest.raises(StackConfigError, match=r"deployment.services.e.engine: 'e0' needs training.enabled"):
        Plan.build(services, environ={})
    with pytest.raises(StackConfigError, match=r"deployment.services.e.engine: 'e0' is not in training.engines"):
        Plan.build(services, environ={}, engines={"other": "http://127.0.0.1:9000"})
    with pytest.raises(StackConfigError, match=r"publishes http://127.0.0.1:9000, but training.engines 'e0' is at"):
        Plan.build(services, environ={}, engines={"e0": "http://127.0.0.1:9001"})
    plan = Plan.build(services, environ={}, engines={"e0": "http://127.0.0.1:9000"}, deployment="dep")
    assert plan.engine_rows == {"e": "dep/e0"}
