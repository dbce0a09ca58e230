"""mp-only behaviour: spawn pickling, options, CUDA masks, escalation, launch deadline, parent death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers.executor.sample_worker import ExpensiveArgument, SampleWorker
from tests.workers.executor.support import REPO_ROOT, pid_alive, wait_until
from workers.executor import (
    Executor,
    ExecutorConfig,
    ExecutorConfigError,
    MpExecutor,
    RemoteWorkerError,
    SpawnPickleError,
    WorkerSpec,
)

SAFETY = 30.0


def mp(*specs: WorkerSpec, **config: object) -> MpExecutor:
    config.setdefault("kill_grace_s", 2.0)
    executor = Executor.create(ExecutorConfig(backend="mp", workers=specs, **config))  # type: ignore[arg-type]
    assert isinstance(executor, MpExecutor)
    return executor


def test_specs_that_cannot_cross_spawn_are_named_before_any_process_starts() -> None:
    class LocalWorker:  # a local class cannot be imported by a spawned child
        pass

    cases = [
        WorkerSpec(LocalWorker),
        WorkerSpec(SampleWorker, args=(lambda: 0,)),
        WorkerSpec(SampleWorker, args=(0,), kwargs={"marker_dir": ExpensiveArgument()}),
    ]
    for spec in cases:
        with pytest.raises(SpawnPickleError, match=r"workers\[1\].*must be spawn-pickleable") as caught:
            mp(WorkerSpec(SampleWorker, args=(0,)), spec)
        assert isinstance(caught.value, TypeError)
        assert caught.value.field == "ExecutorConfig.workers[1]"
        assert spec.name in str(caught.value)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"options": {"num_cpus": 1}}, "ExecutorConfig.options"),
        ({"node_id": "abc"}, "ExecutorConfig.node_id"),
        ({"workers": (WorkerSpec(SampleWorker, args=(0,), options={"num_cpus": 1}),)}, "ExecutorConfig.workers[0].options"),
        ({"workers": (WorkerSpec(SampleWorker, args=(0,), options={"cuda_visible_devices": 3.5}),)},
         "ExecutorConfig.workers[0].options.cuda_visible_devices"),
    ],
)
def test_mp_refuses_options_it_cannot_honour(config: dict[str, object], field: str) -> None:
    config.setdefault("workers", (WorkerSpec(SampleWorker, args=(0,)),))
    with pytest.raises(ExecutorConfigError) as caught:
        Executor.create(ExecutorConfig(backend="mp", **config))  # type: ignore[arg-type]
    assert caught.value.field == field


def test_cuda_mask_is_set_before_the_worker_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    executor = mp(
        WorkerSpec(SampleWorker, args=(0,), options={"cuda_visible_devices": [2, 3]}),
        WorkerSpec(SampleWorker, args=(1,)),
    )
    try:
        assert executor.collective_rpc("cuda_mask", timeout=SAFETY) == ["2,3", None]
    finally:
        executor.shutdown()


def test_unpicklable_reply_is_an_ordinary_error(tmp_path: Path) -> None:
    executor = mp(WorkerSpec(SampleWorker, args=(0,)))
    try:
        with pytest.raises(RemoteWorkerError, match="could not be pickled"):
            executor.rpc(0, "unpicklable", timeout=SAFETY)
        assert executor.failure is None
        assert executor.rpc(0, "whoami", timeout=SAFETY) == 0
    finally:
        executor.shutdown()


def test_shutdown_sends_sigterm_after_the_grace_and_the_hook_still_runs(marker_dir: Path) -> None:
    executor = mp(WorkerSpec(SampleWorker, args=(0,), kwargs={"marker_dir": str(marker_dir)}), shutdown_grace_s=0.2)
    executor.rpc(0, "sleep_then", args=(120.0,), non_block=True)
    time.sleep(0.3)  # let the call reach the child before stopping it
    executor.shutdown()
    # SIGTERM became SystemExit inside the 120 s sleep, so the finally block ran the hook.
    assert (marker_dir / "shutdown-0").exists()
    assert executor.exitcodes[0] == 128 + signal.SIGTERM


def test_shutdown_escalates_to_sigkill(marker_dir: Path) -> None:
    executor = mp(
        WorkerSpec(SampleWorker, args=(0,), kwargs={"marker_dir": str(marker_dir)}),
        shutdown_grace_s=0.1,
        kill_grace_s=0.3,
    )
    executor.rpc(0, "ignore_sigterm_and_sleep", args=(120.0,), non_block=True)
    # The child reports SIG_IGN installed (a fixed sleep would race a loaded machine).
    wait_until((marker_dir / "sigterm-ignored-0").exists, what="the child ignoring SIGTERM")
    executor.shutdown()
    assert executor.exitcodes[0] == -signal.SIGKILL


def test_shutdown_after_a_failure_returns_only_once_the_peers_are_stopped(marker_dir: Path) -> None:
    # The failure's retirement SIGTERMs the peer, which ignores it, so it runs on for
    # kill_grace_s until SIGKILL; the owner's shutdown() must not return before that.
    executor = mp(
        *(WorkerSpec(SampleWorker, args=(rank,), kwargs={"marker_dir": str(marker_dir)}) for rank in range(2)),
        kill_grace_s=2.5,
    )
    executor.rpc(1, "ignore_sigterm_and_sleep", args=(120.0,), non_block=True)
    wait_until((marker_dir / "sigterm-ignored-1").exists, what="rank 1 ignoring SIGTERM")
    pid0, pid1 = executor.pids
    assert pid0 is not None and pid1 is not None
    os.kill(pid0, signal.SIGKILL)
    wait_until(lambda: executor.failure is not None, what="the failure being detected")
    executor.shutdown()
    # No polling here: when shutdown() returns, the retired peer is already gone.
    assert executor.exitcodes == (-signal.SIGKILL, -signal.SIGKILL)
    assert not pid_alive(pid1)


def test_constructors_share_one_launch_deadline_and_slow_ones_are_stopped(marker_dir: Path) -> None:
    specs = [
        WorkerSpec(SampleWorker, args=(rank,), kwargs={"marker_dir": str(marker_dir), "construct_delay": 120.0})
        for rank in range(2)
    ]
    with pytest.raises(TimeoutError, match="launch_timeout_s=1.0"):
        mp(*specs, launch_timeout_s=1.0)
    for pid_file in marker_dir.glob("pid-*"):
        pid = int(pid_file.read_text())
        wait_until(lambda: not pid_alive(pid), what=f"worker {pid} being stopped")


def test_children_stop_when_the_parent_dies(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    script = f"""
import os, signal
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from tests.workers.executor.sample_worker import SampleWorker
if __name__ == "__main__":
    ex = Executor.create(ExecutorConfig(backend="mp", workers=tuple(WorkerSpec(SampleWorker, args=(r,)) for r in range(2))))
    open({str(pids_file)!r}, "w").write(" ".join(str(p) for p in ex.collective_rpc("pid", timeout=60)))
    os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit: only the children's watchdog can react
