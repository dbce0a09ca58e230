"""A worker class for the executor tests, importable by spawned children and Ray actors.

It records what a test needs to observe from outside: its process id (a
``pid-<rank>`` file in ``marker_dir``), its ``shutdown()`` hook (a
``shutdown-<rank>`` file), the CUDA mask it saw while being constructed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


class WorkerBoom(Exception):
    """The exception a worker raises on purpose."""


class SampleWorker:
    def __init__(
        self,
        rank: int,
        marker_dir: str | None = None,
        construct_delay: float = 0.0,
        fail_construct: bool = False,
    ) -> None:
        self.rank = rank
        self.counter = 0
        self.marker_dir = marker_dir
        self.cuda_at_construction = os.environ.get("CUDA_VISIBLE_DEVICES")
        if marker_dir is not None:
            Path(marker_dir, f"pid-{rank}").write_text(str(os.getpid()))
        if fail_construct:
            raise WorkerBoom(f"rank {rank} refuses to start")
        time.sleep(construct_delay)

    def whoami(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value: Any) -> Any:
        return value

    def main_module_name(self) -> str:
        """``__mp_main__`` when this process re-imported its parent's main module, else ``__main__``."""
        return str(sys.modules["__main__"].__name__)

    def add(self, amount: int) -> tuple[int, int]:
        self.counter += amount
        return self.rank, self.counter

    def count(self) -> int:
        return self.counter

    def sleep_then(self, seconds: float, value: Any = None) -> Any:
        time.sleep(seconds)
        return value

    def slow_increment(self, seconds: float) -> int:
        time.sleep(seconds)
        self.counter += 1
        return self.counter

    def rank_after_delay(self, step: float, ranks: int) -> int:
        # Lower ranks finish last, so a result list in rank order is not completion order.
        time.sleep(step * (ranks - self.rank))
        return self.rank

    def rendezvous(self, directory: str, ranks: int, timeout: float) -> int:
        """Arrive, then wait for every rank; only succeeds if all ranks run at the same time."""
        Path(directory, f"arrived-{self.rank}").touch()
        deadline = time.monotonic() + timeout
        while len(list(Path(directory).glob("arrived-*"))) < ranks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: the other ranks never arrived")
            time.sleep(0.01)
        return self.rank

    def boom(self, message: str) -> None:
        raise WorkerBoom(message)

    def cuda_mask(self) -> str | None:
        return self.cuda_at_construction

    def unpicklable(self) -> Any:
        return threading.Lock()

    def ignore_sigterm_and_sleep(self, seconds: float) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.marker_dir is not None:
            # Tells the test SIGTERM is ignored from now on, so it need not guess with a sleep.
            Path(self.marker_dir, f"sigterm-ignored-{self.rank}").touch()
        time.sleep(seconds)

    def ray_node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def shutdown(self) -> None:
        if self.marker_dir is not None:
            Path(self.marker_dir, f"shutdown-{self.rank}").write_text(str(os.getpid()))


class ExpensiveArgument:
    """Holds a lock, so it cannot cross a spawn boundary."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
