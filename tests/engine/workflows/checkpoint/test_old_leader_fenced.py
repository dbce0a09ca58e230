"""Fencing reaches the participants, end to end: an old leader paused mid-send is refused.

``tidelog serve`` (A) leads and is paused (SIGSTOP, ``TIDELOG_PAUSE_AT``) right before it sends a
``/run``, a retire, a forget or a prepare to the environment, after its own lease check. Its lease
lapses, a second orchestrator (B) takes over with the next epoch and finishes the work (its calls
raise the participants' fence to its epoch). Then A is let go (SIGCONT): its call reaches the real
reference environment with the old epoch and is refused ``stale_epoch`` before it does anything
(the environment counts it), and nothing of it shows: no attempt 0 ran, no checkpoint is open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.config import Settings
from engine.runtime.crash import PAUSE_ENV
from engine.runtime.service import Orchestrator
from journal import models
from tests.engine.workflows.checkpoint.test_api_checkpoints import call
from tests.engine.workflows.checkpoint.test_rollout_dispatch import config
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, start_stack
from engine.demos.ports import free_port
from tests.support.workflows import controller, procs, state_dirs, table, until  # noqa: F401 - fixtures
from workers.protocol import CONTROL_PREFIX

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[4]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: op -> (the path A pauses before, the API request that makes A send it, B's row that finishes it)
OPS: dict[str, tuple[str, tuple[str, dict[str, Any]], tuple[Any, str, tuple[str, ...]]]] = {
    "run": ("/run", ("/v1/rollouts", {"tasks": [{"rollout_id": "old", "input": {"prompt": "p", "turns": 1}}]}),
            (models.rollouts, "old", ("forgotten",))),
    "retire": (f"{CONTROL_PREFIX}/retire", ("/v1/rollouts/x/retire", {"attempt": 0}), (models.retirements, "", ())),
    "forget": (f"{CONTROL_PREFIX}/forget", ("/v1/rollouts/gone/forget", {}), (models.retirements, "", ())),
    "prepare": (f"{CONTROL_PREFIX}/prepare", ("/v1/checkpoints", {"checkpoint_id": "ck-old"}),
                (models.checkpoints, "ck-old", ("done", "aborted"))),
}


def paused(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("op", sorted(OPS))
async def test_an_old_leader_paused_mid_send_is_refused_by_the_participants(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path, op: str) -> None:
    c = controller
    path, (route, body), (kind, entity, ends) = OPS[op]
    stack = await start_stack(procs, state_dirs(tmp_path / "state"))
    env_url = stack.url("environment")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = config(journal_url, stack)
    cfg["api"] = {"host": "127.0.0.1", "port": port}
    cfg["checkpoint"] = {**cfg["checkpoint"], "directory": str(tmp_path / "ckpts"), "prepare_timeout_s": 20}
    (tmp_path / "tidelog.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
    env[PAUSE_ENV] = f"send:{path}"
    with open(tmp_path / "a.log", "wb") as log:
        a = subprocess.Popen([sys.executable, "-m", "engine.cli", "--config", str(tmp_path / "tidelog.yaml"),
                              "serve"], cwd=ROOT, env=env, stdout=log, stderr=log)
    b = Orchestrator(Settings.model_validate(config(journal_url, stack) | {"checkpoint": cfg["checkpoint"]}))
    try:
        async def a_leads() -> bool:
            try:
                status, body = await call("GET", f"{base}/v1/participants")
            except OSError:
                return False
            return status == 200 and sum(p["health"] == "healthy" for p in body["participants"]) == len(KINDS)
        await until(a_leads, 60)
        status, reply = await call("POST", base + route, headers=AUTH, json=body)
        assert status in (201, 202), reply
        entity = entity or reply.get("retirement_id", "")

        async def a_paused() -> bool:
            return paused(a.pid)
        await until(a_paused, 60)
        fence_before = (await c.status(env_url))["epochs"]

        await b.start()  # leads once A's lease has lapsed, with the next epoch
        async def finished() -> bool:
            row = (await table(b, kind)).get(entity)
            return row is not None and (row["state"] in ends if ends else row["state"] in ("done", "failed"))
        await until(finished, 120)
        row = (await table(b, kind))[entity]
        raised = (await c.status(env_url))["epochs"]
        assert (await c.status(env_url))["stale_epochs_refused"] == 0

        a.send_signal(signal.SIGCONT)  # A goes on from where it stopped: it sends its call now

        async def refused() -> int:
            return int((await c.status(env_url))["stale_epochs_refused"])
        assert await until(refused, 60) == 1
        statuses = {k: await c.status(stack.url(k)) for k in KINDS}
        rows = await table(b, models.rollouts)
    finally:
        a.kill()
        a.wait()
        await b.stop()
    assert "pause point send:" in (tmp_path / "a.log").read_text()
    # A's own calls never reached the environment before (probes are reads): B's raised its fence.
    assert fence_before == {} and len(raised) == 1 and min(raised.values()) >= 2, (fence_before, raised)
    assert row["state"] in (ends or ("done",)), row
    assert statuses["environment"]["phase"] == "idle" and statuses["environment"]["checkpoint_id"] is None
    assert all(s["stale_epochs_refused"] == 0 for k, s in statuses.items() if k != "environment"), statuses
    if op == "run":
        # Attempt 0 never ran (its rerun's marks were forgotten since: only the fence refused it).
        assert "old" not in statuses["environment"]["executions"] and "old-a1" in statuses["environment"]["executions"]
        assert (rows["old"]["state"], rows["old"]["attempt"]) == ("forgotten", 1)
