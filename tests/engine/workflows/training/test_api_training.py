"""The training routes through the HTTP API (engine/workflows/training/api.py), over a real orchestrator with
training enabled (a torch trainer behind the uni executor) and a real reference inference engine
(a process on loopback), on both journal backends.

A job submitted by ``POST /v1/jobs`` is trained, published and shown ``COMPLETE``; the same batch
again is a replay (no second step); a job held ``AMBIGUOUS`` (recorded ``RUNNING`` by another
orchestrator, and the trainer's step record names it) shows why, refuses another job with both ids
named, refuses a ``ran`` resolution whose checkpoint does not verify (nothing written), and is trained
once resolved ``not_run``; one resolved ``ran`` with a checkpoint that holds its step is published from
it. Bad bodies, missing tokens and a training-disabled orchestrator are refused
with typed errors that write nothing (no reference processes needed there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from engine.config import Settings
from engine.runtime.service import Orchestrator
from engine.workflows.training import job_identity
from journal import Journal, models
from tests.engine.workflows.checkpoint.test_api_checkpoints import call, served, until
from tests.support.reference_procs import TOKEN
from tests.support.training import edges, payload, submit
from tests.workers.inference.engines import EngineProc
from workers.policy import Policy, save_weights
from workers.trainer.steps import write_step_record
from workers.trainer.worker import Trainer

AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEP = "dep"


@pytest.fixture
def initial_dir(tmp_path: Path) -> Path:
    """The weights the engine starts with: ``Policy(seed=0)`` as version ``initial``."""
    path = tmp_path / "initial"
    save_weights(Policy(seed=0), path, "initial")
    return path


@pytest.fixture
def engine_proc(tmp_path: Path, initial_dir: Path) -> Iterator[EngineProc]:
    proc = EngineProc(["--port", "0", "--model-dir", str(initial_dir)], tmp_path / "engine.log").start()
    try:
        yield proc
    finally:
        proc.kill()


def training_settings(journal_url: str, tmp_path: Path, engine_url: str, initial: Path | None = None,
                      enabled: bool = True) -> Settings:
    """An orchestrator that trains deployment ``dep`` in process (uni executor) for one engine."""
    return Settings.model_validate({
        "journal": {"url": journal_url}, "control": {"token": TOKEN},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 1}, "logging": {"level": "WARNING"},
        "training": {"enabled": enabled, "executor": "uni", "deployment": DEP,
                     "trainer": {"state_dir": str(tmp_path / "trainer")},
                     "checkpoint_dir": str(tmp_path / "checkpoints"), "weights_dir": str(tmp_path / "weights"),
                     "initial_weights": str(initial) if initial else None,
                     "engines": [{"name": "e0", "url": engine_url}], "retry_after_s": 0.2,
                     "publish_retry_after_s": 0.2, "engine_timeout_s": 10, "weight_update_timeout_s": 30}})


async def leading(orch: Orchestrator) -> None:
    await until(lambda: asyncio.sleep(0, result=orch.is_leader and orch.working()), what="leader")


async def wait_job(base: str, job_id: str, *states: str, timeout: float = 120) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        status, body = await call("GET", f"{base}/v1/jobs/{job_id}")
        assert status == 200, body
        return body if body["state"] in states else None
    body: dict[str, Any] = await until(reached, timeout, f"job {job_id[:12]} to reach {states}")
    return body


async def trainer(orch: Orchestrator, method: str, *args: Any) -> Any:
    assert orch.handle("training") is not None
    return await asyncio.to_thread(orch.handle("training").host.rpc, 0, method, args)


async def job_events(journal_url: str, job_id: str | None = None) -> int:
    """How many events of training jobs (of one job) the journal holds."""
    journal = Journal.open(journal_url)
    e = models.events
    try:
        async with journal.read() as conn:
            stmt = sa.select(sa.func.count()).select_from(e).where(e.c.entity_kind == "training_jobs")
            if job_id is not None:
                stmt = stmt.where(e.c.entity_id == job_id)
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await journal.dispose()


async def submitted_elsewhere(journal_url: str, salt: int) -> str:
    """Recorded RUNNING by an orchestrator that then died (this one never saw the commit)."""
    other = Journal.open(journal_url)
    try:
        return await submit(other, payload(salt), DEP)
    finally:
        await other.dispose()


PHASES = ["RUNNING", "CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE"]


@pytest.mark.slow
async def test_jobs_are_submitted_shown_published_refused_and_resolved(
        journal_url: str, tmp_path: Path, engine_proc: EngineProc, initial_dir: Path) -> None:
    async with served(training_settings(journal_url, tmp_path, engine_proc.url, initial_dir)) as (base, orch):
        await leading(orch)
        # A new job: 201, trained once and published behind the commit gate.
        status, new = await call("POST", f"{base}/v1/jobs", headers=AUTH, json={"payload": payload(1)})
        assert status == 201 and new["disposition"] == "new", new
        first = new["job"]["id"]
        assert first == job_identity(payload(1)) and new["job"]["state"] == "RUNNING" and "payload" not in new["job"]
        done = await wait_job(base, first, "COMPLETE", "FAILED", "AMBIGUOUS")
        assert done["state"] == "COMPLETE", done
        assert done["payload"] == payload(1) and done["terminal"] and done["ambiguity"] is None
        assert [p["state"] for p in done["phases"]] == PHASES, done["phases"]
        # The history has every event, the pause intent's CHECKPOINT -> CHECKPOINT among them.
        assert [h["to_state"] for h in done["history"]] == ["RUNNING", "CHECKPOINT", "CHECKPOINT", *PHASES[2:]]
        assert done["history"][2]["reason"] == "pause intent recorded: pausing every engine", done["history"]
        load_id = done["runtime_load_id"]
        assert done["publication"]["id"] == load_id and done["publication"]["state"] == "committed"
        assert done["publication"]["job_id"] == first

        # The same batch again (the scenario moved on): the recorded result, nothing trains again.
        again = {**payload(1), "scenario_step": 9}
        status, replay = await call("POST", f"{base}/v1/jobs", headers=AUTH, json={"payload": again, "deployment": DEP})
        assert (status, replay["disposition"], replay["job"]["id"]) == (200, "replay", first), replay
        assert (await trainer(orch, "health"))["step"] == 1

        # Lists and the publication.
        _, jobs = await call("GET", f"{base}/v1/jobs")
        assert [j["id"] for j in jobs["jobs"]] == [first] and jobs["next_before"] is None
        assert "payload" not in jobs["jobs"][0]
        assert (await call("GET", f"{base}/v1/jobs", params={"state": "FAILED"}))[1]["jobs"] == []
        _, pubs = await call("GET", f"{base}/v1/publications")
        incarnation = load_id.rpartition(":")[0]
        assert [(p["id"], p["state"]) for p in pubs["publications"]] == [
            (load_id, "committed"), (f"{incarnation}:0", "committed")], pubs
        _, page = await call("GET", f"{base}/v1/publications", params={"limit": "1"})
        assert page["next_before"] == load_id
        _, rest = await call("GET", f"{base}/v1/publications", params={"before": load_id})
        assert [p["id"] for p in rest["publications"]] == [f"{incarnation}:0"]
        status, pub = await call("GET", f"{base}/v1/publications/{load_id}")
        assert status == 200 and pub["job"]["id"] == first and pub["job"]["state"] == "COMPLETE", pub
        assert (await call("GET", f"{base}/v1/publications/{incarnation}:0"))[1]["job"] is None

        async def engine_serving() -> dict[str, Any] | None:
            _, body = await call("GET", f"{base}/v1/engines")
            e = body["engines"][0]
            return body if e["state"] == "serving" and e["serving_version"] == load_id else None
        engines = await until(engine_serving, what="the engine row to show the committed version")
        e0 = engines["engines"][0]
        assert (e0["id"], e0["deployment"], e0["paused"], e0["health"]) == (f"{DEP}/e0", DEP, False, "ok"), e0
        assert (await call("GET", f"{base}/v1/publications/{load_id}"))[1]["served_by"] == [f"{DEP}/e0"]

        # A COMPLETE job can be neither rejected nor resolved; an unknown one is not found.
        status, body = await call("POST", f"{base}/v1/jobs/{first}/reject", headers=AUTH, json={"reason": "bad"})
        err = body["error"]
        assert (status, err["code"], err["state"]) == (409, "job_state", "COMPLETE"), body
        assert err["allowed"] == ["CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT"]
        assert "COMPLETE" in err["detail"] and "READY_TO_COMMIT" in err["detail"]
        status, body = await call("POST", f"{base}/v1/jobs/{first}/resolve", headers=AUTH,
                                  json={"decision": "abandon", "reason": "x"})
        assert (status, body["error"]["code"], body["error"]["allowed"]) == (409, "job_state", ["AMBIGUOUS"]), body
        for path, body_ in (("reject", {"reason": "x"}), ("resolve", {"decision": "not_run", "reason": "x"})):
            status, body = await call("POST", f"{base}/v1/jobs/nope/{path}", headers=AUTH, json=body_)
            assert (status, body["error"]["code"]) == (404, "not_found"), body

        # A job recorded RUNNING by an orchestrator that died, whose step the trainer's record says
        # started: no evidence either way, so it waits AMBIGUOUS for an operator.
        # (The record first: a job found RUNNING before it was there would be settled and trained.)
        write_step_record(tmp_path / "trainer", 2, job_identity(payload(2)), "started")
        held = await submitted_elsewhere(journal_url, 2)
        orch.reconciler.enqueue("training_jobs", held)
        ambiguous = await wait_job(base, held, "AMBIGUOUS")

        async def said() -> dict[str, Any] | None:
            _, body = await call("GET", f"{base}/v1/jobs/{held}")
            return body if body["ambiguity"] and "operator must decide" in body["ambiguity"] else None
        ambiguous = await until(said, what="the ambiguity to be said")
        assert "step record names this job" in ambiguous["ambiguity"], ambiguous
        assert ambiguous["terminal"] is False and ambiguous["phases"][-1]["seconds"] is not None

        # Another job meanwhile: refused, naming both.
        status, body = await call("POST", f"{base}/v1/jobs", headers=AUTH, json={"payload": payload(3)})
        third = job_identity(payload(3))
        err = body["error"]
        assert (status, err["code"]) == (409, "job_conflict"), body
        assert held in err["detail"] and third in err["detail"], err
        assert (err["in_flight_job"], err["in_flight_state"], err["refused_job"]) == (held, "AMBIGUOUS", third)

        # ran, with a checkpoint that does not verify or carries another job: refused, nothing written.
        before = await job_events(journal_url, held)
        garbage = tmp_path / "garbage.ckpt"
        garbage.write_bytes(b"not a checkpoint\n")
        for path, why in ((str(garbage), "header"), (str(tmp_path / "none.ckpt"), "missing"),
                          (done["checkpoint_path"], f"carries job '{first}'")):
            status, body = await call("POST", f"{base}/v1/jobs/{held}/resolve", headers=AUTH,
                                      json={"decision": "ran", "reason": "looked", "checkpoint_path": path})
            err = body["error"]
            assert (status, err["code"], err["field"]) == (422, "checkpoint_unverified", "checkpoint_path"), body
            assert path in err["detail"] and why in err["detail"], err
        status, body = await call("POST", f"{base}/v1/jobs/{held}/resolve", headers=AUTH,
                                  json={"decision": "ran", "reason": "looked"})
        assert (status, body["error"]["field"]) == (422, "checkpoint_path"), body
        status, body = await call("POST", f"{base}/v1/jobs/{held}/resolve", headers=AUTH,
                                  json={"decision": "abandon", "reason": "x", "checkpoint_path": "/x"})
        assert (status, body["error"]["field"]) == (422, "checkpoint_path"), body
        status, body = await call("POST", f"{base}/v1/jobs/{held}/reject", headers=AUTH, json={"reason": "no"})
        assert (status, body["error"]["state"]) == (409, "AMBIGUOUS"), body
        assert await job_events(journal_url, held) == before

        # not_run: the trainer holds no step of it (an operator's word): trained once, and published.
        status, body = await call("POST", f"{base}/v1/jobs/{held}/resolve", headers=AUTH,
                                  json={"decision": "not_run", "reason": "trainer restarted before the step"})
        assert status == 202 and body == {"job_id": held, "decision": "not_run", "state": "RUNNING",
                                          "was": "AMBIGUOUS", "checkpoint": None}, body
        settled = await wait_job(base, held, "COMPLETE", "FAILED")
        assert settled["state"] == "COMPLETE", settled
        assert (await trainer(orch, "health"))["step"] == 2
        assert [h["to_state"] for h in settled["history"]][:3] == ["RUNNING", "AMBIGUOUS", "AMBIGUOUS"]
        assert any("resolved by an operator (not_run)" in h["reason"] for h in settled["history"])

        # ran, with a checkpoint that holds the job's step (taken by another trainer, found on disk):
        # verified, CHECKPOINT from it, and published from it (the live trainer loads it).
        write_step_record(tmp_path / "trainer", 3, job_identity(payload(4)), "started")
        found = await submitted_elsewhere(journal_url, 4)
        orch.reconciler.enqueue("training_jobs", found)
        await wait_job(base, found, "AMBIGUOUS")
        ckpt = str(tmp_path / "found.ckpt")
        other = Trainer(seed=0)
        other.train({**payload(4), "job_id": found})
        other.save_checkpoint(ckpt, found)
        status, body = await call("POST", f"{base}/v1/jobs/{found}/resolve", headers=AUTH,
                                  json={"decision": "ran", "reason": "its checkpoint is on disk",
                                        "checkpoint_path": ckpt})
        assert status == 202 and (body["state"], body["was"]) == ("CHECKPOINT", "AMBIGUOUS"), body
        assert (body["checkpoint"]["job_id"], body["checkpoint"]["step"]) == (found, 1), body
        published = await wait_job(base, found, "COMPLETE", "REJECTED")
        assert published["state"] == "COMPLETE" and published["checkpoint_path"] == ckpt, published
        assert (await trainer(orch, "health"))["last_job_id"] == found
        _, jobs = await call("GET", f"{base}/v1/jobs")
        assert [j["id"] for j in jobs["jobs"]] == [found, held, first]
    assert (await edges_of(journal_url, held))[-1] == ("HEAD_COMMITTED", "COMPLETE")
    assert (await edges_of(journal_url, found))[-6:] == [
        ("AMBIGUOUS", "CHECKPOINT"), ("CHECKPOINT", "CHECKPOINT"), ("CHECKPOINT", "UPDATING_WEIGHTS"), ("UPDATING_WEIGHTS", "READY_TO_COMMIT"),
        ("READY_TO_COMMIT", "HEAD_COMMITTED"), ("HEAD_COMMITTED", "COMPLETE")]


async def edges_of(journal_url: str, job_id: str) -> list[tuple[str | None, str]]:
    journal = Journal.open(journal_url)
    try:
        return await edges(journal, job_id)
    finally:
        await journal.dispose()


# -- refusals (no reference processes needed) ----------------------------------------------------

BAD = [
    ("/v1/jobs", {}, "payload", "payload: Field required"),
    ("/v1/jobs", {"payload": [1]}, "payload", "payload=[1]: Input should be a valid dictionary"),
    ("/v1/jobs", {"payload": {"rollouts": []}}, "payload.scenario_step", "payload.scenario_step=None: must be an"),
    ("/v1/jobs", {"payload": {"scenario_step": -1}}, "payload.scenario_step", "must be an integer >= 0"),
    ("/v1/jobs", {"payload": {"scenario_step": 0, "base_version": "v1"}}, "payload.base_version",
     "must be a runtime load id"),
    ("/v1/jobs", {"payload": {"scenario_step": 0}, "deployment": "other"}, "deployment",
     "deployment='other': this orchestrator trains deployment 'dep' only"),
    ("/v1/jobs", {"payload": {"scenario_step": 0}, "priority": 1}, "priority", "Extra inputs are not permitted"),
    ("/v1/jobs", '{"payload": {"scenario_step": 0, "x": NaN}}', "payload.x", "payload.x=nan: must be a finite"),
    ("/v1/jobs/j1/resolve", {"decision": "maybe", "reason": "x"}, "decision", "decision='maybe': Input should be"),
    ("/v1/jobs/j1/resolve", {"decision": "ran"}, "reason", "reason: Field required"),
    ("/v1/jobs/j1/resolve", {"decision": "ran", "reason": "  "}, "reason", "must say why"),
    ("/v1/jobs/j1/resolve", {"decision": "ran", "reason": "x", "checkpoint_path": ""}, "checkpoint_path",
     "at least 1 character"),
    ("/v1/jobs/j1/reject", {}, "reason", "reason: Field required"),
    ("/v1/jobs/j1/reject", {"reason": "x", "force": True}, "force", "Extra inputs are not permitted"),
]
POSTS = ("/v1/jobs", "/v1/jobs/j1/resolve", "/v1/jobs/j1/reject")


async def test_bad_bodies_tokens_queries_and_closed_jobs_are_refused_and_change_nothing(
        journal_url: str, tmp_path: Path) -> None:
    # A job rejected earlier (recorded before this orchestrator started): submitting it again is refused.
    journal = Journal.open(journal_url)
    try:
        closed = await submit(journal, payload(5), DEP)
        async with journal.write() as tx:
            await tx.transition("training_jobs", closed, from_state="RUNNING", version=1, to_state="FAILED",
                                reason="made up by the test", changes={"detail": "refused by the trainer"})
        # A job with more events than a page (a long run of retries): its history shows both ends.
        long = await submit(journal, payload(7), "elsewhere")
        async with journal.write() as tx:
            for n in range(1, 1101):
                await tx.transition("training_jobs", long, from_state="RUNNING" if n == 1 else "AMBIGUOUS",
                                    version=n, to_state="AMBIGUOUS", reason=f"look {n}", changes={"ambiguity": str(n)})
            await tx.transition("training_jobs", long, from_state="AMBIGUOUS", version=1101, to_state="FAILED",
                                reason="abandoned by the test")
    finally:
        await journal.dispose()
    # The engine is not there: nothing here reaches it (nor the trainer).
    async with served(training_settings(journal_url, tmp_path, "http://127.0.0.1:1")) as (base, orch):
        await leading(orch)
        before = await job_events(journal_url)
        for path, body, field, needle in BAD:
            kw: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
            status, reply = await call("POST", f"{base}{path}", headers=AUTH, **kw)
            err = reply["error"]
            assert (status, err["code"], err.get("field")) == (422, "invalid_body", field), (path, body, reply)
            assert needle in err["detail"], (path, body, err)
        status, reply = await call("POST", f"{base}/v1/jobs", headers=AUTH, json={"payload": payload(5)})
        err = reply["error"]
        assert (status, err["code"], err["job_id"], err["state"]) == (409, "job_closed", closed, "FAILED"), reply
        assert "refused by the trainer" in err["detail"]
        for path in POSTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, reply = await call("POST", f"{base}{path}", headers=headers, json={"payload": payload(6)})
                assert (status, reply["error"]["code"]) == (401, "unauthorized"), (path, reply)
        for query, needle in (("limit=0", "limit='0': must be between"), ("state=nope", "not a state of training_jobs"),
                              ("before=zz", "before='zz': no training_jobs row"), ("colour=1", "unknown")):
            status, reply = await call("GET", f"{base}/v1/jobs?{query}")
            assert (status, reply["error"]["code"]) == (400, "invalid_query") and needle in reply["error"]["detail"]
        status, reply = await call("GET", f"{base}/v1/publications?state=loaded&state=target")
        assert status == 400 and "given more than once" in reply["error"]["detail"], reply
        for path in ("/v1/jobs/nope", "/v1/publications/x:1"):
            status, reply = await call("GET", f"{base}{path}")
            assert (status, reply["error"]["code"]) == (404, "not_found"), reply
        status, reply = await call("GET", f"{base}/v1/engines?x=1")
        assert status == 400, reply
        assert await job_events(journal_url) == before, "a refused request wrote something"
        status, one = await call("GET", f"{base}/v1/jobs/{closed}")
        assert status == 200 and one["state"] == "FAILED" and one["terminal"] and one["publication"] is None
        assert [p["state"] for p in one["phases"]] == ["RUNNING", "FAILED"] and one["phases"][-1]["seconds"] is None
        assert one["history_omitted"] == 0
        _, many = await call("GET", f"{base}/v1/jobs/{long}")
        assert [p["state"] for p in many["phases"]] == ["RUNNING", "AMBIGUOUS", "FAILED"], many["phases"]
        assert len(many["history"]) == 1000 and many["history_omitted"] == 1102 - 1000
        assert many["history"][0]["to_state"] == "RUNNING" and many["history"][-1]["reason"] == "abandoned by the test"
        assert many["history"][499]["reason"] == "look 499" and many["history"][500]["reason"] == "look 602"

    # Training disabled: the POSTs say so; the reads still answer from the journal.
    async with served(training_settings(journal_url, tmp_path, "http://127.0.0.1:1", enabled=False)) as (base, orch):
        await leading(orch)
        for path, body in (("/v1/jobs", {"payload": payload(6)}), ("/v1/jobs/j1/reject", {"reason": "x"}),
                           ("/v1/jobs/j1/resolve", {"decision": "abandon", "reason": "x"})):
            status, reply = await call("POST", f"{base}{path}", headers=AUTH, json=body)
            assert (status, reply["error"]["code"]) == (503, "training_disabled"), (path, reply)
        status, listed = await call("GET", f"{base}/v1/jobs")
        assert status == 200 and [j["id"] for j in listed["jobs"]] == [long, closed]
        assert (await call("GET", f"{base}/v1/engines"))[1]["engines"][0]["id"] == f"{DEP}/e0"
        assert (await call("GET", f"{base}/v1/publications"))[1] == {"publications": [], "next_before": None}
        assert await job_events(journal_url) == before
