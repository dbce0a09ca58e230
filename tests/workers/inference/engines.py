"""Helpers of the inference-engine tests: the engine under test, its process, polling."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.zygote import Child, start_server

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Target:
    url: str
    kind: str  # "reference" or "sglang"
    initial_dir: str
    initial_version: str
    other_dir: str | None
    log: Path | None = None

    def require_reference(self, why: str) -> None:
        if self.kind != "reference":
            pytest.skip(f"needs the reference engine: {why}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log and self.log.exists() else ""


class EngineProc:
    """``python -m workers.inference.reference`` as a child process (forked from this test process's
    zygote by :func:`tests.support.zygote.start_server`: it and torch are imported there once);
    SIGKILLed by :meth:`kill`."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self.proc: Child | None = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> EngineProc:
        self.proc, self.url = start_server("workers.inference.reference", self.args, env=dict(os.environ),
                                           cwd=REPO, log=self.log, timeout=timeout, what="reference engine")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@dataclass
class Recorded:
    """HTTP requests an adapter sent, as ``(method, path)``."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [path for _, path in self.calls]


async def until(check: Any, timeout: float = 120.0, what: str = "condition") -> Any:
    """Poll ``await check()`` until it is truthy; fail after ``timeout`` seconds (a safety net)."""
    end = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
