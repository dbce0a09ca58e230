"""``tidelog jobs|publications|engines`` as real subprocesses against a running orchestrator's API with
training enabled (a torch trainer behind the uni executor, a real reference engine), on both journal
backends: a job submitted from a file is trained and published and the list, show, publications and
engines commands show it; the same batch from stdin is a replay; a job held AMBIGUOUS refuses another
(exit 2 naming both ids), refuses a ``ran`` resolution with a bad checkpoint, and is trained once
resolved ``not_run``. Bad input and an unreachable API exit 2 with one line saying why."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from engine.workflows.training import job_identity
from tests.engine.workflows.checkpoint.test_api_checkpoints import call, served, until
from tests.engine.workflows.training.test_api_training import (  # noqa: F401 - initial_dir and engine_proc are pytest fixtures
    DEP, engine_proc, initial_dir, leading, submitted_elsewhere, training_settings, wait_job)
from tests.support.reference_procs import TOKEN
from tests.support.training import payload
from tests.workers.inference.engines import EngineProc
from workers.trainer.steps import write_step_record
from tests.support.zygote import shared



async def tidelog(*args: str, token: str | None = TOKEN, stdin: str | None = None,
                  timeout: float = 60) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
    if token is not None:
        env["TIDELOG_CONTROL_TOKEN"] = token
    code, out, err = await shared().communicate("engine.cli", list(args), env=env, timeout=timeout,
                                                input=stdin.encode() if stdin is not None else None)
    return code, out.decode(), err.decode()


@pytest.mark.slow
async def test_jobs_are_submitted_listed_shown_refused_and_resolved_from_the_command_line(
        journal_url: str, tmp_path: Path, engine_proc: EngineProc, initial_dir: Path) -> None:
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(payload(1)))
    first = job_identity(payload(1))
    async with served(training_settings(journal_url, tmp_path, engine_proc.url, initial_dir)) as (base, orch):
        await leading(orch)
        submitted = await tidelog("jobs", "submit", str(job_file), "--url", base)
        assert submitted == (0, f"job {first}: new (RUNNING)\n", ""), submitted
        done = await wait_job(base, first, "COMPLETE", "FAILED", "AMBIGUOUS")
        assert done["state"] == "COMPLETE", done
        load_id = done["runtime_load_id"]

        async def serving() -> bool:
            _, body = await call("GET", f"{base}/v1/engines")
            return bool(body["engines"][0]["serving_version"] == load_id and body["engines"][0]["state"] == "serving")
        await until(serving, what="the engine row to show the committed version")

        # Commands that change nothing run side by side.
        replay, listed, shown, pubs, pub, engines, refused, wrong, missing, bad_state = await asyncio.gather(
            tidelog("jobs", "submit", "-", "--url", base, "--json",
                    stdin=json.dumps({**payload(1), "scenario_step": 4})),
            tidelog("jobs", "list", "--url", base),
            tidelog("jobs", "show", first, "--url", base),
            tidelog("publications", "--url", base),
            tidelog("publications", load_id, "--url", base),
            tidelog("engines", "--url", base, "--json"),
            tidelog("jobs", "reject", first, "--reason", "too late", "--url", base),
            tidelog("jobs", "reject", first, "--reason", "too late", "--url", base, token="wrong"),
            tidelog("jobs", "show", "nope", "--url", base),
            tidelog("jobs", "list", "--state", "nope", "--url", base))

        # A job recorded RUNNING by an orchestrator that died, whose step the trainer's record says started.
        write_step_record(tmp_path / "trainer", 2, job_identity(payload(2)), "started")
        held = await submitted_elsewhere(journal_url, 2)
        orch.reconciler.enqueue("training_jobs", held)

        async def said() -> bool:
            _, body = await call("GET", f"{base}/v1/jobs/{held}")
            return bool(body["ambiguity"] and "operator must decide" in body["ambiguity"])
        await until(said, what="the job to wait for an operator")
        ambiguous = await tidelog("jobs", "show", held, "--url", base)
        job_file.write_text(json.dumps(payload(3)))
        conflict = await tidelog("jobs", "submit", str(job_file), "--url", base)
        garbage = tmp_path / "garbage.ckpt"
        garbage.write_text("not a checkpoint\n")
        unverified = await tidelog("jobs", "resolve", held, "--decision", "ran", "--reason", "looked",
                                   "--checkpoint", str(garbage), "--url", base)
        resolved = await tidelog("jobs", "resolve", held, "--decision", "not_run", "--reason", "trainer restarted",
                                 "--url", base)
        settled = await wait_job(base, held, "COMPLETE", "FAILED")

    assert replay[0] == 0, replay
    assert json.loads(replay[1])["disposition"] == "replay" and json.loads(replay[1])["job"]["id"] == first
    assert listed[0] == 0 and re.search(rf"^{first} +COMPLETE +1 +\S+ +{re.escape(load_id)}$", listed[1], re.M), listed
    assert shown[0] == 0, shown
    lines = shown[1].splitlines()
    assert lines[0] == f"job {first}: COMPLETE, version {load_id}", shown[1]
    assert f"  deployment  {DEP}  scenario step 1" in lines
    assert re.search(r"^  phases +RUNNING=[\d.]+s CHECKPOINT=[\d.]+s UPDATING_WEIGHTS=[\d.]+s READY_TO_COMMIT=[\d.]+s "
                     r"HEAD_COMMITTED=[\d.]+s COMPLETE$", shown[1], re.M), shown[1]
    assert f"  published   {load_id} committed" in lines
    incarnation = load_id.rpartition(":")[0]
    assert pubs[0] == 0 and re.search(rf"^{re.escape(load_id)} +committed +\S+ +{first}$", pubs[1], re.M), pubs
    assert re.search(rf"^{incarnation}:0 +committed .*\(initial weights\)$", pubs[1], re.M), pubs[1]
    assert pub[0] == 0 and pub[1].splitlines() == [
        f"version {load_id}: committed", f"  job         {first} COMPLETE",
        f"  weights     {done['publication']['weights_path']}", f"  served by   {DEP}/e0"], pub
    assert engines[0] == 0, engines
    e0 = json.loads(engines[1])[0]
    assert (e0["id"], e0["state"], e0["serving_version"], e0["paused"]) == (f"{DEP}/e0", "serving", load_id, False)
    assert refused[0] == 2 and "tidelog jobs: POST /v1/jobs/" in refused[2] and "HTTP 409 job_state" in refused[2]
    assert "COMPLETE" in refused[2] and len(refused[2].splitlines()) == 1, refused
    assert wrong[0] == 2 and "HTTP 401 unauthorized" in wrong[2], wrong
    assert missing[0] == 2 and "HTTP 404 not_found: no training job 'nope'" in missing[2], missing
    assert bad_state[0] == 2 and "HTTP 400 invalid_query" in bad_state[2], bad_state
    assert ambiguous[0] == 0 and re.search(r"^  ambiguity .*step record names this job", ambiguous[1], re.M), ambiguous
    third = job_identity(payload(3))
    assert conflict[0] == 2 and "HTTP 409 job_conflict" in conflict[2], conflict
    assert held in conflict[2] and third in conflict[2] and len(conflict[2].splitlines()) == 1, conflict
    assert unverified[0] == 2 and "HTTP 422 checkpoint_unverified" in unverified[2], unverified
    assert str(garbage) in unverified[2] and "header is not JSON" in unverified[2], unverified
    assert resolved == (0, f"job {held}: resolved not_run: AMBIGUOUS -> RUNNING\n", ""), resolved
    assert settled["state"] == "COMPLETE", settled


async def test_bad_input_and_an_unreachable_api_exit_2(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{not json")
    nowhere = "http://127.0.0.1:1"
    cases: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
        (("jobs", "submit", str(tmp_path / "none.json"), "--url", nowhere), {},
         f"tidelog jobs: cannot read the payload file {tmp_path / 'none.json'}: No such file or directory"),
        (("jobs", "submit", str(tmp_path / "bad.json"), "--url", nowhere), {}, "bad.json is not JSON"),
        (("jobs", "submit", str(tmp_path / "list.json"), "--url", nowhere), {}, "must be a JSON object, not list"),
        (("jobs", "submit", "-", "--url", nowhere), {"stdin": ""}, "the payload in stdin is not JSON"),
        (("jobs", "submit", "-", "--url", nowhere), {"stdin": "{}", "token": None}, "no control token"),
        (("jobs", "list", "--url", nowhere), {}, "cannot reach the orchestrator's API"),
        (("engines", "--url", nowhere), {}, "cannot reach the orchestrator's API"),
        (("jobs", "resolve", "j1", "--decision", "not_run", "--reason", "r", "--checkpoint", "/c", "--url", nowhere),
         {}, "--checkpoint goes with --decision ran"),
        (("jobs", "resolve", "j1", "--decision", "maybe", "--reason", "r"), {}, "invalid choice: 'maybe'"),
        (("jobs", "reject", "j1"), {}, "the following arguments are required: --reason"),
        (("publications", "x:1", "--state", "committed", "--url", nowhere), {}, "does not go with an ID"),
    ]
    results = await asyncio.gather(*(tidelog(*args, **kw) for args, kw, _ in cases))
    for (args, _, needle), (rc, out, err) in zip(cases, results):
        assert rc == 2 and needle in err and out == "", (args, rc, out, err)
        assert len(err.strip().splitlines()) == 1 or "usage:" in err, (args, err)
