"""The executor contract, one test body for every backend (uni, mp, ray).

uni runs one rank, mp and ray two; expected values are computed from the rank
count, so the same assertions hold everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.workers.executor.sample_worker import SampleWorker, WorkerBoom
from tests.workers.executor.support import RecordingListener, pid_alive, wait_until
from workers.executor import (
    Executor,
    ExecutorFuture,
    ExecutorLaunchError,
    WorkerSpec,
    resolve,
)

SAFETY = 30.0  # a safety net for waits that must succeed, never a timing assertion


def test_collective_rpc_returns_results_in_rank_order(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    n = len(executor.config.workers)
    # Rank 0 finishes last, so completion order is the reverse of rank order.
    assert executor.collective_rpc("rank_after_delay", args=(0.15, n), timeout=SAFETY) == list(range(n))
    pending = executor.collective_rpc("add", args=(3,), non_block=True)
    assert isinstance(pending, ExecutorFuture)
    assert resolve(pending, timeout=SAFETY) == [(rank, 3) for rank in range(n)]


def test_collective_rpc_dispatches_to_every_rank_before_waiting(
    make_executor: Callable[..., Executor], tmp_path: Path
) -> None:
    executor = make_executor()
    n = len(executor.config.workers)
    # Each rank blocks until every rank has arrived: only concurrent dispatch completes.
    assert executor.collective_rpc("rendezvous", args=(str(tmp_path), n, 20.0), timeout=SAFETY) == list(range(n))


def test_rpc_addresses_one_rank_and_rejects_a_bad_rank(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    n = len(executor.config.workers)
    assert executor.rpc(n - 1, "whoami", timeout=SAFETY) == n - 1
    assert executor.rpc(n - 1, "add", args=(5,), timeout=SAFETY) == (n - 1, 5)
    assert executor.rpc(0, "count", timeout=SAFETY) == (5 if n == 1 else 0)
    for bad in (n, -1):
        with pytest.raises(IndexError, match=f"rank={bad}"):
            executor.rpc(bad, "whoami")


def test_calls_to_one_rank_run_in_submission_order(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    first = executor.rpc(0, "sleep_then", args=(0.2, "first"), non_block=True)
    later = [executor.rpc(0, "add", args=(1,), non_block=True) for _ in range(5)]
    assert resolve([first, later], timeout=SAFETY) == ["first", [(0, i) for i in range(1, 6)]]


def test_worker_exception_is_raised_intact_and_is_not_terminal(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    with pytest.raises(WorkerBoom, match="on purpose") as caught:
        executor.rpc(0, "boom", args=("on purpose",), timeout=SAFETY)
    assert type(caught.value) is WorkerBoom
    with pytest.raises(AttributeError):
        executor.rpc(0, "no_such_method", timeout=SAFETY)
    assert executor.failure is None
    assert executor.rpc(0, "echo", args=("still serving",), timeout=SAFETY) == "still serving"


def test_a_timeout_stops_the_wait_not_the_work_and_never_retries(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    pending = executor.rpc(0, "slow_increment", args=(0.3,), non_block=True)
    with pytest.raises(TimeoutError, match="may still be running"):
        pending.result(timeout=0.05)
    assert pending.result(timeout=SAFETY) == 1  # the same call finished; the wait did not cancel it
    with pytest.raises(TimeoutError, match="may still be running"):
        executor.rpc(0, "slow_increment", args=(0.3,), timeout=0.05)
    # Queued behind the timed-out call, which ran exactly once (no retry).
    assert executor.rpc(0, "count", timeout=SAFETY) == 2
    assert executor.failure is None


def test_resolve_uses_one_shared_deadline(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    # Three calls on one rank run one after another, 0.25 s apart. Waiting on each with
    # its own 0.55 s budget would succeed; one shared 0.55 s deadline cannot.
    calls = [executor.rpc(0, "sleep_then", args=(0.25, i), non_block=True) for i in range(3)]
    with pytest.raises(TimeoutError):
        resolve([calls[0], (calls[1], calls[2])], timeout=0.55)
    assert resolve([calls[0], (calls[1], calls[2], "plain")], timeout=SAFETY) == [0, (1, 2, "plain")]
    assert resolve({"not": "walked"}, timeout=0) == {"not": "walked"}


def test_busy_is_not_dead(make_executor: Callable[..., Executor]) -> None:
    executor = make_executor()
    listener = RecordingListener()
    executor.register_failure_listener(listener)
    # Long enough for several monitor rounds to queue behind the busy worker.
    assert executor.rpc(0, "sleep_then", args=(0.7, "done"), timeout=SAFETY) == "done"
    executor.check_health(timeout=SAFETY)
    assert executor.failure is None
    assert listener.calls == []


def test_owned_shutdown_runs_hooks_fails_pending_waits_and_rejects_calls(
    make_executor: Callable[..., Executor], marker_dir: Path
) -> None:
    executor = make_executor()
    n = len(executor.config.workers)
    listener = RecordingListener()
    executor.register_failure_listener(listener)
    pending = executor.rpc(0, "sleep_then", args=(0.3, "late"), non_block=True)
    executor.shutdown()
    with pytest.raises(RuntimeError, match="executor is shut down"):
        pending.result(timeout=SAFETY)
    assert sorted(p.name for p in marker_dir.glob("shutdown-*")) == [f"shutdown-{r}" for r in range(n)]
    with pytest.raises(RuntimeError, match="executor is shut down"):
        executor.rpc(0, "whoami")
    with pytest.raises(RuntimeError, match="executor is shut down"):
        executor.collective_rpc("whoami")
    executor.shutdown()  # idempotent
    assert executor.closed and executor.failure is None
    assert listener.calls == []  # a normal shutdown is not a failure


def test_a_failed_constructor_cleans_up_the_workers_already_started(
    make_executor: Callable[..., Executor], marker_dir: Path, executor_backend: str
) -> None:
    n = 1 if executor_backend == "uni" else 2
    specs = tuple(
        WorkerSpec(SampleWorker, args=(rank,), kwargs={"marker_dir": str(marker_dir), "fail_construct": rank == n - 1})
        for rank in range(n)
    )
    with pytest.raises(ExecutorLaunchError) as caught:
        make_executor(specs=specs)
    assert caught.value.rank == n - 1
    assert "refuses to start" in str(caught.value) + str(caught.value.__cause__)
    for pid_file in marker_dir.glob("pid-*"):
        pid = int(pid_file.read_text())
        if pid != os.getpid():  # uni constructs in this very process
            wait_until(lambda: not pid_alive(pid), what=f"worker process {pid} exiting")

