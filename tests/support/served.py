"""A real ``tidelog serve`` process on loopback, for tests that attack it over HTTP.

:func:`serve_process` (and :func:`serve_process_sync`) write a config (journal, token, a checkpoint root and an extra allowed
root under ``tmp``, short header and body deadlines), starts ``python -m engine.cli serve`` with
its log in a file, waits until ``/readyz`` says it leads, and stops it with SIGTERM at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa
import yaml

from engine.demos.ports import free_port
from journal import Journal, models

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hostile-input-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Served:
    base: str
    port: int
    root: Path
    extra_root: Path
    log: Path
    journal_url: str
    #: The serve process (set once it is started), for a test that kills it.
    pid: int = 0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def journal_events(journal_url: str) -> int:
    """Events other than the lease log's (renewals and elections are not a request's doing)."""
    journal = Journal.open(journal_url)
    try:
        async with journal.read() as conn:
            e = models.events
            return int((await conn.execute(sa.select(sa.func.count()).select_from(e)
                                           .where(e.c.entity_kind != "leases"))).scalar_one())
    finally:
        await journal.dispose()


def write_config(journal_url: str, tmp: Path, **overrides: Any) -> tuple[Path, Served]:
    """The config of a server under ``tmp`` (its roots made), and what the server will be."""
    root, extra = tmp / "ckpts", tmp / "allowed"
    root.mkdir(parents=True, exist_ok=True)
    extra.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {
        "journal": {"url": journal_url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "api": {"host": "127.0.0.1", "port": port, "header_timeout_s": 1, "body_timeout_s": 1},
        "checkpoint": {"directory": str(root), "roots": [str(extra)]},
        "discovery": {"probe_timeout_s": 1, "interval_s": 60},
        "logging": {"level": "INFO", "format": "text"},
    }
    for section, values in overrides.items():
        # A section's keys are merged; a key that is not a section (``workflows: [...]``) is set.
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    cfg = tmp / "tidelog.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return cfg, Served(f"http://127.0.0.1:{port}", port, root, extra, tmp / "serve.log", journal_url)


def _command(cfg: Path) -> list[str]:
    return [sys.executable, "-m", "engine.cli", "--config", str(cfg), "serve"]


@asynccontextmanager
async def serve_process(journal_url: str, tmp: Path, **overrides: Any) -> AsyncIterator[Served]:
    """``tidelog serve`` as a process, leading, for the ``async with`` block (see the module docs)."""
    cfg, served = write_config(journal_url, tmp, **overrides)
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN}
    with open(served.log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(*_command(cfg), cwd=ROOT, env=env, stdout=out, stderr=out)
    served.pid = proc.pid
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                if proc.returncode is not None:
                    raise RuntimeError(f"tidelog serve exited {proc.returncode}:\n{served.log_text()}")
                try:
                    async with s.get(f"{served.base}/readyz") as r:
                        if r.status == 200 and (await r.json()).get("leader"):
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"tidelog serve did not become ready:\n{served.log_text()}")
        yield served
    finally:
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass  # a test killed it already
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextmanager
def serve_process_sync(journal_url: str, tmp: Path, **overrides: Any) -> Iterator[Served]:
    """:func:`serve_process` for synchronous tests (hypothesis drives plain functions)."""
    cfg, served = write_config(journal_url, tmp, **overrides)
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN}
    with open(served.log, "wb") as out:
        proc = subprocess.Popen(_command(cfg), cwd=ROOT, env=env, stdout=out, stderr=out)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"tidelog serve exited {proc.returncode}:\n{served.log_text()}")
            try:
                with urllib.request.urlopen(f"{served.base}/readyz", timeout=2) as r:
                    if json.loads(r.read()).get("leader"):
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError(f"tidelog serve did not become ready:\n{served.log_text()}")
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


__all__ = ["AUTH", "TOKEN", "Served", "journal_events", "serve_process", "serve_process_sync",
           "write_config"]
