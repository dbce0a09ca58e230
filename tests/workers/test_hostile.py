"""Hostile and unlucky input on the participant control plane (issue 13), over real loopback HTTP.

Confinement: a commit or restore names a ``checkpoint_dir`` that must be an absolute path under the
participant's checkpoint root, reached through no symbolic link; anything else is 422
``checkpoint_dir_refused`` and writes nothing (the tree around the root is snapshotted before and
after). Reads: checkpoint files are regular files opened without following links or blocking, read
with a bound and a deadline, on the control plane's own thread pool. Bad headers, bodies and
deadlines are typed 4xx replies, never 500s.

Real parts throughout (a real aiohttp server, real files, FIFOs and links in the test's tmp_path);
the one stand-in is a default executor whose only thread the test holds, to show that storage work
does not need it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.participant_http import TOKEN, ControlServer, ScriptedEpisode, error_code
from workers.participant import storage
from workers.participant.kinds.environment import EnvironmentParticipant
from workers.protocol import MAX_DEADLINE_AHEAD_S, ErrorCode, ProtocolError


def snapshot(top: Path, *, skip: Path | None = None) -> dict[str, tuple[str, int]]:
    """Every entry under ``top`` (links not followed): its kind and size, ``skip``'s subtree left out."""
    seen: dict[str, tuple[str, int]] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in [*dirnames, *filenames]:
            path = here / name
            if skip is not None and path == skip:
                continue
            info = path.lstat()
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
            seen[str(path.relative_to(top))] = (kind, 0 if kind == "dir" else info.st_size)
    return seen


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ControlServer]:
    """A prepared environment participant whose checkpoint root is ``tmp_path/root``; ``tmp_path/outside``
    is a directory links point to."""
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    srv = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "state",
                              checkpoint_root=tmp_path / "root").start()
    yield srv
    await srv.stop()


async def committed_pair(tmp_path: Path) -> tuple[ControlServer, dict[str, Any]]:
    """One episode committed into ``root/ck`` by one participant; a fresh participant to restore into."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    first = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "s1", checkpoint_root=root).start()
    try:
        env = first.participant
        assert isinstance(env, EnvironmentParticipant)
        episode = ScriptedEpisode(env, "r1").start()
        await episode.in_step.wait()
        prepare = asyncio.create_task(first.ok("prepare", "c1"))
        while await first.phase() != "preparing":
            await asyncio.sleep(0.01)
        episode.release()
        await prepare
        manifest = (await first.ok("commit", "c1", checkpoint_dir=str(root / "ck")))["manifest"]
        await first.ok("resume", "c1")
        episode.release(3)
        await episode.task_handle  # type: ignore[misc]
    finally:
        await first.stop()
    fresh = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "s2", checkpoint_root=root).start()
    return fresh, manifest


def records_path(tmp_path: Path, manifest: dict[str, Any]) -> Path:
    return storage.participant_dir(tmp_path / "root" / "ck", "environment", "env-0") / manifest["records_file"]


async def restore(server: ControlServer, tmp_path: Path, seconds: float = 10.0,
                  directory: str | None = None) -> tuple[int, dict[str, Any]]:
    return await server.call("restore", "c1", seconds=seconds,
                             checkpoint_dir=directory or str(tmp_path / "root" / "ck"),
                             episode_ids=[{"rollout_id": "r1"}])


# -- 1. confinement -----------------------------------------------------------------------------

def _plant(tmp_path: Path, how: str) -> str:
    """The checkpoint_dir a commit names for ``how``, with any link it needs planted."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    if how == "slash":
        return "/"
    if how == "relative":
        return "ck-relative"
    if how == "dotdot":
        return f"{root}/ck/../../outside"
    if how == "outside":
        return str(outside / "ck")
    if how == "sibling-prefix":  # /x/root-evil is not under /x/root
        (tmp_path / "root-evil").mkdir()
        return str(tmp_path / "root-evil")
    if how == "dir-link":
        (root / "ck-link").symlink_to(outside)
        return str(root / "ck-link")
    if how == "gym-link":
        (root / "ck-g").mkdir()
        (root / "ck-g" / "gym").symlink_to(outside)
        return str(root / "ck-g")
    if how == "kind-link":
        (root / "ck-k" / "gym").mkdir(parents=True)
        (root / "ck-k" / "gym" / "environment").symlink_to(outside)
        return str(root / "ck-k")
    if how == "instance-link":
        (root / "ck-i" / "gym" / "environment").mkdir(parents=True)
        (root / "ck-i" / "gym" / "environment" / "env-0").symlink_to(outside)
        return str(root / "ck-i")
    raise ValueError(how)


