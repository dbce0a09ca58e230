"""Fixtures of the reference-participant tests: real processes, killed when the test ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.reference_procs import Controller, Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Starts reference servers for one test; SIGKILLs every one still running at the end."""
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
async def controller() -> AsyncIterator[Controller]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        yield Controller(http)
