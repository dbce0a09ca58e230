"""Fencing: two ``tidelog serve`` processes on one PostgreSQL journal.

Orchestrator A leads (epoch 1) and is in the middle of probing a participant (a real
aiohttp server that holds A's status call open). A is stopped with SIGSTOP past its
lease; B takes over with epoch 2 and probes the participant, which from then on
refuses epoch 1. The participant drops A's held call and A is continued: A's retry
carries epoch 1 and is refused, A writes nothing to the journal, and A ends up a
standby while B keeps the lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
import yaml

from engine.demos.ports import free_port
from journal import Journal, audit, models
from tests.support.backends import only_postgresql
from tests.support.counting_server import CountingServer

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow, only_postgresql]


def write_config(path: Path, journal_url: str, holder: str, port: int, target: str) -> Path:
    path.write_text(yaml.safe_dump({
        "journal": {"url": journal_url},
        "orchestrator": {"id": holder, "lease_ttl_s": 2.0, "lease_renew_s": 0.5, "shutdown_grace_s": 3},
        "api": {"port": port},
        "rpc": {"retry_backoff_s": 0.05},
        "discovery": {"probe_timeout_s": 60, "probe_tries": 3, "interval_s": 0.5},
        "participants": [{"name": "env-0", "url": target}],
        "logging": {"level": "INFO"},
    }))
    return path


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def status(port: int) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/status",
                                                       timeout=aiohttp.ClientTimeout(total=2)) as r:
            result: dict[str, Any] = await r.json()
            return result
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def test_stopped_leader_is_fenced(journal_url: str, tmp_path: Path) -> None:
    server = CountingServer(hold_epoch=1)
    target = await server.start()
    port_a, port_b = free_port(), free_port()
    cfg_a = write_config(tmp_path / "a.yaml", journal_url, "orch-a", port_a, target)
    cfg_b = write_config(tmp_path / "b.yaml", journal_url, "orch-b", port_b, target)
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": "fencing-test-token"}
    procs: list[asyncio.subprocess.Process] = []

    async def serve(cfg: Path) -> asyncio.subprocess.Process:
        p = await asyncio.create_subprocess_exec(sys.executable, "-m", "engine.cli", "--config", str(cfg), "serve",
                                                 cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                 stderr=open(cfg.with_suffix(".log"), "wb"))
        procs.append(p)
        return p

    journal = Journal.open(journal_url)
    try:
        a = await serve(cfg_a)

        async def a_leads() -> bool:
            s = await status(port_a)
            return s is not None and s["role"] == "leader"

        await until(a_leads, "A to lead")
        await until(lambda: _true(server.held.is_set()), "A's probe to reach the participant")
        await serve(cfg_b)
        await until(lambda: _not_none(status(port_b)), "B to serve")

        a.send_signal(signal.SIGSTOP)
        await until(lambda: _true(server.max_epoch == 2), "B to take over and probe with epoch 2")
        b_status = await status(port_b)
        assert b_status is not None and b_status["role"] == "leader"
        assert b_status["lease"]["holder"] == "orch-b" and b_status["lease"]["epoch"] == 2

        async with journal.read() as conn:
            e = models.events
            takeover = (await conn.execute(sa.select(sa.func.max(e.c.seq))
                                           .where(e.c.entity_kind == "leases", e.c.actor == "orch-b"))).scalar()
        assert takeover is not None

        # The participant drops A's held call; A runs again and retries it with epoch 1.
        server.release.set()
        a.send_signal(signal.SIGCONT)
        await until(lambda: _true(any(ep == 1 for _, ep in server.refused)), "A's stale call to be refused")

        async def a_standby() -> bool:
            s = await status(port_a)
            return s is not None and s["role"] == "standby"

        await until(a_standby, "A to step down")
        await asyncio.sleep(1.0)  # let A do whatever it would still try

        async with journal.read() as conn:
            late = (await conn.execute(sa.select(e.c.seq, e.c.entity_kind, e.c.to_state)
                                       .where(e.c.actor == "orch-a", e.c.seq > takeover))).all()
            lease_row = (await conn.execute(sa.select(models.leases))).one()
        assert late == [], f"the fenced leader wrote {late}"
        assert (lease_row.holder, lease_row.epoch) == ("orch-b", 2)
        assert server.refused and all(ep == 1 for _, ep in server.refused)
        assert await audit.verify(journal) == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), timeout=15)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        await journal.dispose()
        await server.stop()
    # Graceful SIGTERM: both exit 0.
    assert [p.returncode for p in procs] == [0, 0]
    # The control token never reaches a log line.
    for cfg in (cfg_a, cfg_b):
        log_text = cfg.with_suffix(".log").read_text()
        assert '"msg": "serving"' in log_text
        assert "fencing-test-token" not in log_text


async def _true(value: bool) -> bool:
    return value


async def _not_none(aw: Awaitable[Any]) -> bool:
    return (await aw) is not None
