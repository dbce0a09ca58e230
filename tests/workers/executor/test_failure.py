"""FailureState, ExecutorFuture and resolve on their own (no workers needed)."""

from __future__ import annotations

import logging
import pickle
import threading
from collections import namedtuple
from typing import Any

import pytest

from tests.workers.executor.support import RecordingListener
from workers.executor import (
    ExecutorFailedError,
    ExecutorFailure,
    ExecutorFuture,
    FailureState,
    GroupFuture,
    resolve,
)


class RaisingListener:
    def on_executor_failure(self, failure: ExecutorFailure) -> None:
        raise RuntimeError("observer bug")


def test_first_failure_wins_and_fails_pending_futures() -> None:
    state = FailureState()
    pending: ExecutorFuture[int] = ExecutorFuture("call")
    state.track(pending)
    first = ExecutorFailure("mp", "worker exited unexpectedly", 1)
    assert state.fail(first) is True
    assert state.fail(ExecutorFailure("mp", "second", 0)) is False
    assert state.failure == first
    with pytest.raises(ExecutorFailedError) as caught:
        pending.result(timeout=0)
    assert caught.value.failure == first
    with pytest.raises(ExecutorFailedError):
        state.track(ExecutorFuture("new call"))


def test_each_listener_is_called_once_even_when_registered_late_or_another_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = FailureState()
    early, late = RecordingListener(), RecordingListener()
    state.add_listener(RaisingListener())
    state.add_listener(early)
    state.add_listener(early)  # the same observer twice is still one observer
    failure = ExecutorFailure("ray", "actor died", 0)
    with caplog.at_level(logging.ERROR, logger="tidelog.executor"):
        state.fail(failure)
        state.fail(ExecutorFailure("ray", "again", 1))
    assert early.calls == [failure]
    assert any("observer" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    state.add_listener(late)
    assert late.calls == [failure]
    with pytest.raises(TypeError, match="on_executor_failure"):
        state.add_listener(object())  # type: ignore[arg-type]


def test_close_fails_pending_with_shut_down_and_ignores_later_failures() -> None:
    state = FailureState()
    listener = RecordingListener()
    state.add_listener(listener)
    pending: ExecutorFuture[int] = ExecutorFuture("call")
    state.track(pending)
    state.close()
    with pytest.raises(RuntimeError, match="executor is shut down"):
        pending.result(timeout=0)
    assert state.fail(ExecutorFailure("mp", "late", 0)) is False
    assert listener.calls == [] and state.failure is None
    with pytest.raises(RuntimeError, match="executor is shut down"):
        state.track(ExecutorFuture("new"))


def test_pickling_keeps_only_failure_and_closed() -> None:
    state = FailureState()
    state.add_listener(RecordingListener())
    state.track(ExecutorFuture("pending"))
    failure = ExecutorFailure("ray", "actor died", 2)
    state.fail(failure)
    copy = pickle.loads(pickle.dumps(state))
    assert (copy.failure, copy.closed) == (failure, False)
    assert copy.__getstate__() == {"failure": failure, "closed": False}
    error = pickle.loads(pickle.dumps(ExecutorFailedError(failure)))
    assert error.failure == failure


def test_a_future_settles_once() -> None:
    future: ExecutorFuture[str] = ExecutorFuture("call")
    assert future.set_result("first") is True
    assert future.set_exception(RuntimeError("late")) is False
    assert future.result(timeout=0) == "first" and future.done()


def test_a_timed_out_wait_leaves_the_future_pending() -> None:
    future: ExecutorFuture[str] = ExecutorFuture("slow call")
    with pytest.raises(TimeoutError, match="slow call.*may still be running"):
        future.result(timeout=0.01)
    threading.Timer(0.05, future.set_result, args=("later",)).start()
    assert future.result(timeout=10) == "later"
    with pytest.raises(TypeError, match="timeout"):
        future.result(timeout="1")  # type: ignore[arg-type]


def test_group_future_is_a_list_in_rank_order_and_raises_the_first_error_by_rank() -> None:
    members: list[ExecutorFuture[Any]] = [ExecutorFuture(f"rank {r}") for r in range(3)]
    group = GroupFuture("collective", members)
    members[2].set_exception(KeyError("rank 2"))
    members[1].set_exception(ValueError("rank 1"))
    members[0].set_result(0)
    with pytest.raises(ValueError, match="rank 1"):
        group.result(timeout=0)
    ok = GroupFuture("collective", [ExecutorFuture("a"), ExecutorFuture("b")])
    for value, member in zip("ab", ok.members):
        member.set_result(value)
    assert ok.done() and ok.result(timeout=0) == ["a", "b"]
    assert GroupFuture("empty", []).result(timeout=0) == []


def test_resolve_keeps_container_types_and_passes_plain_values() -> None:
    Pair = namedtuple("Pair", "left right")
    done: ExecutorFuture[int] = ExecutorFuture("done")
    done.set_result(7)
    assert resolve([done, (done, Pair(done, "x")), 3], timeout=0) == [7, (7, Pair(7, "x")), 3]
    assert resolve("plain") == "plain"