@pytest.mark.parametrize("how", ["slash", "relative", "dotdot", "outside", "sibling-prefix", "dir-link",
                                 "gym-link", "kind-link", "instance-link"])
async def test_a_commit_outside_the_root_is_refused_and_writes_nothing(
        server: ControlServer, tmp_path: Path, how: str) -> None:
    directory = _plant(tmp_path, how)
    before = snapshot(tmp_path, skip=tmp_path / "state")
    cwd_before = sorted(os.listdir(os.getcwd()))
    slash_gym = Path("/gym").exists()
    await server.ok("prepare", "c1")
    status, body = await server.call("commit", "c1", checkpoint_dir=directory)
    assert (status, error_code(body)) == (422, "checkpoint_dir_refused"), body
    assert directory in body["error"]["detail"] or "symbolic link" in body["error"]["detail"], body
    assert snapshot(tmp_path, skip=tmp_path / "state") == before  # nothing written, in or out of root
    assert sorted(os.listdir(os.getcwd())) == cwd_before  # a relative path was not resolved here
    assert Path("/gym").exists() == slash_gym
    assert await server.phase() == "prepared"  # a refused commit pins nothing: a good one still works
    reply = await server.ok("commit", "c1", checkpoint_dir=str(tmp_path / "root" / "good"))
    assert (tmp_path / "root" / "good" / "gym" / "environment" / "env-0" / "manifest.json").is_file()
    assert reply["manifest"]["records_bytes"] == records_path_size(tmp_path / "root" / "good", reply["manifest"])


def records_path_size(directory: Path, manifest: dict[str, Any]) -> int:
    return (storage.participant_dir(directory, "environment", "env-0") / manifest["records_file"]).stat().st_size


async def test_a_participant_without_a_root_refuses_every_commit(tmp_path: Path) -> None:
    server = await ControlServer(EnvironmentParticipant("env-0"), tmp_path / "state", checkpoint_root=None).start()
    try:
        await server.ok("prepare", "c1")
        status, body = await server.call("commit", "c1", checkpoint_dir=str(tmp_path / "ck"))
        assert (status, error_code(body)) == (422, "checkpoint_dir_refused"), body
        assert "no checkpoint root" in body["error"]["detail"]
        assert not (tmp_path / "ck").exists()
    finally:
        await server.stop()


@pytest.mark.parametrize("how", ["outside", "dir-link", "relative"])
async def test_a_restore_outside_the_root_is_refused(tmp_path: Path, how: str) -> None:
    fresh, _ = await committed_pair(tmp_path)
    try:
        # A real checkpoint outside the root (written by a trusted caller), and links to it.
        storage.write_records(tmp_path / "outside" / "ck", "environment", "env-0", "c1", [])
        directory = {"outside": str(tmp_path / "outside" / "ck"),
                     "relative": "root/ck"}.get(how)
        if how == "dir-link":
            (tmp_path / "root" / "ck-link").symlink_to(tmp_path / "root" / "ck")  # even a link inside
            directory = str(tmp_path / "root" / "ck-link")
        status, body = await restore(fresh, tmp_path, directory=directory)
        assert (status, error_code(body)) == (422, "checkpoint_dir_refused"), body
        _, st = await fresh.status()
        assert st["phase"] == "idle" and st["retired_rollouts"] == 0  # refused before any mark
    finally:
        await fresh.stop()


def test_confine_accepts_the_root_as_configured_or_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    real, below = storage.confine(tmp_path / "alias", str(tmp_path / "alias" / "ck"))
    assert (real, below) == (tmp_path.resolve() / "real", ("ck",))
    assert storage.confine(tmp_path / "alias", str(tmp_path.resolve() / "real" / "a" / "b"))[1] == ("a", "b")
    for bad in ("", "ck", f"{tmp_path}/alias/../alias/ck", str(tmp_path / "realer")):
        with pytest.raises(ProtocolError) as info:
            storage.confine(tmp_path / "alias", bad)
        assert info.value.code is ErrorCode.CHECKPOINT_DIR_REFUSED


