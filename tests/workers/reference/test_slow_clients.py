"""Slow clients against a real reference participant (issue 13, defect 10): a client trickling its
request head is cut off after ``--header-timeout-s``; one trickling a body gets 408 ``body_timeout``
in the JSON error shape after ``--body-timeout-s``, on a control route and on a data route; the
server goes on answering everyone else."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.reference_procs import TOKEN, ParticipantClient, Procs


async def _trickle_head(host: str, port: int) -> bool:
    """Send a request head one byte every 0.2 s for up to 60 s; whether the server hung up first."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /ng-control/v1/checkpoint/status HTTP/1.1\r\nHost: x\r\n")
        for _ in range(300):
            writer.write(b"X")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                    return True
            except TimeoutError:
                continue
        return False
    except ConnectionError:
        return True
    finally:
        writer.close()


async def _trickle_body(host: str, port: int, path: str) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_slow_heads_and_bodies_are_cut_off(procs: Procs, controller: ParticipantClient, tmp_path: Path) -> None:
    server = await procs.astart("resources", tmp_path / "state", "--header-timeout-s", "1", "--body-timeout-s", "1")
    url = urlsplit(server.url)
    host, port = url.hostname or "127.0.0.1", int(url.port or 0)
    cut = await asyncio.gather(*(_trickle_head(host, port) for _ in range(30)))
    assert all(cut), cut
    for path in ("/ng-control/v1/checkpoint/prepare", "/ng-rollout/r1/seed_session"):
        status, body = await _trickle_body(host, port, path)
        assert (status, body["error"]["code"]) == (408, "body_timeout"), (path, status, body)  # type: ignore[index]
    assert (await controller.status(server.url))["phase"] == "idle"
