"""Helpers shared by the executor tests (listeners, polling, process checks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BACKENDS = ("uni", "mp", "ray")
REPO_ROOT = str(Path(__file__).resolve().parents[3])


def ranks(backend: str) -> int:
    """How many ranks the shared tests use: uni takes one worker, the others two."""
    return 1 if backend == "uni" else 2


class RecordingListener:
    """A failure listener that records every call."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def on_executor_failure(self, failure: Any) -> None:
        self.calls.append(failure)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` (a safety-net timeout, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
