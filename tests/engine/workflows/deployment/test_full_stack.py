"""The whole deployment as one stack of ``tidelog serve``, on both journal backends, every part a real
process: the four reference participants, two reference engines, the trainer (a served rank, the
``http`` executor) and an auxiliary command (a stand-in reward model wired to an engine and the
trainer by ``${endpoints.X}``).

It comes up in dependency order (the recorded start and ready times show the independent services
started together and each dependent waited for its own dependencies only); rollouts run on the
participants while a job trains on the served trainer and publishes to both engines; the trainer's
service is SIGKILLed, the stack is rebuilt, and the next job trains on the previous job's checkpoint
(a fresh process, put back on the latest step) and publishes, with every engine having generated on
committed heads only, each after being paused and loaded; ``tidelog down`` stops dependents first and
leaves no process of the stack's process groups. Then, in another stack, a trainer and a participant
each SIGKILLed while a publication is held at its load on an engine (a test-only hanging request):
the stack is rebuilt, the job publishes without training again, and the rollouts in flight finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.engine.workflows.deployment.test_reference_stack import post, reference_stack, rollouts
from tests.engine.workflows.deployment.test_stack import (
    ROOT, SECRET, TOKEN, events, get, serve, service, service_port, wait_stack)
from tests.support.training import payload
from workers.policy import Policy, save_weights

pytestmark = pytest.mark.slow
TRAINER = "workers.trainer.worker:Trainer"


def at(row: dict[str, Any], key: str) -> datetime:
    return datetime.fromisoformat(row[key])


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def stack_config(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The services and the configuration sections of the whole deployment."""
    initial = tmp / "initial"
    save_weights(Policy(seed=0), initial, "initial")
    services, participants = reference_stack(tmp)
    engines = {"e0": service_port(), "e1": service_port()}
    for name, port in engines.items():
        services[name] = {
            "command": [sys.executable, "-m", "workers.inference.reference", "--port", str(port), "--model-dir",
                        str(initial), "--enable-test-faults"],
            "cwd": str(ROOT), "endpoint": f"http://{{host}}:{port}", "engine": name,
            "readiness": {"http": f"${{endpoints.{name}}}/get_weight_version", "deadline_s": 120, "interval_s": 0.1}}
    trainer = service_port()
    services["trainer"] = {
        "command": [sys.executable, "-m", "workers.executor.serve", "--port", str(trainer), "--worker", TRAINER,
                    "--kwargs", json.dumps({"seed": 0, "state_dir": str(tmp / "trainer")})],
        "cwd": str(ROOT), "endpoint": f"http://{{host}}:{trainer}",
        "readiness": {"http": "${endpoints.trainer}/health", "deadline_s": 120, "interval_s": 0.1}}
    # The auxiliary command: needs an engine and the trainer, nothing else.
    services["reward"] = service(tmp, "reward", depends_on=["e0", "trainer"],
                                 env={"STACK_ENGINE": "${endpoints.e0}", "STACK_TRAINER": "${endpoints.trainer}",
                                      "STACK_SECRET": "${env.STACK_TEST_SECRET}"})
    sections = {
        "participants": participants,
        "deployment": {"recovery": {"delays_s": [0.5]}},
        "discovery": {"probe_timeout_s": 2, "interval_s": 0.5, "max_backoff_s": 0.5},
        "checkpoint": {"directory": str(tmp / "ckpts")},
        "training": {"enabled": True, "deployment": "dep",
                     "executor": {"backend": "http", "options": {"urls": [f"http://127.0.0.1:{trainer}"]}},
                     "trainer": {"class": TRAINER},
                     "checkpoint_dir": str(tmp / "checkpoints"), "weights_dir": str(tmp / "weights"),
                     "initial_weights": str(initial), "retry_after_s": 0.2, "publish_retry_after_s": 0.2,
                     "recovery": {"delays_s": [0.5]},
                     "engines": [{"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in engines.items()]},
    }
    return services, sections


def job(info: dict[str, Any], salt: int) -> dict[str, Any]:
    """Submit a job of the reference task and wait for its end."""
    return until_complete(info, post(info, "/v1/jobs", {"payload": payload(salt)})["job"]["id"])


def until_complete(info: dict[str, Any], job_id: str, timeout: float = 180.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        row: dict[str, Any] = get(info, f"/v1/jobs/{job_id}")
        if row["state"] in ("COMPLETE", "REJECTED", "FAILED"):
            return row
        assert time.monotonic() < end, f"job {job_id} did not end: {row}"
        time.sleep(0.1)


def assert_gated(rows: dict[str, Any], head: str, heads: set[str]) -> None:
    """Each engine serves ``head``, and its process (one of the rebuild: its whole life) was paused
    first, generated only on committed ``heads``, and only after loading one."""
    for name in ("e0", "e1"):
        assert http_json(f"{rows[name]['endpoint']}/get_weight_version")["weight_version"] == head, name
        history = http_json(f"{rows[name]['endpoint']}/_test/history")["history"]
        moves = [event for event, _, _ in history]
        assert moves and moves[0] == "pause", (name, history)
        continued = [version for event, version, _ in history if event == "continue"]
        assert continued and set(continued) <= heads, (name, history)
        first_continue = moves.index("continue")
        assert any(ev == "load" and v in heads for ev, v, _ in history[:first_continue]), (name, history)


def until_rollouts_end(info: dict[str, Any], count: int, timeout: float = 120.0) -> None:
    """Until ``count`` rollouts are finished (or forgotten after it), none failed."""
    end = time.monotonic() + timeout
    while len(rollouts(info, "finished")) + len(rollouts(info, "forgotten")) < count:
        assert not rollouts(info, "failed"), rollouts(info, "failed")
        assert time.monotonic() < end, f"rollouts did not finish: {get(info, '/v1/rollouts?limit=100')}"
        time.sleep(0.1)


def process_groups(pgids: set[int]) -> list[int]:
    """Every live process whose process group is one of ``pgids``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(int(entry.name))
    return found


def until_rebuilt(info: dict[str, Any], victim: str, timeout: float = 180.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        body = get(info, "/v1/services")
        rows = {r["name"]: r for r in body["services"]}
        if body["stack"]["state"] == "ready" and rows[victim]["restarts"] == 1:
            return rows
        assert body["stack"]["state"] != "failed", body
        assert time.monotonic() < end, f"the stack was not rebuilt: {body}"
        time.sleep(0.1)


def ready(info: dict[str, Any], timeout: float = 60.0) -> bool:
    """Whether ``/readyz`` says ready within ``timeout`` (a stack is ready before the engine gate has
    put every engine on the committed head; the deployment only after)."""
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(info["base"] + "/readyz", timeout=5) as resp:
                return bool(json.loads(resp.read())["ready"])
        except OSError:
            if time.monotonic() > end:
                return False
        time.sleep(0.1)


async def test_the_whole_deployment_as_one_stack(journal_url: str, tmp_path: Path) -> None:
    services, sections = stack_config(tmp_path)
    names = list(services)
    with serve(journal_url, tmp_path, services, **sections) as info:
        body = wait_stack(info, "ready", timeout=180)
        rows = {r["name"]: r for r in body["services"]}
        assert {n: rows[n]["state"] for n in names} == dict.fromkeys(names, "ready")
        roots = [n for n in names if not services[n].get("depends_on")]
        assert sorted(roots) == ["e0", "e1", "model", "resources", "trainer"]
        # Independent services started together: each before any of them was ready.
        first_ready = min(at(rows[n], "ready_at") for n in roots)
        assert all(at(rows[n], "started_at") < first_ready for n in roots), rows
        # Each dependent started once its own dependencies were ready...
        for name in names:
            for dep in services[name].get("depends_on", []):
                assert at(rows[name], "started_at") >= at(rows[dep], "ready_at"), (name, dep, rows)
        # ...and no later: the agent did not wait for the engines or the trainer (torch loads slowly).
        slowest = max(at(rows[n], "ready_at") for n in ("e0", "e1", "trainer"))
        assert at(rows["agent"], "started_at") < slowest, "the agent waited for services it does not need"
        # ${endpoints.X} reached the dependents: the agent's arguments, the reward command's environment.
        agent = Path(f"/proc/{rows['agent']['pids']['service']}/cmdline").read_bytes().split(b"\0")
        assert rows["model"]["endpoint"].encode() in agent
        reward = json.loads((tmp_path / "reward.json").read_text())
        assert reward["env"]["STACK_ENGINE"] == rows["e0"]["endpoint"]
        assert reward["env"]["STACK_TRAINER"] == rows["trainer"]["endpoint"]
        assert ready(info)

        # Rollouts on the participants while a job trains on the served trainer and publishes.
        tasks = [{"rollout_id": f"r{i}", "input": {"prompt": f"task {i}", "turns": 2}} for i in range(3)]
        post(info, "/v1/rollouts", {"tasks": tasks})
        first = job(info, 1)
        assert first["state"] == "COMPLETE" and first["metrics"]["step"] == 1, first
        served = {n: http_json(f"{rows[n]['endpoint']}/get_weight_version")["weight_version"] for n in ("e0", "e1")}
        assert served == {"e0": first["runtime_load_id"], "e1": first["runtime_load_id"]}
        until_rollouts_end(info, len(tasks))

        # The trainer's service dies: the stack is rebuilt, the fresh trainer is put on job 1's step.
        old = rows["trainer"]["pids"]["service"]
        os.kill(old, signal.SIGKILL)
        rows = until_rebuilt(info, "trainer")
        assert rows["trainer"]["pids"]["service"] != old
        second = job(info, 2)
        assert second["state"] == "COMPLETE" and second["metrics"]["step"] == 2, second
        assert second["trainer_step"] == 1  # the fresh process loaded job 1's checkpoint before training
        assert_gated(rows, second["runtime_load_id"], {first["runtime_load_id"], second["runtime_load_id"]})
        assert ready(info)

        pgids = {r["pids"]["service"] for r in get(info, "/v1/services")["services"]}
        assert process_groups(pgids)
        down = subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(info["cfg"]), "down"], cwd=ROOT,
                              env=info["env"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"stack down: {len(names)} services" in down.stdout
        seen = await events(journal_url)
        # Each service's last stop is tidelog down's.
        stopping = {e["entity_id"]: e["seq"] for e in seen if e["to_state"] == "stopping"}
        stopped = {e["entity_id"]: e["seq"] for e in seen if e["to_state"] == "stopped"}
        for name, spec in services.items():
            for dep in spec.get("depends_on", []):
                assert stopped[name] < stopping[dep], (name, dep, stopped, stopping)
        end = time.monotonic() + 10
        while process_groups(pgids) and time.monotonic() < end:
            time.sleep(0.05)
        assert process_groups(pgids) == [], "a process of the stack outlived tidelog down"
    logs = [info["log"], *sorted((tmp_path / "run").glob("*.log")), *sorted((tmp_path / "run").glob("*.worker.json"))]
    assert all(SECRET not in p.read_text() and TOKEN not in p.read_text() for p in logs)
    assert all(SECRET not in json.dumps(e, default=str) for e in await events(journal_url))


def hang_next_load(engine_url: str) -> None:
    """Arm the engine's test-only fault: its next ``/update_weights_from_disk`` hangs (then fails,
    acting on nothing), so a publication is held at its load step on this engine."""
    req = urllib.request.Request(engine_url + "/_test/fail_next", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({
            "path": "/update_weights_from_disk", "mode": "hang", "seconds": 120}).encode())
    with urllib.request.urlopen(req, timeout=10):
        pass


def publishing(info: dict[str, Any], engine_url: str, timeout: float = 180.0) -> str:
    """Wait until a job is ``UPDATING_WEIGHTS`` with its load on ``engine_url`` under way (the armed
    fault taken by the request, which now hangs); the job's id."""
    end = time.monotonic() + timeout
    while True:
        jobs = [j for j in get(info, "/v1/jobs?limit=100")["jobs"] if j["state"] == "UPDATING_WEIGHTS"]
        if jobs and not http_json(engine_url + "/get_server_info")["armed_faults"]:
            return str(jobs[0]["id"])
        assert time.monotonic() < end, f"no publication reached its load: {get(info, '/v1/jobs?limit=100')}"
        time.sleep(0.02)


async def test_a_trainer_then_a_participant_killed_during_a_publication(journal_url: str, tmp_path: Path) -> None:
    """Each publication is held at its load on e0 (a hanging request), and then a service of another
    kind is SIGKILLed: the trainer during job 1's, the environment participant during job 2's, with
    rollouts in flight. Each time the whole stack is rebuilt, the job still publishes (its step is not
    trained again), the rollouts finish, and every engine process generated on committed heads only,
    each after being paused and loaded."""
    services, sections = stack_config(tmp_path)
    with serve(journal_url, tmp_path, services, **sections) as info:
        rows = {r["name"]: r for r in wait_stack(info, "ready", timeout=180)["services"]}
        assert ready(info)
        heads: set[str] = set()
        tasks = [{"rollout_id": f"r{i}", "input": {"prompt": f"task {i}", "turns": 3}} for i in range(4)]
        for salt, victim in ((1, "trainer"), (2, "environment")):
            hang_next_load(rows["e0"]["endpoint"])
            job_id = post(info, "/v1/jobs", {"payload": payload(salt)})["job"]["id"]
            if victim == "environment":
                post(info, "/v1/rollouts", {"tasks": tasks})
            assert publishing(info, rows["e0"]["endpoint"]) == job_id
            old = rows[victim]["pids"]["service"]
            os.kill(old, signal.SIGKILL)
            done = until_complete(info, job_id)
            rows = until_rebuilt(info, victim)
            assert rows[victim]["pids"]["service"] != old
            assert done["state"] == "COMPLETE" and done["metrics"]["step"] == salt, done
            heads.add(done["runtime_load_id"])
            assert_gated(rows, done["runtime_load_id"], heads)
        # The trainer's step record: two steps, each job's once (job 1's was not trained again by the
        # fresh trainer that finished its publication).
        assert json.loads((tmp_path / "trainer" / "step.json").read_text())["step"] == 2
        until_rollouts_end(info, len(tasks))
        assert ready(info)
        # The journal: each failed service was restarted once; every service was launched three times.
        seen = await events(journal_url)
        restarted = sorted(e["entity_id"] for e in seen if e["to_state"] == "restarting")
        assert restarted == ["environment", "trainer"], restarted
        launched = {n: sum(1 for e in seen if e["entity_id"] == n and e["to_state"] == "starting") for n in services}
        assert launched == dict.fromkeys(services, 3), launched
