"""A rank killed from outside (SIGKILL for mp, ``ray.kill`` for ray): one test body for both.

uni has no separate process to kill: its worker dies with the caller.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.workers.executor.support import RecordingListener, pid_alive, wait_until
from workers.executor import Executor, ExecutorFailedError, ExecutorFailure, MpExecutor, RayExecutor, resolve

SAFETY = 30.0


@pytest.fixture(params=["mp", "ray"])
def executor_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def kill_rank(executor: Executor, rank: int) -> None:
    if isinstance(executor, MpExecutor):
        pid = executor.pids[rank]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    else:
        assert isinstance(executor, RayExecutor)
        import ray

        ray.kill(executor.actors[rank])


def test_killed_idle_rank_fails_waits_promptly_and_calls_each_listener_once(
    make_executor: Callable[..., Executor], executor_backend: str
) -> None:
    executor = make_executor()
    pids = executor.collective_rpc("pid", timeout=SAFETY)
    early = RecordingListener()
    executor.register_failure_listener(early)
    # Rank 1 is busy for far longer than the safety net: only the failure can end this wait.
    busy: Any = executor.rpc(1, "sleep_then", args=(120.0, "never"), non_block=True)

    kill_rank(executor, 0)  # rank 0 is idle: only the monitor can notice

    with pytest.raises(ExecutorFailedError) as caught:
        busy.result(timeout=SAFETY)
    failure = caught.value.failure
    assert (failure.backend, failure.rank) == (executor_backend, 0)
    wait_until(lambda: len(early.calls) >= 1, what="the failure listener being called")
    late = RecordingListener()
    executor.register_failure_listener(late)  # registered after the failure: called at once
    assert late.calls == [failure]

    with pytest.raises(ExecutorFailedError):
        executor.rpc(1, "whoami")
    with pytest.raises(ExecutorFailedError):
        executor.check_health(timeout=SAFETY)
    # The owned peer is retired, not left running its 120 s call.
    wait_until(lambda: not pid_alive(pids[1]), what="the peer rank being retired")
    executor.shutdown()
    assert early.calls == [failure] and late.calls == [failure]
    assert executor.failure == failure


class RaisingListener:
    """A listener with a bug: raising must not reach the monitor, the caller or other listeners."""

    def __init__(self) -> None:
        self.calls = 0

    def on_executor_failure(self, failure: ExecutorFailure) -> None:
        self.calls += 1
        raise RuntimeError("listener bug")


def test_every_pending_future_fails_at_once_and_a_raising_listener_is_only_logged(
    make_executor: Callable[..., Executor], executor_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    executor = make_executor()
    raising, recording = RaisingListener(), RecordingListener()
    executor.register_failure_listener(raising)
    executor.register_failure_listener(recording)
    # Every kind of pending wait, each on work that would run far past the safety net:
    # a busy call, calls queued behind it, a collective group, and a call on the doomed rank.
    busy = executor.rpc(1, "sleep_then", args=(120.0, "never"), non_block=True)
    queued = [executor.rpc(1, "echo", args=(i,), non_block=True) for i in range(2)]
    group = executor.collective_rpc("sleep_then", args=(120.0,), non_block=True)
    doomed = executor.rpc(0, "echo", args=("queued on rank 0",), non_block=True)

    with caplog.at_level(logging.ERROR, logger="tidelog.executor"):
        kill_rank(executor, 0)  # rank 0 is busy with its share of the group
        failures = []
        for future in (busy, *queued, group, doomed):
            # A generous timeout: only the failure can end these waits before the work would.
            with pytest.raises(ExecutorFailedError) as caught:
                future.result(timeout=SAFETY)
            failures.append(caught.value.failure)
        with pytest.raises(ExecutorFailedError):
            resolve([busy, (group,)], timeout=SAFETY)
        wait_until(lambda: len(recording.calls) == 1, what="the second listener being called")

    assert len(set(failures)) == 1 and failures[0] == executor.failure
    assert (failures[0].backend, failures[0].rank) == (executor_backend, 0)
    assert raising.calls == 1 and recording.calls == [failures[0]]
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info and "listener" in r.getMessage()]
    assert len(logged) == 1 and isinstance(logged[0], RuntimeError) and str(logged[0]) == "listener bug"