# -- 2. bounded, non-blocking reads -------------------------------------------------------------

@pytest.mark.parametrize("which", ["records", "manifest"])
async def test_a_fifo_in_a_checkpoint_is_refused_at_once(tmp_path: Path, which: str) -> None:
    """A FIFO would block an open for reading until a writer came: it is refused without waiting."""
    fresh, manifest = await committed_pair(tmp_path)
    try:
        target = records_path(tmp_path, manifest) if which == "records" else \
            records_path(tmp_path, manifest).parent / "manifest.json"
        target.unlink()
        os.mkfifo(target)
        started = time.monotonic()
        status, body = await restore(fresh, tmp_path, seconds=5.0)
        assert time.monotonic() - started < 2.0, "the restore waited on the FIFO"
        assert (status, error_code(body)) == (422, "invalid_checkpoint_state"), body
        assert "not a regular file" in body["error"]["detail"], body
    finally:
        await fresh.stop()


async def test_a_records_file_linked_to_dev_zero_fails_fast(tmp_path: Path) -> None:
    fresh, manifest = await committed_pair(tmp_path)
    try:
        path = records_path(tmp_path, manifest)
        path.unlink()
        path.symlink_to("/dev/zero")
        started = time.monotonic()
        status, body = await restore(fresh, tmp_path, seconds=5.0)
        assert time.monotonic() - started < 2.0
        assert (status, error_code(body)) == (422, "invalid_checkpoint_state"), body
        assert "symbolic link" in body["error"]["detail"]
    finally:
        await fresh.stop()


async def test_a_records_file_larger_than_declared_is_refused_unread(tmp_path: Path) -> None:
    fresh, manifest = await committed_pair(tmp_path)
    try:
        path = records_path(tmp_path, manifest)
        with open(path, "ab") as out:
            out.truncate(path.stat().st_size + (1 << 30))  # 1 GiB more, sparse: no newline in it
        status, body = await restore(fresh, tmp_path)
        assert (status, error_code(body)) == (422, "invalid_checkpoint_state"), body
        assert f"its manifest says {manifest['records_bytes']}" in body["error"]["detail"], body
    finally:
        await fresh.stop()


def test_a_manifest_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    storage.write_records(tmp_path, "environment", "env-0", "c1", [])
    path = storage.participant_dir(tmp_path, "environment", "env-0") / "manifest.json"
    with open(path, "ab") as out:
        out.truncate(storage.MANIFEST_MAX_BYTES + 1)
    with pytest.raises(ProtocolError) as info:
        storage.read_records(tmp_path, "environment", "env-0", lambda r: r)
    assert info.value.code is ErrorCode.INVALID_CHECKPOINT_STATE
    assert str(storage.MANIFEST_MAX_BYTES) in info.value.detail


def test_a_read_past_its_deadline_stops(tmp_path: Path) -> None:
    rows = [(f"r{i}", {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}}) for i in range(3000)]
    storage.write_records(tmp_path, "environment", "env-0", "c1", rows)
    with pytest.raises(ProtocolError) as info:
        storage.read_records(tmp_path, "environment", "env-0", lambda r: r, deadline=time.monotonic() - 1)
    assert info.value.code is ErrorCode.DEADLINE_EXCEEDED


def test_a_manifest_without_records_bytes_is_read_up_to_the_file_size(tmp_path: Path) -> None:
    """Manifests written before ``records_bytes`` existed still restore."""
    rows = [("r1", {"episode_id": {"rollout_id": "r1", "attempt": 0}})]
    manifest = storage.write_records(tmp_path, "environment", "env-0", "c1", rows)
    path = storage.participant_dir(tmp_path, "environment", "env-0") / "manifest.json"
    old = {k: v for k, v in manifest.items() if k != "records_bytes"}
    path.unlink()
    path.write_text(json.dumps(old))
    back, kept = storage.read_records(tmp_path, "environment", "env-0", lambda r: r)
    assert back == old and len(kept) == 1


