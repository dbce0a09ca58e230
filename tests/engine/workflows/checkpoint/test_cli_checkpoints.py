"""``tidelog checkpoint|restore|retire|forget`` as real subprocesses against a running orchestrator's
API: a checkpoint followed to done with a progress line per state change, one aborted from a second
command (the first exits 1 with the reason), retire and forget; bad input and an unreachable API exit 2."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.workflows.checkpoint.test_api_checkpoints import call, light_settings, served, until, wait_healthy
from tests.support.participant_server import StatusServer
from tests.support.reference_procs import KINDS, TOKEN, ParticipantClient, Procs, start_stack
from tests.support.workflows import settings, state_dirs
from tests.support.zygote import shared

SECONDS = r" \d+\.\ds"


async def tidelog(*args: str, token: str | None = TOKEN, timeout: float = 120) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TIDELOG_CONFIG", "TIDELOG_CONTROL_TOKEN")}
    if token is not None:
        env["TIDELOG_CONTROL_TOKEN"] = token
    code, out, err = await shared().communicate("engine.cli", list(args), env=env, timeout=timeout)
    return code, out.decode(), err.decode()


@pytest.mark.slow
async def test_checkpoint_wait_shows_progress_and_exits_0_then_retire_and_forget(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=0.2)
    runs = [asyncio.create_task(controller.run(stack.url("environment"), f"r{i}", {"prompt": f"p{i}", "turns": 3}))
            for i in range(2)]
    await asyncio.sleep(0.4)
    async with served(settings(journal_url, stack, prepare_timeout_s=10, roots=[str(tmp_path)])) as (base, _):
        await wait_healthy(base)
        rc, out, err = await tidelog("checkpoint", "--url", base, "--id", "ck-cli", "--directory",
                                     str(tmp_path / "ckpts"))
        shown = await tidelog("checkpoint", "--url", base, "--show", "ck-cli", "--json")
        listed = await tidelog("checkpoint", "--url", base, "--list")
        await asyncio.gather(*runs)
        retired = await tidelog("retire", "r0", "--attempt", "0", "--url", base)
        forgotten = await tidelog("forget", "r0", "--url", base, "--json")
        again = await tidelog("checkpoint", "--url", base, "--abort", "ck-cli")
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == f"checkpoint ck-cli: agent-0, environment-0, model-0, resources-0 -> {tmp_path / 'ckpts'}"
    steps = [line for line in lines[1:] if re.search(SECONDS + "$", line) and not line.startswith("checkpoint ")]
    progress = [re.sub(SECONDS + "$", "", line) for line in steps]
    assert progress[:4] == [f"preparing stage {n}/4 ({kind})" for n, kind in enumerate(KINDS, 1)], out
    assert re.fullmatch(r"committing \(scope \d episodes?\)", progress[6]), out
    assert [progress[4], progress[5]] + progress[7:] == ["prepared", "committing", "committed", "published",
                                                         "resuming", "done"], out
    assert lines[1:len(steps) + 1] == steps, out
    elapsed = [float(line.rsplit(" ", 1)[1][:-1]) for line in steps]
    assert elapsed == sorted(elapsed), out
    assert any(line.startswith("checkpoint ck-cli: done after") for line in lines), out
    assert f"manifest  {tmp_path / 'ckpts' / 'ck-cli' / 'checkpoint.json'}" in out
    assert all(re.search(rf"{k}-0 +{k} +resumed", out) for k in KINDS), out
    assert shown[0] == 0 and json.loads(shown[1])["state"] == "done"
    assert listed[0] == 0 and re.search(r"^ck-cli +done ", listed[1], re.M), listed
    assert retired[0] == 0, retired
    assert [re.sub(SECONDS + "$", "", line) for line in retired[1].splitlines()[1:5]] == [
        "queued", "running stage 1/3 (environment)", "running stage 2/3 (agent)",
        "running stage 3/3 (model+resources)"], retired[1]
    assert forgotten[0] == 0 and json.loads(forgotten[1])["state"] == "done", forgotten
    assert "done" in forgotten[2], "with --json the progress goes to stderr"
    assert again[0] == 2 and "HTTP 409 not_abortable" in again[2], again


@pytest.mark.slow
async def test_a_checkpoint_aborted_from_another_command_exits_1_with_the_reason(
        journal_url: str, procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    # Each step takes 4 s: 4.5 s in, the episode is inside its first `check`, a wait step, for 3.5 s
    # more: the environment cannot prepare (the command's own start-up takes a second of that).
    stack = await start_stack(procs, state_dirs(tmp_path / "state"), env_delay=4.0)
    run = asyncio.create_task(controller.run(stack.url("environment"), "slow", {"prompt": "p", "turns": 1}))
    await asyncio.sleep(4.5)
    async with served(settings(journal_url, stack, prepare_timeout_s=60, roots=[str(tmp_path)])) as (base, _):
        await wait_healthy(base)
        first = asyncio.create_task(tidelog("checkpoint", "--url", base, "--id", "ck-held", "--directory",
                                            str(tmp_path / "ckpts")))

        async def preparing() -> bool:
            status, body = await call("GET", f"{base}/v1/checkpoints/ck-held")
            return status == 200 and any(m["state"] == "preparing" for m in body["members"])
        await until(preparing, what="the environment's prepare")
        abort = await tidelog("checkpoint", "--url", base, "--abort", "ck-held", "--reason", "cli test")
        rc, out, err = await first
    assert abort[0] == 0, abort
    assert re.search(r"^aborting" + SECONDS + "$", abort[1], re.M) and re.search(r"^aborted" + SECONDS, abort[1], re.M)
    assert rc == 1, (out, err)
    assert re.search(r"^preparing stage 1/4 \(environment\)" + SECONDS + "$", out, re.M), out
    assert re.search(r"^aborted" + SECONDS + "$", out, re.M), out
    assert "checkpoint ck-held aborted: aborted by an operator: cli test" in err, err
    assert (await run)["rollout_id"] == "slow"


async def test_bad_input_and_an_unreachable_api_exit_2(journal_url: str, tmp_path: Path) -> None:
    participant = StatusServer("ok", "resources")
    await participant.start()
    try:
        async with served(light_settings(journal_url, {"res-0": participant.url})) as (base, _):
            await wait_healthy(base, 1)
            port = int(base.rsplit(":", 1)[1])
            cfg = tmp_path / "tidelog.yaml"
            cfg.write_text(yaml.safe_dump({"api": {"host": "0.0.0.0", "port": port}, "logging": {"level": "WARNING"}}))
            cases: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
                (("checkpoint", "--url", base, "--id", "bad id"), {}, "HTTP 422 invalid_body: checkpoint_id='bad id'"),
                (("retire", "r1", "--attempt", "-1", "--url", base), {}, "attempt=-1: Input should be greater than"),
                (("retire", "r1-a1", "--attempt", "0", "--url", base), {}, "rollout_id='r1-a1'"),
                (("retire", "r1", "--url", base), {}, "the following arguments are required: --attempt"),
                # Outside the configured roots (light_settings names none beyond the default).
                (("restore", "--url", base, "--directory", str(tmp_path / "none")), {},
                 "HTTP 422 directory_refused: directory="),
                (("checkpoint", "--url", base, "--show", "nope"), {}, "HTTP 404 not_found: no checkpoints row 'nope'"),
                (("checkpoint", "--url", base, "--abort", "x", "--id", "y"), {}, "do not go with --abort"),
                (("checkpoint", "--url", "http://127.0.0.1:1"), {}, "cannot reach the orchestrator's API"),
                (("checkpoint", "--url", base), {"token": None}, "no control token"),
                (("checkpoint", "--url", base), {"token": "wrong"}, "HTTP 401 unauthorized"),
                # The address from the config (a wildcard bind is reached on loopback).
                (("--config", str(cfg), "checkpoint", "--show", "nope"), {}, "HTTP 404 not_found"),
            ]
            # Side by side: none of them changes anything.
            results = await asyncio.gather(*(tidelog(*args, **kw) for args, kw, _ in cases))
            for (args, _, needle), (rc, out, err) in zip(cases, results):
                assert rc == 2 and needle in err, (args, rc, out, err)
            rc, out, err = await tidelog("checkpoint", "--url", base, "--no-wait", "--json")
            assert rc == 0, err
            started = json.loads(out)
            assert started["participants"] == ["res-0"] and started["checkpoint_id"].startswith("ck-")
    finally:
        await participant.stop()


class Scripted:
    """A stand-in for the API client: the events of one checkpoint, two pages, then its row."""

    def __init__(self) -> None:
        t = "2026-01-01T00:00:0{}.{}00000+00:00"
        evs = [("preparing", {"stage": 0}, 0, 0), ("preparing", {"deadline_ts": 1.0}, 0, 1),
               ("preparing", {"stage": 1}, 0, 5), ("aborting", {"detail": "x"}, 1, 2), ("aborted", {}, 1, 9)]
        self.events = [{"seq": n + 1, "to_state": s, "payload": {"set": sets}, "ts": t.format(a, b)}
                       for n, (s, sets, a, b) in enumerate(evs)]
        self.gets: list[tuple[str, Any]] = []
        self.idle = 1  # one poll that finds nothing new: the current line ticks


    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        self.gets.append((path, params))
        if path != "/v1/events":
            return {"id": "ck-1", "state": "aborted"}
        assert params is not None
        if params["after"] == 4 and self.idle:
            self.idle -= 1
            return {"events": [], "next_after": None}
        page = [e for e in self.events if e["seq"] > params["after"]][:2]
        return {"events": page, "next_after": page[-1]["seq"] if len(page) == 2 else None}


@pytest.mark.parametrize("tty", [False, True])
def test_watch_shows_a_line_per_change_of_state_or_stage(tty: bool) -> None:
    import io

    from engine.cli.progress import Display, watch

    out = io.StringIO()
    client = Scripted()
    body = watch(client, "checkpoints", "ck-1", Display(out, tty=tty), sleep=lambda _: None)
    assert body == {"id": "ck-1", "state": "aborted"} and client.gets[-1] == ("/v1/checkpoints/ck-1", None)
    assert [p["after"] for path, p in client.gets[:-1]] == [0, 2, 4, 4]
    lines = ["preparing stage 1/4 (environment) 0.0s", "preparing stage 2/4 (model) 0.5s", "aborting 1.2s",
             "aborted 1.9s"]
    text = out.getvalue()
    if not tty:
        assert text.splitlines() == lines
    else:  # the current line ticks in place; each change starts a new line
        assert "\r\x1b[2K" in text and text.endswith("aborted 1.9s\n")
        assert [line.rsplit("\r\x1b[2K", 1)[-1] for line in text.split("\n")[:-1]] == lines
