"""The service stack on real processes, on both journal backends, through ``tidelog serve``:
dependency order with recorded start and ready times, ``${endpoints.X}`` in the dependents, the
private snapshot, ``tidelog down`` dependents first with nothing left in the process table,
fail-stop at start-up, and the owner's SIGKILL taking its services with it before the next
orchestrator brings the stack back from the journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from engine.demos.ports import free_port
from journal import Journal, models


ROOT = Path(__file__).resolve().parents[4]
TOKEN = "stack-test-token"
SECRET = "s3cret-value-never-shown"
pytestmark = pytest.mark.slow


def service_port() -> int:
    """A free port for a service to listen on (outside the ephemeral range: engine.demos.ports)."""
    return free_port()


def service(tmp: Path, name: str, *extra: str, port: bool = True, **more: Any) -> dict[str, Any]:
    """A ``tests.support.stack_service`` service recording into ``tmp/NAME.json``."""
    cmd = [sys.executable, "-m", "tests.support.stack_service", "--record", str(tmp / f"{name}.json"), *extra]
    spec: dict[str, Any] = {"command": cmd, "cwd": str(ROOT)}
    if port:
        p = service_port()
        cmd[3:3] = ["--port", str(p)]
        spec["endpoint"] = f"http://{{host}}:{p}"
        spec["readiness"] = {"http": f"${{endpoints.{name}}}/health", "deadline_s": 30, "interval_s": 0.05}
    spec.update(more)
    return spec


@contextmanager
def serve(journal_url: str, tmp: Path, services: dict[str, Any], name: str = "serve",
          **sections: Any) -> Iterator[dict[str, Any]]:
    """``tidelog serve`` with ``services`` (and more configuration ``sections``), stopped with SIGTERM."""
    port = service_port()
    cfg = tmp / f"{name}.yaml"
    deployment = {"run_dir": str(tmp / "run"), "stop_grace_s": 5, "services": services,
                  **sections.pop("deployment", {})}
    cfg.write_text(yaml.safe_dump({
        "journal": {"url": journal_url}, "api": {"host": "127.0.0.1", "port": port},
        "orchestrator": {"lease_ttl_s": 3, "lease_renew_s": 0.5, "shutdown_grace_s": 1},
        "logging": {"level": "INFO", "format": "text"}, "deployment": deployment, **sections}))
    log = tmp / f"{name}.log"
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN, "STACK_TEST_SECRET": SECRET}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "--config", str(cfg), "serve"], cwd=ROOT,
                                env=env, stdout=out, stderr=out)
    info = {"proc": proc, "base": f"http://127.0.0.1:{port}", "cfg": cfg, "log": log, "env": env}
    try:
        for _ in range(400):
            try:
                with urllib.request.urlopen(info["base"] + "/healthz", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def get(info: dict[str, Any], path: str) -> Any:
    with urllib.request.urlopen(info["base"] + path, timeout=5) as resp:
        return json.loads(resp.read())


def wait_stack(info: dict[str, Any], state: str, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < end:
        try:
            body = get(info, "/v1/services")
        except OSError:
            body = {}
        if (body.get("stack") or {}).get("state") == state:
            return body
        if state == "ready" and (body.get("stack") or {}).get("state") == "failed":
            break
        time.sleep(0.05)
    raise AssertionError(f"the stack was not {state} within {timeout} s: {body}\n{info['log'].read_text()}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def stack_pids(tmp: Path, names: list[str]) -> list[int]:
    """Every process each service started (itself and its child), from its own record."""
    pids: list[int] = []
    for name in names:
        rec = json.loads((tmp / f"{name}.json").read_text())
        pids += [rec["pid"], *([rec["child"]] if rec["child"] else [])]
    return pids


def gone_soon(pids: list[int], timeout: float = 10.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def at(row: dict[str, Any], key: str) -> datetime:
    return datetime.fromisoformat(row[key])


async def events(journal_url: str) -> list[dict[str, Any]]:
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            e = models.events
            rows = (await conn.execute(sa.select(e).where(e.c.entity_kind == "services").order_by(e.c.seq))).all()
            return [dict(r._mapping) for r in rows]
    finally:
        await journal.dispose()


async def test_the_stack_comes_up_in_dependency_order_and_goes_down_dependents_first(
        journal_url: str, tmp_path: Path) -> None:
    services = {
        # Ready 1 s, 3 s and 6 s after their starts: margins of seconds between the times compared
        # below, so that a loaded machine cannot reorder them.
        "a": service(tmp_path, "a", "--child", "--ready-after", "1"),
        "b": service(tmp_path, "b", "--ready-after", "3"),
        # Independent of everything and slow to be ready: c must not wait for it.
        "slow": service(tmp_path, "slow", "--ready-after", "6"),
        "c": service(tmp_path, "c", "${endpoints.a}", depends_on=["a", "b"],
                     env={"STACK_B": "${endpoints.b}", "STACK_SECRET": "${env.STACK_TEST_SECRET}"}),
        "d": service(tmp_path, "d", depends_on=["c"]),
        # An auxiliary command with a command readiness check (run with its environment).
        "aux": service(tmp_path, "aux", port=False, depends_on=["a"], env={"STACK_A": "${endpoints.a}"},
                       readiness={"command": [sys.executable, "-c",
                                              "import os, urllib.request; urllib.request.urlopen("
                                              "os.environ['STACK_A'] + '/health', timeout=2)"]}),
    }
    names = list(services)
    with serve(journal_url, tmp_path, services) as info:
        body = wait_stack(info, "ready")
        rows = {r["name"]: r for r in body["services"]}
        assert {n: rows[n]["state"] for n in names} == dict.fromkeys(names, "ready")
        # Independent services started together: every one before any of them was ready.
        first_ready = min(at(rows[n], "ready_at") for n in ("a", "b", "slow"))
        assert all(at(rows[n], "started_at") < first_ready for n in ("a", "b", "slow")), rows
        # A dependent started once all of its own dependencies were ready, and only those.
        assert at(rows["c"], "started_at") >= max(at(rows["a"], "ready_at"), at(rows["b"], "ready_at"))
        assert at(rows["c"], "started_at") < at(rows["slow"], "ready_at"), "c waited for a service it does not need"
        assert at(rows["d"], "started_at") >= at(rows["c"], "ready_at")
        assert at(rows["aux"], "started_at") >= at(rows["a"], "ready_at")
        assert at(rows["aux"], "started_at") < at(rows["b"], "ready_at"), "aux waited for b"
        # ${endpoints.X} reached the dependents, in arguments and in the environment.
        c = json.loads((tmp_path / "c.json").read_text())
        assert c["argv"][-1] == rows["a"]["endpoint"] == f"http://127.0.0.1:{services['a']['endpoint'].split(':')[-1]}"
        assert c["env"]["STACK_B"] == rows["b"]["endpoint"] and c["env"]["STACK_SECRET"] == SECRET
        assert c["env"]["TIDELOG_SERVICE"] == "c"
        snapshot = Path(c["env"]["TIDELOG_SERVICE_CONFIG"])
        assert snapshot.stat().st_mode & 0o777 == 0o600
        # Every endpoint published when c started: its dependencies', its own, slow's; not d's yet.
        published = json.loads(snapshot.read_text())["endpoints"]
        assert published == {n: rows[n]["endpoint"] for n in ("a", "b", "c", "slow")}
        worker = json.loads((tmp_path / "run" / "c.worker.json").read_text())
        assert worker["pids"]["service"] == c["pid"] and worker["log_dir"] == str(tmp_path / "run")
        assert "service up" in (tmp_path / "run" / "c.log").read_text()
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
        pids = stack_pids(tmp_path, names)
        assert all(alive(p) for p in pids)
        with urllib.request.urlopen(info["base"] + "/readyz") as resp:
            assert json.loads(resp.read())["ready"] is True

        down = subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(info["cfg"]), "down"], cwd=ROOT,
                              env=info["env"], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stack down: 6 services" in down.stdout
        body = get(info, "/v1/services")
        rows = {r["name"]: r for r in body["services"]}
        assert {n: (rows[n]["state"], rows[n]["desired"]) for n in names} == dict.fromkeys(names, ("stopped", "down"))
        # Dependents first: each stopped before any of its dependencies began stopping.
        stopping = {e["entity_id"]: e["seq"] for e in await events(journal_url) if e["to_state"] == "stopping"}
        stopped = {e["entity_id"]: e["seq"] for e in await events(journal_url) if e["to_state"] == "stopped"}
        for name, spec in services.items():
            for dep in spec.get("depends_on", []):
                assert stopped[name] < stopping[dep], (name, dep, stopped, stopping)
        assert gone_soon(pids, 0.5) == [], "a process of the stack outlived tidelog down (child included)"
        with pytest.raises(urllib.error.HTTPError) as info503:
            urllib.request.urlopen(info["base"] + "/readyz")
        assert info503.value.code == 503
    # The secret reached the service and its private snapshot only.
    logs = [info["log"], *sorted((tmp_path / "run").glob("*.log")), *sorted((tmp_path / "run").glob("*.worker.json"))]
    assert all(SECRET not in p.read_text() for p in logs)
    assert all(SECRET not in json.dumps(e, default=str) for e in await events(journal_url))


@pytest.mark.parametrize("fault", ["never_ready", "exits_at_once"])
async def test_a_startup_failure_stops_the_stack_naming_the_service(journal_url: str, tmp_path: Path,
                                                                   fault: str) -> None:
    bad = (service(tmp_path, "bad", "--ready-after", "3600", readiness=None) if fault == "never_ready"
           else service(tmp_path, "bad", "--exit", "3"))
    if fault == "never_ready":
        bad["readiness"] = {"http": "${endpoints.bad}/health", "deadline_s": 1.5, "interval_s": 0.05}
    services = {"a": service(tmp_path, "a", "--child"), "bad": bad,
                "c": service(tmp_path, "c", depends_on=["a"]), "after": service(tmp_path, "after", depends_on=["bad"])}
    with serve(journal_url, tmp_path, services) as info:
        body = wait_stack(info, "failed")
        rows = {r["name"]: r for r in body["services"]}
        assert rows["bad"]["state"] == "failed"
        if fault == "never_ready":
            assert "not ready within 1.5 s of its start (readiness.deadline_s); last check: GET" in rows["bad"]["detail"]
        else:
            assert rows["bad"]["exit_code"] == 3 and "exited with code 3" in rows["bad"]["detail"]
        assert body["stack"]["reason"].startswith("service bad failed: ")
        # What started was stopped, naming why; what depended on it never started.
        assert rows["a"]["state"] == "stopped" and "service bad failed" in rows["a"]["detail"]
        assert rows["after"]["state"] == "stopped" and rows["after"]["started_at"] is None
        assert rows["c"]["state"] in ("stopped",)
        launched = [n for n in ("a", "bad", "c") if (tmp_path / f"{n}.json").exists()]
        assert gone_soon(stack_pids(tmp_path, launched)) == [], "a process of the failed stack is left"
        with pytest.raises(urllib.error.HTTPError) as info503:
            urllib.request.urlopen(info["base"] + "/readyz")
        assert info503.value.code == 503 and "service bad failed" in info503.value.read().decode()
    assert any(e["to_state"] == "failed" and e["entity_id"] == "bad" for e in await events(journal_url))


async def test_the_owners_sigkill_takes_its_services_and_the_next_brings_the_stack_back(
        journal_url: str, tmp_path: Path) -> None:
    services = {"a": service(tmp_path, "a", "--child"), "b": service(tmp_path, "b", depends_on=["a"])}
    with serve(journal_url, tmp_path, services, name="first") as info:
        wait_stack(info, "ready")
        before = stack_pids(tmp_path, ["a", "b"])
        assert all(alive(p) for p in before)
        info["proc"].send_signal(signal.SIGKILL)
        info["proc"].wait(10)
        assert gone_soon(before) == [], "a service outlived the orchestrator that owned it"
    with serve(journal_url, tmp_path, services, name="second") as info:
        body = wait_stack(info, "ready")
        after = stack_pids(tmp_path, ["a", "b"])
        assert not set(after) & set(before) and all(alive(p) for p in after)
        owners = {r["owner"] for r in body["services"]}
        assert len(owners) == 1
        said = [e for e in await events(journal_url) if e["to_state"] == "failed"]
        assert {e["entity_id"] for e in said} == {"a", "b"}
        assert all("its processes died with it (owner lease)" in e["reason"] for e in said)
        assert cli(info, "down").returncode == 0
    assert gone_soon(after) == []
    # Brought down by an operator: the next orchestrator leaves it down until `tidelog up`.
    with serve(journal_url, tmp_path, services, name="third") as info:
        body = wait_stack(info, "down")  # "starting" until the new orchestrator has read the rows
        assert "brought down by an operator" in body["stack"]["reason"], body
        assert {r["state"] for r in body["services"]} == {"stopped"}
        up = cli(info, "up")
        assert up.returncode == 0 and "stack ready: 2 services" in up.stdout, up.stdout + up.stderr
        listed = cli(info, "services")
        assert listed.returncode == 0 and listed.stdout.startswith("stack: ready"), listed.stdout + listed.stderr
        assert [line.split()[:2] for line in listed.stdout.splitlines()[2:]] == [["a", "ready"], ["b", "ready"]]
        assert {(r["state"], r["desired"]) for r in get(info, "/v1/services")["services"]} == {("ready", "up")}
        last = stack_pids(tmp_path, ["a", "b"])
        assert not set(last) & set(after) and all(alive(p) for p in last)
    assert gone_soon(last) == []


def cli(info: dict[str, Any], *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(info["cfg"]), *command], cwd=ROOT,
                          env=info["env"], capture_output=True, text=True, timeout=60)
