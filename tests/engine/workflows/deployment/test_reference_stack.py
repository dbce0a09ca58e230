"""The four reference participants as a stack of ``tidelog serve``, on both journal backends: they
come up in dependency order wired by ``${endpoints.X}``, the orchestrator dispatches rollouts to
them, and a participant SIGKILLed while rollouts run is rebuilt with the whole stack; dispatch holds
from the failure until every service is ready again (no attempt is sent in between, as the events
show), and every rollout still finishes. After a checkpoint, such a rebuild also restores the
participants from it before readiness returns, and the checkpointed episodes continue from their
boundaries."""

from __future__ import annotations

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

from engine.demos.checkpoint import all_steps, checkpointed_steps
from journal import Journal, models
from tests.engine.workflows.deployment.test_stack import ROOT, TOKEN, events, get, serve, service_port, wait_stack
from workers.protocol import EpisodeId

pytestmark = pytest.mark.slow
KINDS = ("model", "resources", "agent", "environment")
#: A readiness command: the participant's checkpoint status answers with the control token.
READY = [sys.executable, "-c", "import os, urllib.request as u; u.urlopen(u.Request(os.environ['STATUS'], "
                               "headers={'Authorization': 'Bearer ' + os.environ['TIDELOG_CONTROL_TOKEN']}), timeout=2)"]


