"""Fuzz every control route of a real participant server (issue 13).

A reference resources server (``workers.reference.resources``, built in process and served by
aiohttp on loopback in its own thread) gets random sequences of requests over a raw HTTP client:
random headers (non-UTF-8 bytes included, with and without the right bearer), query strings and
bodies (JSON near the request models, random JSON, deep nesting, random bytes, NULs, huge numbers,
``checkpoint_dir`` values that are relative, hold ``..``, are ``/``, lie outside the root, or pass
through links planted in the root, to a FIFO or to ``/dev/zero``). After every request: never a
5xx, and every error is ``{"error": {"code", "detail"}}``. After every sequence: nothing outside
the checkpoint root changed (a snapshot of the tree around it, the working directory and ``/gym``).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.workers.test_hostile import snapshot
from workers.participant import storage
from workers.protocol import ROUTES
from workers.reference import resources

TOKEN = "fuzz-token"
OPS = ("status", *ROUTES)


@dataclass
class Served:
    base: Path
    root: Path
    port: int
    plants: dict[str, str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("fuzz")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("outside the root")
    plants = {"dir-link": "link", "gym-link": "ckg", "kind-link": "ckk", "instance-link": "cki",
              "fifo": "fifo", "zero": "zero", "good": "good"}
    (root / "link").symlink_to(outside)
    (root / "ckg").mkdir()
    (root / "ckg" / "gym").symlink_to(outside)
    (root / "ckk" / "gym").mkdir(parents=True)
    (root / "ckk" / "gym" / "resources").symlink_to(outside)
    (root / "cki" / "gym" / "resources").mkdir(parents=True)
    (root / "cki" / "gym" / "resources" / "resources-0").symlink_to(outside)
    for name in ("fifo", "zero", "good"):
        storage.write_records(root / name, "resources", "resources-0", "c1", [])
    fifo_dir = storage.participant_dir(root / "fifo", "resources", "resources-0")
    (fifo_dir / "manifest.json").unlink()
    os.mkfifo(fifo_dir / "manifest.json")
    zero_dir = storage.participant_dir(root / "zero", "resources", "resources-0")
    records = next(zero_dir.glob("records-*.jsonl"))
    records.unlink()
    records.symlink_to("/dev/zero")

    args = argparse.Namespace(host="127.0.0.1", port=0, state_dir=base / "state", checkpoint_root=root,
                              instance="resources-0", lease_grace_seconds=600.0, mode="exported",
                              verify_mode="wait", task="hex")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(resources.build_app(args, TOKEN), access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield Served(base, root, holder["port"], plants)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _dirs(root: Path) -> st.SearchStrategy[str]:
    fixed = ["/", "", ".", "..", "ck", "../ck", "root/ck", "/tmp", "/etc", "/gym", f"{root}/../outside",
             f"{root}/ck/../../outside", f"{root}-evil", f"{root}/a\x00b", str(root), f"{root}//x/./y",
             f"{root}/link", f"{root}/link/x", f"{root}/ckg", f"{root}/ckk", f"{root}/cki", f"{root}/fifo",
             f"{root}/zero", f"{root}/good", f"{root}/new", f"{root.parent}/outside", "~/ck", "x" * 5000]
    return st.sampled_from(fixed) | st.text(max_size=24) | st.builds(
        lambda tail: f"{root}/{tail}", st.text(alphabet="ab./-\x00", max_size=12))


json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(10**40), max_value=10**40)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
deadlines = (st.just("soon") | st.just("soon") | st.just("soon") | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [1e308, -1e308, 0, 4e9, 1e13, "soon", "soon", "soon"]) | st.integers(min_value=-(10**30), max_value=10**30))
episodes = st.lists(st.fixed_dictionaries({"rollout_id": st.sampled_from(["r1", "r2", "x-a1", ""]) | st.text(max_size=6),
                                           "attempt": st.integers(min_value=-2, max_value=10**20)}), max_size=3)


@st.composite
def bodies(draw: st.DrawFn, root: Path) -> bytes:
    kind = draw(st.sampled_from(["model"] * 6 + ["json", "bytes", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        depth = draw(st.sampled_from([10, 1025, 5000, 100_000]))
        return b"[" * depth + b"]" * depth
    if kind == "json":
        return json.dumps(draw(json_any)).encode()
    deadline = draw(deadlines)
    # CID is this sequence's own checkpoint id (ids are fenced once resumed, so each sequence needs one).
    body: dict[str, Any] = {"checkpoint_id": draw(st.sampled_from(["CID", "CID", "CID", "c1"]) | st.text(max_size=8)),
                            "deadline_ts": time.time() + 20 if deadline == "soon" else deadline}
    if draw(st.integers(0, 3)):
        body["checkpoint_dir"] = draw(_dirs(root))
    if draw(st.booleans()):
        body["episode_ids"] = draw(st.one_of(st.just([]), st.just([{"rollout_id": "r1"}]), episodes, st.none()))
    if draw(st.booleans()):
        body["rollout_ids"] = draw(st.lists(st.sampled_from(["r1", "r2"]) | st.text(max_size=5), max_size=2))
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.text(max_size=5))] = draw(json_leaf)
    return json.dumps(body).encode()


header_bytes = st.binary(max_size=24).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F))
# Mostly the right bearer, so bodies reach the control plane; the rest probe authentication.
auth = st.one_of(*[st.just("right")] * 6, st.sampled_from([None, "wrong"]), header_bytes.map(lambda b: b"Bearer " + b))


@st.composite
def requests(draw: st.DrawFn, root: Path) -> tuple[str, str, bytes | str | None, dict[str, bytes], bytes]:
    op = draw(st.sampled_from(OPS) | st.sampled_from(["commit", "restore"]))
    query = urllib.parse.quote(draw(st.text(max_size=16)), safe="=&") if draw(st.booleans()) else ""
    token = draw(auth)
    headers = {name: draw(header_bytes) for name in draw(st.lists(st.sampled_from(
        ["X-Fuzz", "Accept", "Content-Type", "Cookie", "X-Forwarded-For", "Authorization-Extra"]),
        max_size=3, unique=True))}
    return op, query, token, headers, draw(bodies(root))


def _send(port: int, op: str, query: str, token: bytes | str | None, headers: dict[str, bytes],
          body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        method = "GET" if op == "status" else "POST"
        conn.putrequest(method, f"/ng-control/v1/checkpoint/{op}" + (f"?{query}" if query else ""))
        if token == "right":
            conn.putheader("Authorization", f"Bearer {TOKEN}")
        elif token == "wrong":
            conn.putheader("Authorization", "Bearer not-the-token")
        elif isinstance(token, bytes):
            conn.putheader("Authorization", token)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _check_reply(status: int, raw: bytes, what: Any) -> None:
    assert status < 500, (status, raw[:300], what)
    reply = json.loads(raw)
    if status >= 400:
        assert isinstance(reply, dict) and set(reply) == {"error"}, (status, reply, what)
        assert set(reply["error"]) == {"code", "detail"}, (status, reply, what)
        assert isinstance(reply["error"]["code"], str) and isinstance(reply["error"]["detail"], str)


def _outside(served: Served) -> tuple[dict[str, tuple[str, int]], list[str], bool]:
    seen = snapshot(served.base, skip=served.root)
    # The participant's own state (its retired-marks SQLite database) is its to write: what is there
    # counts, not the sizes, which change as SQLite checkpoints its WAL (once seen as a flaky failure).
    seen = {k: (kind, 0) if k.startswith("state/") else (kind, size) for k, (kind, size) in seen.items()}
    return (seen | {"(root entries)": ("dir", 0)},
            sorted(os.listdir(os.getcwd())), os.path.lexists("/gym"))


def _tidy(served: Served) -> None:
    """Resume whatever checkpoint the sequence left open, so the next one can prepare and commit."""
    status, raw = _send(served.port, "status", "", "right", {}, b"")
    assert status == 200, raw
    active = json.loads(raw)["checkpoint_id"]
    if active is not None:
        body = json.dumps({"checkpoint_id": active, "deadline_ts": time.time() + 20}).encode()
        status, raw = _send(served.port, "resume", "", "right", {}, body)
        assert status == 200, raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_every_control_route_survives_random_requests(served: Served, data: st.DataObject) -> None:
    before = _outside(served)
    cid = f"f{time.time_ns()}"
    sequence = data.draw(st.lists(requests(served.root), min_size=1, max_size=5))
    # Every sequence starts with a well-formed commit or restore into a drawn directory (after a
    # prepare for a commit), so each example reaches the confinement and storage code.
    directed = data.draw(st.sampled_from(["commit", "restore"]))
    directory = data.draw(_dirs(served.root))
    store = {"checkpoint_id": cid, "deadline_ts": time.time() + 20, "checkpoint_dir": directory, "episode_ids": []}
    opening = [("prepare", {"checkpoint_id": cid, "deadline_ts": time.time() + 20})] if directed == "commit" else []
    sequence[:0] = [(op, "", "right", {}, json.dumps(fields).encode()) for op, fields in [*opening, (directed, store)]]
    for op, query, token, headers, raw_body in sequence:
        body = raw_body.replace(b'"CID"', json.dumps(cid).encode())
        status, raw = _send(served.port, op, query, token, headers, body)
        _check_reply(status, raw, (op, token, body[:200]))
        event(f"{op} {status} {json.loads(raw).get('error', {}).get('code', '') if status >= 400 else ''}")
        if token not in ("right",) and op != "status":
            assert status == 401, (status, raw)
    _tidy(served)
    assert _outside(served) == before


def test_the_fuzzed_server_still_commits_into_its_root(served: Served) -> None:
    """The fuzz above left a working participant: a plain checkpoint into the root succeeds."""
    _tidy(served)
    cid = f"final-{time.time_ns()}"
    for op, extra in (("prepare", {}), ("commit", {"checkpoint_dir": str(served.root / cid), "episode_ids": []}),
                      ("resume", {})):
        body = json.dumps({"checkpoint_id": cid, "deadline_ts": time.time() + 20, **extra}).encode()
        status, raw = _send(served.port, op, "", "right", {}, body)
        assert status == 200, (op, raw)
    assert (served.root / cid / "gym" / "resources" / "resources-0" / "manifest.json").is_file()
