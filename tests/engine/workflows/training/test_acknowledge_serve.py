"""``training.commit: acknowledge`` through real ``tidelog serve`` processes (a uni trainer in the
serve process, one reference engine on loopback), both journal backends: a candidate waits
``READY_TO_COMMIT`` with its engine paused; the serve process is SIGKILLed while it waits; a fresh one
keeps it waiting (the engine gate holds the engine paused, the job has no verdict); ``tidelog jobs
acknowledge`` commits it and the engine serves it. The API's refusals of the acknowledgement are typed
and write nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.engine.workflows.checkpoint.test_api_checkpoints import call, until
from tests.engine.workflows.training.test_api_training import (  # noqa: F401 - fixtures
    engine_proc, initial_dir, wait_job)
from tests.engine.workflows.training.test_cli_training import tidelog
from tests.support.served import AUTH, TOKEN, journal_events, serve_process
from tests.support.training import payload
from tests.workers.inference.engines import EngineProc
from workers.inference import SGLangConfig, SGLangEngine

pytestmark = pytest.mark.slow


def training(tmp: Path, engine: EngineProc, initial: Path) -> dict[str, Any]:
    return {"enabled": True, "executor": "uni", "deployment": "dep", "commit": "acknowledge",
            "trainer": {"state_dir": str(tmp / "trainer")}, "checkpoint_dir": str(tmp / "checkpoints"),
            "weights_dir": str(tmp / "weights"), "initial_weights": str(initial),
            "engines": [{"name": "e0", "url": engine.url}], "retry_after_s": 0.2, "publish_retry_after_s": 0.2}


async def engine_paused(engine: SGLangEngine) -> bool:
    return bool((await engine.server_info())["internal_states"][0]["paused"])


async def test_a_waiting_candidate_survives_a_sigkill_and_is_committed_when_acknowledged(
        journal_url: str, tmp_path: Path, engine_proc: EngineProc, initial_dir: Path) -> None:
    sections = {"training": training(tmp_path, engine_proc, initial_dir), "reconciler": {"resync_interval_s": 1}}
    adapter = SGLangEngine(SGLangConfig(engine_proc.url, timeout=10))
    try:
        async with serve_process(journal_url, tmp_path / "first", **sections) as first:
            status, body = await call("POST", f"{first.base}/v1/jobs", headers=AUTH, json={"payload": payload(3)})
            assert status == 201, body
            job_id = body["job"]["id"]
            ready = await wait_job(first.base, job_id, "READY_TO_COMMIT", "COMPLETE", "FAILED", "AMBIGUOUS")
            assert ready["state"] == "READY_TO_COMMIT" and ready["verdict"] is None, ready
            candidate = ready["runtime_load_id"]
            assert await adapter.weight_version() == candidate and await engine_paused(adapter)
            # Refusals write nothing: no reason, an unknown job, no token.
            before = await journal_events(journal_url)
            for path, body_, token, code in ((f"/v1/jobs/{job_id}/acknowledge", {}, AUTH, "invalid_body"),
                                             ("/v1/jobs/nope/acknowledge", {"reason": "x"}, AUTH, "not_found"),
                                             (f"/v1/jobs/{job_id}/acknowledge", {"reason": "x"}, {}, "unauthorized")):
                status, refused = await call("POST", first.base + path, headers=token, json=body_)
                assert refused["error"]["code"] == code, (path, status, refused)
            assert await journal_events(journal_url) == before
            os.kill(first.pid, signal.SIGKILL)
        async with serve_process(journal_url, tmp_path / "second", **sections) as second:
            # The new leader's gate looked at the engine and holds it paused for the candidate.
            async def held() -> bool:
                _, body = await call("GET", f"{second.base}/v1/engines")
                row = body["engines"][0]
                return bool(row["state"] == "paused" and "held paused" in (row["detail"] or ""))
            await until(held, what="the engine gate to hold the engine paused under the new leader")
            await asyncio.sleep(1.5)  # a resync later: still waiting, still paused
            _, waiting = await call("GET", f"{second.base}/v1/jobs/{job_id}")
            assert waiting["state"] == "READY_TO_COMMIT" and waiting["verdict"] is None, waiting
            assert await engine_paused(adapter) and await adapter.weight_version() == candidate
            code, out, err = await tidelog("jobs", "acknowledge", job_id, "--reason", "evals green",
                                           "--url", second.base, token=TOKEN)
            assert (code, out, err) == (0, f"job {job_id}: acknowledged; its head commit follows\n", ""), err
            done = await wait_job(second.base, job_id, "COMPLETE", "REJECTED")
            assert done["state"] == "COMPLETE" and done["verdict"]["by"] == "operator", done
            assert done["verdict"]["reason"] == "evals green"
            code, out, err = await tidelog("jobs", "acknowledge", job_id, "--reason", "again", "--url", second.base,
                                           token=TOKEN)
            assert code == 2 and "COMPLETE" in err, (code, out, err)
            shown = await tidelog("jobs", "show", job_id, "--url", second.base, token=TOKEN)
            assert "verdict     commit by operator: evals green" in shown[1], shown

            async def serving() -> bool:
                return await adapter.weight_version() == candidate and not await engine_paused(adapter)
            await until(serving, what="the engine to serve the acknowledged candidate")
    finally:
        await adapter.close()
