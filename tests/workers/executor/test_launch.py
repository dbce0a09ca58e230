"""Launch readiness: one ``launch_timeout_s`` deadline shared by every rank (mp and ray).

uni builds its one worker in the caller's process, so it has no readiness wait to share.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.workers.executor.sample_worker import SampleWorker
from tests.workers.executor.support import pid_alive, wait_until
from workers.executor import Executor, WorkerSpec


@pytest.fixture(params=["mp", "ray"])
def executor_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


def test_the_launch_deadline_is_shared_by_all_ranks_not_renewed_per_rank(
    make_executor: Callable[..., Executor], marker_dir: Path, executor_backend: str
) -> None:
    # Rank 0 is ready after ~2 s and rank 1 after ~5 s; each alone fits a 4 s budget measured
    # from when its own wait begins (rank 1's wait would begin at ~2 s and end at ~6 s), but
    # rank 1 cannot be ready before one deadline 4 s after the launch began, whatever the
    # process start-up costs: a per-rank deadline would succeed here, a shared one must not.
    specs = tuple(
        WorkerSpec(SampleWorker, args=(rank,), kwargs={"marker_dir": str(marker_dir), "construct_delay": delay})
        for rank, delay in enumerate((2.0, 5.0))
    )
    with pytest.raises(TimeoutError, match=r"launch_timeout_s=4\.0 \(shared by all ranks\)"):
        make_executor(specs=specs, launch_timeout_s=4.0)
    # The ranks already started were cleaned up (mp: processes; ray: actors' worker processes).
    for pid_file in marker_dir.glob("pid-*"):
        pid = int(pid_file.read_text())
        wait_until(lambda: not pid_alive(pid), what=f"worker {pid} being stopped after the launch timeout")