async def test_storage_work_does_not_need_the_default_executor(tmp_path: Path) -> None:
    """Every thread of the loop's default executor is held (as blocked reads once held them): a
    commit and a restore still finish, on the control plane's own pool."""
    loop = asyncio.get_running_loop()
    blocker = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    loop.set_default_executor(blocker)
    held = loop.run_in_executor(None, release.wait, 30)
    try:
        fresh, _ = await asyncio.wait_for(committed_pair(tmp_path), 15)
        try:
            status, body = await restore(fresh, tmp_path, seconds=5.0)
            assert status == 200, body
        finally:
            await fresh.stop()
    finally:
        release.set()
        await held
        blocker.shutdown()


# -- 3, 4, 5. headers, bodies, deadlines --------------------------------------------------------

def _raw(server: ControlServer, request: bytes) -> tuple[int, bytes]:
    host, port = server.url.split("//", 1)[1].split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer " + TOKEN.encode() + b"\xc3",
                                   b"\xed\xa0\x80 Bearer"])
async def test_a_bearer_that_is_not_utf8_is_a_401(server: ControlServer, value: bytes) -> None:
    for method, op, body in (("GET", "status", b""), ("POST", "prepare", b"{}")):
        status, reply = await asyncio.to_thread(_raw, server, (
            f"{method} /ng-control/v1/checkpoint/{op} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + b"Authorization: " + value + b"\r\n\r\n" + body)
        assert status == 401, reply
        assert json.loads(reply)["error"]["code"] == "unauthorized"


async def test_a_nul_in_checkpoint_dir_is_a_422_naming_the_field(server: ControlServer, tmp_path: Path) -> None:
    await server.ok("prepare", "c1")
    for op in ("commit", "restore"):
        status, body = await server.call(op, "c1", checkpoint_dir=f"{tmp_path}/root/a\x00b", episode_ids=[])
        assert (status, error_code(body)) == (422, "invalid_request"), body
        assert "checkpoint_dir" in body["error"]["detail"] and "NUL" in body["error"]["detail"], body


async def test_deeply_nested_bodies_are_422s(server: ControlServer) -> None:
    for depth in (1000, 100_000):
        nested = b"[" * depth + b"]" * depth
        for raw in (nested, b'{"checkpoint_id": "c1", "deadline_ts": 1, "episode_ids": ' + nested + b"}"):
            for op in ("prepare", "retire", "commit"):
                status, body = await server.post(op, None, raw=raw)
                assert (status, error_code(body)) == (422, "invalid_request"), (op, depth, body)


# Ids, not values, name the cases: a value taken from the clock would differ between test workers.
@pytest.mark.parametrize("ahead", [1e308, MAX_DEADLINE_AHEAD_S + 60, "milliseconds"],
                         ids=["1e308", "7d+60s", "milliseconds"])
async def test_a_deadline_too_far_ahead_is_refused(server: ControlServer, ahead: float | str) -> None:
    if ahead == "milliseconds":
        deadline_ts = 1000 * time.time()  # a deadline in milliseconds where seconds are meant
    else:
        assert isinstance(ahead, float)
        deadline_ts = ahead if ahead > 1e12 else time.time() + ahead
    for op in ("prepare", "renew", "resume"):
        status, body = await server.post(op, {"checkpoint_id": "c1", "deadline_ts": deadline_ts})
        assert (status, error_code(body)) == (422, "invalid_request"), (op, body)
        assert "deadline_ts" in body["error"]["detail"] and "7 days" in body["error"]["detail"], body
    _, st = await server.status()
    assert st["phase"] == "idle" and st["lease_expires_at"] is None


async def test_a_deadline_within_the_bound_is_accepted(server: ControlServer) -> None:
    status, body = await server.post("prepare", {"checkpoint_id": "c1",
                                                 "deadline_ts": time.time() + MAX_DEADLINE_AHEAD_S - 60})
    assert status == 200, body
    await server.ok("resume", "c1")


def test_checkpoint_settings_take_an_absolute_root_only() -> None:
    from pydantic import ValidationError

    from workers.participant import CheckpointSettings
    assert CheckpointSettings(checkpoint_root="/srv/ck").checkpoint_root == "/srv/ck"
    for bad in ("relative/ck", "/a\x00b", ""):
        with pytest.raises(ValidationError, match="checkpoint_root"):
            CheckpointSettings(checkpoint_root=bad)