def reference_stack(tmp: Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    services: dict[str, Any] = {}
    participants = []
    wiring = {"model": [], "resources": [], "agent": ["--model", "${endpoints.model}"],
              "environment": ["--agent", "${endpoints.agent}", "--resources", "${endpoints.resources}",
                              "--step-delay", "0.4"]}
    for kind in KINDS:
        port = service_port()
        services[kind] = {
            "command": [sys.executable, "-m", f"workers.reference.{kind}", "--port", str(port), "--state-dir",
                        str(tmp / "state" / kind), "--checkpoint-root", str(tmp / "ckpts"), *wiring[kind]],
            "cwd": str(ROOT), "depends_on": {"agent": ["model"], "environment": ["agent", "resources"]}.get(kind, []),
            "endpoint": f"http://{{host}}:{port}",
            "env": {"TIDELOG_CONTROL_TOKEN": "${env.TIDELOG_CONTROL_TOKEN}",
                    "STATUS": f"${{endpoints.{kind}}}/ng-control/v1/checkpoint/status"},
            "readiness": {"command": READY, "interval_s": 0.1, "deadline_s": 60}}
        participants.append({"name": f"{kind}-0", "url": f"http://127.0.0.1:{port}"})
    return services, participants


def post(info: dict[str, Any], path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(info["base"] + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def started(participants: list[dict[str, str]]) -> bool:
    """Whether the environment completed a step of some episode (its status's ``executions``)."""
    url = next(p["url"] for p in participants if p["name"] == "environment-0")
    req = urllib.request.Request(url + "/ng-control/v1/checkpoint/status",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return bool(json.loads(resp.read())["executions"])


def rollouts(info: dict[str, Any], state: str) -> list[dict[str, Any]]:
    return list(get(info, f"/v1/rollouts?state={state}&limit=1000")["rollouts"])


@pytest.mark.parametrize("victim", ["environment", "model"])
async def test_a_killed_participant_rebuilds_the_stack_and_dispatch_holds_meanwhile(
        journal_url: str, tmp_path: Path, victim: str) -> None:
    services, participants = reference_stack(tmp_path)
    with serve(journal_url, tmp_path, services, participants=participants,
               deployment={"recovery": {"delays_s": [0.5]}},
               discovery={"probe_timeout_s": 2, "interval_s": 0.5, "max_backoff_s": 0.5},
               checkpoint={"directory": str(tmp_path / "ckpts")}) as info:
        body = wait_stack(info, "ready")
        rows = {r["name"]: r for r in body["services"]}
        assert rows["agent"]["started_at"] >= rows["model"]["ready_at"]
        assert rows["environment"]["started_at"] >= max(rows["agent"]["ready_at"], rows["resources"]["ready_at"])
        tasks = [{"rollout_id": f"r{i}", "input": {"prompt": f"task {i}", "turns": 4}} for i in range(6)]
        post(info, "/v1/rollouts", {"tasks": tasks})
        # The kill must land while attempts run, or there is nothing for the rebuild to send again
        # (in CI a kill made as soon as a row read ``dispatched`` once came after every episode had
        # ended). So wait until the environment completed a first step: an episode is 9 steps of
        # 0.4 s, so the others are still running when the kill lands.
        end = time.monotonic() + 30
        while not started(participants):
            assert time.monotonic() < end, "no episode made a step"
            time.sleep(0.05)
        os.kill(rows[victim]["pids"]["service"], signal.SIGKILL)
        end = time.monotonic() + 90
        while True:
            body = get(info, "/v1/services")
            if body["stack"]["state"] == "ready" and {r["name"]: r for r in body["services"]}[victim]["restarts"] == 1:
                break
            assert body["stack"]["state"] != "failed", body
            assert time.monotonic() < end, f"the stack was not rebuilt: {body}"
            time.sleep(0.05)
        end = time.monotonic() + 120
        # A finished rollout is forgotten everywhere afterwards (no batching here): both count as done.
        while len(rollouts(info, "finished")) + len(rollouts(info, "forgotten")) < len(tasks):
            assert not rollouts(info, "failed"), rollouts(info, "failed")
            assert time.monotonic() < end, f"rollouts did not finish: {get(info, '/v1/rollouts?limit=100')}"
            time.sleep(0.1)
    # From the victim's failure until the last service was ready again, no attempt was sent.
    seen = await events(journal_url)
    failed = next(e["seq"] for e in seen if e["entity_id"] == victim and e["to_state"] == "failed")
    # The first moment after the failure at which every service was ready again (a later rebuild, say
    # by the health monitor on a loaded machine, does not move it).
    up: set[str] = set()
    ready_again = 0
    for e in seen:
        if e["seq"] > failed and e["to_state"] == "ready":
            up.add(e["entity_id"])
            if up == set(KINDS):
                ready_again = e["seq"]
                break
    assert ready_again, "the stack was never ready again after the failure"
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            e = models.events
            sent = [r.seq for r in (await conn.execute(sa.select(e.c.seq).where(
                e.c.entity_kind == "rollouts", e.c.to_state == "dispatched"))).all()]
            trail = [(r.seq, r.entity_id, r.from_state, r.to_state, r.reason[:80]) for r in (await conn.execute(
                sa.select(e).where(e.c.entity_kind.in_(["rollouts", "services"])).order_by(e.c.seq))).all()]
    finally:
        await journal.dispose()
    assert sent and not [s for s in sent if failed < s < ready_again], (failed, ready_again, sent, trail)
    # Every rollout whose attempt was cut by the kill (not finished before the failure) was sent
    # again, and only once the stack was ready again.
    cut = {rid for seq, rid, _, to, _ in trail if to == "dispatched" and seq < failed}
    cut -= {rid for seq, rid, _, to, _ in trail if to == "finished" and seq < failed}
    assert cut, f"no attempt was in flight when {victim} died: {trail}"
    again = {rid for seq, rid, _, to, _ in trail if to == "dispatched" and seq > ready_again}
    assert cut <= again, f"{sorted(cut - again)} were not dispatched again after the rebuild: {trail}"


async def test_a_rebuild_restores_the_participants_from_the_latest_checkpoint(journal_url: str,
                                                                              tmp_path: Path) -> None:
    """A checkpoint is taken mid-episode; then the environment is SIGKILLed. The rebuild asks for
    the restore of that checkpoint (``deployment.restore_after_rebuild``, on by default) once the old
    processes are gone and before the new ones start; the restore waits for the rebuilt stack, no
    attempt is sent while it is open, readiness returns only after it, and every checkpointed episode
    continues from its boundary as its next attempt: no environment step before the boundary runs
    again, none is lost."""
    services, participants = reference_stack(tmp_path)
    turns = 5
    with serve(journal_url, tmp_path, services, participants=participants,
               deployment={"recovery": {"delays_s": [0.5]}},
               discovery={"probe_timeout_s": 2, "interval_s": 0.5, "max_backoff_s": 0.5},
               checkpoint={"directory": str(tmp_path / "ckpts")}) as info:
        rows = {r["name"]: r for r in wait_stack(info, "ready")["services"]}
        tasks = [{"rollout_id": f"r{i}", "input": {"prompt": f"task {i}", "turns": turns}} for i in range(4)]
        post(info, "/v1/rollouts", {"tasks": tasks})
        end = time.monotonic() + 30
        while not started(participants):
            assert time.monotonic() < end, "no episode made a step"
            time.sleep(0.05)
        checkpoint_id = post(info, "/v1/checkpoints", {})["checkpoint_id"]
        end = time.monotonic() + 60
        while (ckpt := get(info, f"/v1/checkpoints/{checkpoint_id}"))["state"] not in ("done", "aborted", "failed"):
            assert time.monotonic() < end, ckpt
            time.sleep(0.05)
        assert ckpt["state"] == "done", ckpt
        os.kill(rows["environment"]["pids"]["service"], signal.SIGKILL)
        end = time.monotonic() + 120
        while len(rollouts(info, "finished")) + len(rollouts(info, "forgotten")) < len(tasks):
            assert not rollouts(info, "failed"), rollouts(info, "failed")
            assert time.monotonic() < end, f"rollouts did not finish: {get(info, '/v1/rollouts?limit=100')}"
            time.sleep(0.1)
        with urllib.request.urlopen(urllib.request.Request(
                f"{rows['environment']['endpoint']}/ng-control/v1/checkpoint/status",
                headers={"Authorization": f"Bearer {TOKEN}"}), timeout=5) as resp:
            executions = json.loads(resp.read())["executions"]  # the rebuilt environment's own
        final = {r["id"]: r for r in rollouts(info, "forgotten") + rollouts(info, "finished")}
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            r, e = models.restores, models.events
            restores = (await conn.execute(sa.select(r))).all()
            trail = [(x.seq, x.entity_kind, x.entity_id, x.from_state, x.to_state, x.reason) for x in (
                await conn.execute(sa.select(e).where(e.c.entity_kind.in_(["rollouts", "services", "restores"]))
                                   .order_by(e.c.seq))).all()]
    finally:
        await journal.dispose()
    assert len(restores) == 1, restores
    restore = restores[0]
    assert restore.id.startswith("rs-rebuild-") and restore.state == "done" and restore.checkpoint_id == checkpoint_id
    assert restore.scope, "no episode of the checkpoint was continued"
    seq = {(kind, eid, to): s for s, kind, eid, _, to, _ in reversed(trail)}  # the first of each
    created = seq[("restores", restore.id, "restoring")]
    failed = seq[("services", "environment", "failed")]
    relaunched = [s for s, kind, eid, _, to, _ in trail if kind == "services" and eid == "environment"
                  and to == "starting" and s > failed][0]
    assert failed < created < relaunched, (failed, created, relaunched)
    assert "the stack is rebuilt (service environment failed" in next(
        reason for s, _, _, _, _, reason in trail if s == created)
    # No attempt was sent while the restore was open.
    finished = next(s for s, kind, eid, _, to, _ in trail if kind == "restores" and to == "done")
    sent = [s for s, kind, _, _, to, _ in trail if kind == "rollouts" and to == "dispatched"]
    assert not [s for s in sent if failed < s < finished], (failed, finished, sent)
    # Every continued episode finished as its next attempt, from its boundary: the steps the
    # checkpoint kept did not run again and none was lost.
    kept = checkpointed_steps(Path(ckpt["checkpoint_dir"]) / checkpoint_id)
    for key in restore.scope:
        episode = EpisodeId.from_capture_key(key)
        assert final[episode.rollout_id]["attempt"] == episode.attempt + 1, final[episode.rollout_id]
        ran = executions.get(episode.next_attempt().capture_key, {})
        before = kept.get(episode.rollout_id, set())
        assert not set(ran) & before, (key, sorted(set(ran) & before))
        assert all(n == 1 for n in ran.values()), (key, ran)
        assert set(ran) | before == all_steps(turns), (key, sorted(all_steps(turns) - set(ran) - before))
