"""The ``http`` executor against real ``python -m workers.executor.serve`` processes on loopback: ordered
calls and a group call over two served ranks, a worker's exception carried back with its classes and
fields, a SIGKILLed service as the executor's terminal failure (a call in flight included), launch
that waits for the service, refuses the wrong worker class and names an absent one, the bearer token
(from the environment only), and bad bodies refused with the field named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.demos.ports import free_port
from tests.workers.executor.support import REPO_ROOT
from workers.executor import (
    Executor, ExecutorConfig, ExecutorConfigError, ExecutorFailedError, ExecutorLaunchError, ServedWorkerError,
    WorkerSpec)

WORKER = "tests.workers.executor.sample_worker:SampleWorker"
TOKEN = "served-rank-token-9f3a"


class Served:
    def __init__(self, rank: int, tmp: Path, *, token: bool = False, delay: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "workers.executor.serve", "--port", str(self.port), "--worker", WORKER,
               "--kwargs", json.dumps({"rank": rank, "marker_dir": str(tmp), "construct_delay": delay})]
        env = {k: v for k, v in os.environ.items() if k != "SERVED_TOKEN"}
        if token:
            cmd += ["--token-env", "SERVED_TOKEN"]
            env["SERVED_TOKEN"] = TOKEN
        self.log = tmp / f"served-{rank}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[list[Served]]:
    procs = [Served(0, tmp_path), Served(1, tmp_path)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def http_executor(urls: list[str], *, timeout: float = 60.0, worker: str = WORKER, **options: object) -> Executor:
    return Executor.create(ExecutorConfig(backend="http", workers=tuple(WorkerSpec(worker) for _ in urls),
                                          options={"urls": urls, **options}, launch_timeout_s=timeout))


def test_calls_go_in_order_to_each_served_rank_and_errors_come_back_typed(served: list[Served]) -> None:
    ex = http_executor([p.url for p in served])
    try:
        assert ex.collective_rpc("whoami", timeout=10) == [0, 1]
        pids = ex.collective_rpc("pid", timeout=10)
        assert pids == [p.proc.pid for p in served]  # each rank is its service's own process
        pending = [ex.rpc(0, "add", (n,), non_block=True) for n in (1, 2, 3)]
        # In submission order; values travel as JSON (a tuple comes back a list).
        assert [f.result(10) for f in pending] == [[0, 1], [0, 3], [0, 6]]
        assert ex.rpc(1, "echo", ({"a": [1, "x"]},), timeout=10) == {"a": [1, "x"]}
        with pytest.raises(ServedWorkerError, match="WorkerBoom: on purpose") as raised:
            ex.rpc(0, "boom", ("on purpose",), timeout=10)
        assert raised.value.remote_mro[0] == "tests.workers.executor.sample_worker.WorkerBoom"
        assert "builtins.Exception" in raised.value.remote_mro and "in boom" in raised.value.remote_traceback
        assert ex.failure is None  # a worker's exception is the call's, not the executor's
        with pytest.raises(RuntimeError, match=r"HTTP 404 .*has no method '_secret'"):
            ex.rpc(0, "_secret", timeout=10)
        with pytest.raises(TimeoutError):
            ex.rpc(1, "sleep_then", (1.0,), timeout=0.1)  # the wait is bounded, the call goes on
        assert ex.rpc(1, "count", timeout=10) == 0
    finally:
        ex.shutdown()
    assert all(p.proc.poll() is None for p in served), "the services are the stack's: shutdown leaves them"


def test_a_killed_service_is_the_executors_terminal_failure(served: list[Served]) -> None:
    ex = http_executor([p.url for p in served])
    try:
        in_flight = ex.rpc(1, "sleep_then", (30.0, "late"), non_block=True)
        time.sleep(0.3)
        os.kill(served[1].proc.pid, signal.SIGKILL)
        with pytest.raises(ExecutorFailedError, match=r"rank 1 at http://127\.0\.0\.1:\d+ cannot be reached"):
            in_flight.result(10)
        assert ex.failure is not None and ex.failure.rank == 1
        with pytest.raises(ExecutorFailedError):
            ex.rpc(0, "whoami", timeout=10)  # the group failed with its rank
    finally:
        ex.shutdown()


def test_launch_waits_for_the_service_and_refuses_the_wrong_worker(tmp_path: Path) -> None:
    late = Served(0, tmp_path, delay=1.5)  # constructs for 1.5 s before it binds its port
    try:
        ex = http_executor([late.url])
        try:
            assert ex.rpc(0, "whoami", timeout=10) == 0
        finally:
            ex.shutdown()
        with pytest.raises(ExecutorLaunchError, match=r"serves 'tests\.workers\.executor\.sample_worker:SampleWorker'"
                                                       r", not the configured 'workers\.trainer\.worker:Trainer'"):
            http_executor([late.url], worker="workers.trainer.worker:Trainer")
    finally:
        late.stop()
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ExecutorLaunchError, match=rf"http executor rank 0: {nobody}/health did not answer within 0\.5 s"):
        http_executor([nobody], timeout=0.5)


def test_the_token_comes_from_the_environment_and_is_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keyed = Served(0, tmp_path, token=True)
    try:
        with pytest.raises(ExecutorConfigError, match="token_env.*is not set"):
            http_executor([keyed.url], token_env="SERVED_TOKEN")
        unkeyed = http_executor([keyed.url])  # /health is open: launch passes, calls do not
        try:
            with pytest.raises(RuntimeError, match="HTTP 401"):
                unkeyed.rpc(0, "whoami", timeout=10)
        finally:
            unkeyed.shutdown()
        monkeypatch.setenv("SERVED_TOKEN", TOKEN)
        ex = http_executor([keyed.url], token_env="SERVED_TOKEN")
        try:
            assert ex.rpc(0, "whoami", timeout=10) == 0
        finally:
            ex.shutdown()
        cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes().decode()
        assert TOKEN not in cmdline
    finally:
        keyed.stop()
    assert TOKEN not in keyed.log.read_text()


def test_a_body_that_is_not_a_call_is_refused_naming_the_field(served: list[Served]) -> None:
    ex = http_executor([served[0].url])  # waits for it to listen
    ex.shutdown()

    def post(body: object) -> tuple[int, str]:
        req = urllib.request.Request(served[0].url + "/rpc", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    assert post([1]) == (400, json.dumps({"error": "the body must be an object {method, args, kwargs}"}))
    status, text = post({"method": ""})
    assert status == 400 and "method: ''" in text
    status, text = post({"method": "echo", "args": {"x": 1}})
    assert status == 400 and "args: must be a list, not dict" in text
    status, text = post({"method": "echo", "args": [1], "kwargs": [2]})
    assert status == 400 and "kwargs: must be an object, not list" in text


@pytest.mark.parametrize(("options", "rule"), [
    ({}, "options.urls"),
    ({"urls": ["ftp://x"]}, r"options\.urls\[0\]"),
    ({"urls": ["http://a", "http://b"]}, r"one http\(s\) URL per rank \(1 rank\)"),
    ({"urls": ["http://a"], "pool": 3}, "knows only 'urls' and 'token_env'"),
])
def test_bad_options_are_refused_before_anything_is_called(options: dict[str, object], rule: str) -> None:
    with pytest.raises(ExecutorConfigError, match=rule):
        Executor.create(ExecutorConfig(backend="http", workers=(WorkerSpec(WORKER),), options=options))


def test_a_served_error_keeps_the_typed_fields_only() -> None:
    err = ServedWorkerError("workers.trainer.errors.JobError", "job field lr: -1 — must be positive", "tb",
                            ("workers.trainer.errors.JobError",), {"field": "lr", "value": -1, "__class__": "x"})
    assert (err.field, err.value, err.fields) == ("lr", -1, {"field": "lr", "value": -1})  # type: ignore[attr-defined]
    assert type(err) is ServedWorkerError and str(err).startswith("workers.trainer.errors.JobError: job field lr")
