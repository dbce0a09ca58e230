"""The reference servers against hostile and unlucky input (issue 13): start-up errors are one line
and exit code 2, never a traceback; data routes bound what they read and keep, and answer in the
JSON error shape; the checkpoint root given by ``--checkpoint-root`` confines commits.

Start-up cases run the real module as a process; the data routes run on real servers in processes
(:class:`~tests.support.reference_procs.Procs`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.reference_procs import REPO, TOKEN, ParticipantClient, Procs, deadline

UNREACHABLE = "http://127.0.0.1:9"
MINIMAL_ARGS = {
    "environment": ("--agent", UNREACHABLE, "--resources", UNREACHABLE),
    "model": (),
    "agent": ("--model", UNREACHABLE),
    "resources": (),
}


def _run(kind: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", f"workers.reference.{kind}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30)


def _assert_one_line_exit_2(done: subprocess.CompletedProcess[str], naming: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("usage:")
             and not line.startswith(" ")]
    assert len(lines) == 1 and naming in lines[0], done.stderr
    assert "listening on" not in done.stdout


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("kind", sorted(MINIMAL_ARGS))
def test_a_port_in_use_is_one_line_and_exit_2(kind: str, busy_port: int, tmp_path: Path) -> None:
    done = _run(kind, "--port", str(busy_port), "--state-dir", str(tmp_path / "s"), *MINIMAL_ARGS[kind])
    _assert_one_line_exit_2(done, f"127.0.0.1:{busy_port}")


@pytest.mark.parametrize(("args", "naming"), [
    (("--port", "abc"), "--port"),
    (("--port", "70000"), "--port"),
    (("--lease-grace-seconds", "nan"), "--lease-grace-seconds"),
    (("--lease-grace-seconds", "-1"), "--lease-grace-seconds"),
    (("--step-delay", "inf"), "--step-delay"),
    (("--step-delay", "-1"), "--step-delay"),
    (("--max-tokens", "0"), "--max-tokens"),
])
def test_bad_flag_values_are_one_line_and_exit_2(args: tuple[str, ...], naming: str, tmp_path: Path) -> None:
    base = {"--port": "0"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    merged = [x for k, v in {**base, **flags}.items() for x in (k, v)]
    done = _run("model", *merged, "--state-dir", str(tmp_path / "s"))
    _assert_one_line_exit_2(done, naming)


def test_an_unusable_state_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    done = _run("resources", "--port", "0", "--state-dir", str(tmp_path / "a-file" / "state"))
    _assert_one_line_exit_2(done, "--state-dir")


def test_a_checkpoint_root_that_is_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    done = _run("resources", "--port", "0", "--state-dir", str(tmp_path / "s"),
                "--checkpoint-root", str(tmp_path / "a-file"))
    _assert_one_line_exit_2(done, "--checkpoint-root")


def test_a_missing_token_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TIDELOG_CONTROL_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "workers.reference.model", "--port", "0", "--state-dir",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    _assert_one_line_exit_2(done, "TIDELOG_CONTROL_TOKEN")


# -- data routes --------------------------------------------------------------------------------

async def _post_raw(url: str, data: bytes) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.post(url, data=data, headers={
            "Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.slow
async def test_data_routes_bound_bodies_and_fields(procs: Procs, tmp_path: Path) -> None:
    model = await procs.astart("model", tmp_path / "m")
    resources = await procs.astart("resources", tmp_path / "r")
    agent = await procs.astart("agent", tmp_path / "a", "--model", UNREACHABLE)
    chat = f"{model.url}/ng-rollout/r1/v1/chat/completions"
    # 60 MB: under the application's 64 MiB client_max_size, far over what a data route reads.
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * 60_000_000 + b'"}]}'
    for url in (chat, f"{resources.url}/ng-rollout/r1/seed_session", f"{agent.url}/ng-rollout/r1/v1/agent_sessions"):
        status, body = await _post_raw(url, big)
        assert status == 413 and body["error"]["code"] == "request_too_large", (url, body)  # type: ignore[index]
    # Over client_max_size: aiohttp's own 413, in the JSON shape.
    huge = b"x" * (65 * 1024 * 1024)
    status, body = await _post_raw(chat, huge)
    assert status == 413 and body["error"]["code"] == "request_too_large", body  # type: ignore[index]
    # A field over the bound, in a body within it: 422 naming the field; nothing kept.
    long_prompt = "p" * 200_000
    for url in (f"{resources.url}/ng-rollout/r1/seed_session", f"{agent.url}/ng-rollout/r1/v1/agent_sessions"):
        status, body = await _post_raw(url, b'{"prompt": "' + long_prompt.encode() + b'"}')
        assert status == 422 and "prompt" in body["error"]["detail"], (url, body)  # type: ignore[index]
    c = ParticipantClient(aiohttp.ClientSession())
    try:
        assert (await c.status(resources.url))["session_states"] == 0
        # Unknown routes and wrong methods answer in the JSON shape too.
        async with c.http.get(chat) as resp:
            assert resp.status == 405 and set((await resp.json())["error"]) == {"code", "detail"}
        async with c.http.get(f"{model.url}/nowhere") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    finally:
        await c.http.close()


@pytest.mark.slow
async def test_the_checkpoint_root_flag_confines_commits(procs: Procs, tmp_path: Path) -> None:
    root = tmp_path / "elsewhere"
    res = await procs.astart("resources", tmp_path / "r", "--checkpoint-root", str(root))
    c = ParticipantClient(aiohttp.ClientSession())
    try:
        await c.ok(res.url, "prepare", {"checkpoint_id": "c1", "deadline_ts": deadline()})
        status, body = await c.control(res.url, "commit", {"checkpoint_id": "c1", "deadline_ts": deadline(),
                                                           "checkpoint_dir": str(tmp_path / "ck"),
                                                           "episode_ids": []})
        assert (status, body["error"]["code"]) == (422, "checkpoint_dir_refused"), body
        assert not (tmp_path / "ck").exists()
        started = time.monotonic()
        reply = await c.ok(res.url, "commit", {"checkpoint_id": "c1", "deadline_ts": deadline(),
                                               "checkpoint_dir": str(root / "c1"), "episode_ids": []})
        assert time.monotonic() - started < 10
        assert (root / "c1" / "gym" / "resources" / "resources-0" / "manifest.json").is_file(), reply
    finally:
        await c.http.close()