"""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, timeout=SAFETY, check=False)
    assert done.returncode == -signal.SIGKILL
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    for pid in pids:
        wait_until(lambda: not pid_alive(pid), what=f"orphaned worker {pid} exiting")



def test_a_child_imports_the_parents_main_only_when_a_spec_refers_to_it(tmp_path: Path) -> None:
    # The parent's main here is a script that announces its import: a child that re-imports it
    # (as ``__mp_main__``) writes a line, so the count tells which children did.
    imports = tmp_path / "imports"
    (tmp_path / "entry.py").write_text(f"""
import json
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from tests.workers.executor.sample_worker import SampleWorker

with open({str(imports)!r}, "a") as f:
    f.write(__name__ + "\\n")


class MainWorker(SampleWorker):
    pass


if __name__ == "__main__":
    seen = {{}}
    for name, cls in (("imported", SampleWorker), ("defined in main", MainWorker)):
        ex = Executor.create(ExecutorConfig(backend="mp", workers=(WorkerSpec(cls, args=(0,)),)))
        try:
            seen[name] = ex.collective_rpc("main_module_name", timeout=60)
        finally:
            ex.shutdown()
    print(json.dumps(seen))
""")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done = subprocess.run([sys.executable, "entry.py"], env=env, cwd=tmp_path, timeout=SAFETY,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"imported": ["__main__"], "defined in main": ["__mp_main__"]}
    assert imports.read_text().split() == ["__main__", "__mp_main__"]
