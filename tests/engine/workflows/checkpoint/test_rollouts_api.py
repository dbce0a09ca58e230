"""``POST/GET /v1/rollouts`` and ``tidelog rollouts submit|list|show`` over a real orchestrator and its
loopback API, on both journal backends (no participants: the rollouts stay ``pending``, which is all
these cases need). Submission is idempotent, a conflict or a bad task is refused typed and writes
nothing; the CLI checks a dataset file line by line before sending anything, sends a 10,000-line
file in batches with progress on stderr, and refuses reserved ids, malformed lines and one id on two
lines with different inputs, naming the file and the line."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import sqlalchemy as sa

from engine.runtime.service import Orchestrator
from journal import models
from tests.engine.workflows.checkpoint.test_api_checkpoints import AUTH, call, light_settings, served, until
from tests.support.reference_procs import TOKEN
from tests.support.zygote import shared

TASK = {"prompt": "p", "turns": 2}


async def leading(base: str) -> None:
    async def ready() -> bool:
        status, body = await call("GET", f"{base}/readyz")
        return status == 200 and bool(body.get("leader"))
    await until(ready, what="the orchestrator to lead")


async def count(orch: Orchestrator) -> int:
    async with orch.journal.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(models.rollouts))).scalar_one())


async def tidelog(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
    env["TIDELOG_CONTROL_TOKEN"] = TOKEN
    code, out, err = await shared().communicate("engine.cli", list(args), env=env, timeout=120,
                                                input=stdin.encode() if stdin is not None else None)
    return code, out.decode(), err.decode()


async def test_submission_is_idempotent_and_refusals_are_typed_and_write_nothing(journal_url: str) -> None:
    async with served(light_settings(journal_url, {})) as (base, orch):
        await leading(base)
        url = f"{base}/v1/rollouts"
        first = await call("POST", url, headers=AUTH, json={"tasks": [
            {"rollout_id": "a", "input": TASK, "labels": {"split": "train"}}, {"rollout_id": "b", "input": TASK}]})
        again = await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "a", "input": TASK}]})
        derived = await call("POST", url, headers=AUTH, json={"tasks": [{"input": {"prompt": "q", "turns": 1}}]})
        long_id = await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "x" * 200, "input": TASK}]})
        rows = await count(orch)
        refusals = {
            "conflict": await call("POST", url, headers=AUTH, json={"tasks": [
                {"rollout_id": "c", "input": TASK}, {"rollout_id": "a", "input": {"prompt": "other", "turns": 1}}]}),
            "reserved": await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "job-a2", "input": TASK}]}),
            "nul": await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "a\u0000b", "input": TASK}]}),
            "too_long": await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "x" * 256, "input": TASK}]}),
            "empty": await call("POST", url, headers=AUTH, json={"tasks": []}),
            "too_many": await call("POST", url, headers=AUTH, json={"tasks": [{"input": i} for i in range(10_001)]}),
            "no_input": await call("POST", url, headers=AUTH, json={"tasks": [{"rollout_id": "z"}]}),
            "no_token": await call("POST", url, json={"tasks": [{"rollout_id": "z", "input": TASK}]}),
        }
        after = await count(orch)
        listed = await call("GET", f"{url}?limit=2")
        page2 = await call("GET", f"{url}?limit=2&before={listed[1]['next_before']}")
        pending = await call("GET", f"{url}?state=pending&limit=10")
        bad_state = await call("GET", f"{url}?state=nope")
        shown = await call("GET", f"{url}/a")
        missing = await call("GET", f"{url}/nope")
    assert first[0] == 201 and first[1] == {"submitted": 2, "new": 2, "existing": 0, "rollouts": [
        {"id": "a", "disposition": "new"}, {"id": "b", "disposition": "new"}]}, first
    assert again == (200, {"submitted": 1, "new": 0, "existing": 1, "rollouts": [{"id": "a", "disposition": "existing"}]})
    assert derived[0] == 201 and derived[1]["rollouts"][0]["id"].startswith("r-"), derived
    assert long_id[0] == 201, long_id
    assert rows == 4 and after == rows, (rows, after)
    status, body = refusals["conflict"]
    assert status == 409 and body["error"]["code"] == "rollout_conflict", body
    assert (body["error"]["rollout_id"], body["error"]["index"]) == ("a", 1), body
    status, body = refusals["reserved"]
    assert status == 422 and body["error"]["field"] == "tasks[0].rollout_id", body
    assert (body["error"]["attempt"], body["error"]["rollout"]) == (2, "job"), body
    assert "reserved attempt suffix -a2 (it would name attempt 2 of rollout 'job')" in body["error"]["detail"], body
    for name in ("nul", "too_long", "empty", "too_many", "no_input"):
        status, body = refusals[name]
        assert status == 422 and body["error"]["code"] == "invalid_body", (name, body)
    assert "NUL" in refusals["nul"][1]["error"]["detail"]
    assert "must be 1..255 characters (got 256)" in refusals["too_long"][1]["error"]["detail"]
    assert refusals["no_input"][1]["error"]["field"] == "tasks[0].input"
    assert refusals["no_token"][0] == 401
    assert listed[0] == 200 and len(listed[1]["rollouts"]) == 2 and listed[1]["next_before"] is not None
    assert all("task" not in r and "result" not in r for r in listed[1]["rollouts"])
    seen = [r["id"] for r in listed[1]["rollouts"] + page2[1]["rollouts"]]
    assert sorted(seen) == sorted({"a", "b", "x" * 200, derived[1]["rollouts"][0]["id"]}) and len(seen) == 4
    assert pending[0] == 200 and len(pending[1]["rollouts"]) == 4
    assert bad_state[0] == 400 and bad_state[1]["error"]["code"] == "invalid_query"
    assert shown[0] == 200 and (shown[1]["state"], shown[1]["attempt"], shown[1]["task"], shown[1]["labels"]) == (
        "pending", 0, TASK, {"split": "train"}), shown
    assert [(h["from_state"], h["to_state"], h["reason"]) for h in shown[1]["history"]] == [(None, "pending", "submitted")]
    assert missing[0] == 404 and missing[1]["error"]["code"] == "not_found"


async def test_a_dataset_is_checked_then_submitted_in_batches_from_the_command_line(
        journal_url: str, tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"rollout_id": f"t{i:05d}", "input": {"prompt": f"p{i}", "turns": 1}}) + "\n"
                           + ("\n" if i % 1000 == 0 else "") for i in range(10_000)))
    reserved = tmp_path / "reserved.jsonl"
    reserved.write_text(json.dumps({"rollout_id": "ok", "input": TASK}) + "\n"
                        + json.dumps({"rollout_id": "job-a2", "input": TASK}) + "\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps({"rollout_id": "fine", "input": TASK}) + "\n{not json\n")
    # Half of it again (a resumed submission): nothing new.
    small = tmp_path / "small.jsonl"
    small.write_text("".join(big.read_text().splitlines(keepends=True)[:5000]))
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"rollout_id": "d", "input": TASK}) + "\n"
                     + json.dumps({"rollout_id": "d", "input": {"prompt": "other", "turns": 1}}) + "\n")
    async with served(light_settings(journal_url, {})) as (base, orch):
        await leading(base)
        submitted = await tidelog("rollouts", "submit", str(big), "--url", base, "--batch", "2500")
        before = await count(orch)
        # Commands that are refused before anything is sent, side by side; then the same file again.
        *results, resubmitted = await asyncio.gather(
            *(tidelog("rollouts", "submit", str(path), "--url", base)
              for path in (reserved, malformed, twice, tmp_path / "none.jsonl")),
            tidelog("rollouts", "submit", str(small), "--url", base, "--json"))
        refused = dict(zip(("reserved", "malformed", "twice", "missing"), results))
        missing = refused.pop("missing")
        after = await count(orch)
        from_stdin = await tidelog("rollouts", "submit", "-", "--url", base,
                                   stdin=json.dumps({"rollout_id": "s1", "input": TASK}) + "\n")
        listed = await tidelog("rollouts", "list", "--url", base, "--limit", "3")
        shown = await tidelog("rollouts", "show", "t00007", "--url", base)
    assert submitted[0] == 0, submitted
    assert submitted[1] == f"{big}: 10000 rollout(s) submitted (10000 new, 0 already recorded)\n", submitted
    assert submitted[2].splitlines() == [f"submitted {n:,}/10,000 ({n // 100}%)" for n in (2500, 5000, 7500, 10000)]
    lines = sum(1 for line in small.read_text().splitlines() if line.strip())
    assert resubmitted[0] == 0 and json.loads(resubmitted[1]) == {"file": str(small), "submitted": lines, "new": 0,
                                                                  "existing": lines}, resubmitted
    assert before == 10_000 and after == before, (before, after)
    code, _, err = refused["reserved"]
    assert code == 2 and err == (f"tidelog rollouts: {reserved}:2: rollout_id='job-a2': ends with the reserved attempt "
                                 "suffix -a2 (it would name attempt 2 of rollout 'job')\n"), err
    code, _, err = refused["malformed"]
    assert code == 2 and err.startswith(f"tidelog rollouts: {malformed}:2: not JSON"), err
    code, _, err = refused["twice"]
    assert code == 2 and f"{twice}:2: rollout_id 'd' is also on line 1 with another input" in err, err
    assert missing[0] == 2 and "cannot read the dataset" in missing[2] and "No such file" in missing[2], missing
    assert from_stdin[0] == 0 and "stdin: 1 rollout(s) submitted (1 new" in from_stdin[1], from_stdin
    assert listed[0] == 0 and listed[1].splitlines()[0].split() == ["rollout", "state", "attempt", "failures",
                                                                   "environment"], listed
    assert len(listed[1].splitlines()) == 4 and "s1" in listed[1].splitlines()[1], listed
    assert shown[0] == 0 and shown[1].splitlines()[0] == "rollout t00007: pending, attempt 0, 0 failure(s)", shown
    assert "-> pending     submitted" in shown[1], shown
