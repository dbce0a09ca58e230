"""A rank killed from outside (SIGKILL for mp, ``ray.kill`` for ray): one test body for both.

uni has no separate process to kill: its worker dies with the caller.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.workers.executor.support import RecordingListener, pid_alive, wait_until
from workers.executor import Executor, ExecutorFailedError, MpExecutor, RayExecutor

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
