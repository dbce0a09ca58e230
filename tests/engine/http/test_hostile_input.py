"""Hostile and unlucky input against a real ``tidelog serve`` (issue 13), on both journal backends.

Each test is one defect the issue numbers: confinement of checkpoint directories (1), restores of
checkpoints the journal does not record as published (2), FIFOs and other unsafe files where a
checkpoint file should be (3), unauthenticated and authenticated input that used to answer 500
(6, 7), unbounded values (9), slow clients (10), and the 413 shape and restore wording (11). Every
refusal is a typed 4xx in the JSON error shape, writes nothing, and leaves no traceback in the log.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.config import ConfigError, Settings, load
from engine.workflows.checkpoint.checkpoint import member_id
from journal import Journal
from tests.support.served import AUTH, TOKEN, Served, journal_events, serve_process


async def call(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


async def raw(port: int, data: bytes, *, read_timeout: float = 20.0) -> bytes:
    """Send ``data`` as is on a fresh connection; the whole reply (the server closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


def status_and_json(reply: bytes) -> tuple[int, Any]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.strip() else None


def assert_no_traceback(served: Served) -> None:
    text = served.log_text()
    assert "Traceback" not in text and "Error handling request" not in text, text[-4000:]


async def checkpoint_rows(journal_url: str, cid: str, directory: Path, final: str,
                          members: dict[str, dict[str, Any]], scope: list[str]) -> None:
    """A checkpoint row that ended ``final`` (done: published; aborted: never), with its members,
    written through the journal's own create and transition primitives."""
    journal = Journal.open(journal_url)
    try:
        async with journal.write() as tx:
            await tx.create("checkpoints", cid, reason="test: checkpoint requested",
                            values={"checkpoint_dir": str(directory), "max_tries": 1, "try_number": 1})
            for name, m in members.items():
                await tx.create("checkpoint_members", member_id(cid, name), reason="test: member",
                                values={"checkpoint_id": cid, "participant": name, "kind": m["kind"],
                                        "url": "http://127.0.0.1:9", "stage": 0, "manifest": m["manifest"],
                                        "episode_ids": m["episode_ids"]})
            path = ["preparing", "prepared", "committing", "committed", "published", "resuming", "done"] \
                if final == "done" else ["preparing", "aborting", "aborted"]
            version = 1
            for a, b in zip(path, path[1:]):
                changes: dict[str, Any] = {}
                if b == "committing":
                    changes["scope"] = scope
                if b == "published":
                    changes["manifest_path"] = str(directory / cid / "checkpoint.json")
                await tx.transition("checkpoints", cid, from_state=a, version=version, to_state=b,
                                    reason=f"test: {b}", changes=changes)
                version += 1
    finally:
        await journal.dispose()


def publish_files(directory: Path, cid: str, members: dict[str, dict[str, Any]], scope: list[str]) -> None:
    """What the publisher writes: ``<dir>/<id>/checkpoint.json`` and ``<dir>/LATEST``."""
    (directory / cid).mkdir(parents=True, exist_ok=True)
    (directory / cid / "checkpoint.json").write_text(json.dumps(
        {"checkpoint_id": cid, "scope": scope, "restarts": [], "members": members}))
    (directory / "LATEST").write_text(cid + "\n")


MEMBERS = {"env-0": {"kind": "environment", "manifest": {"records": "records-ab.jsonl", "count": 1},
                     "episode_ids": [{"rollout_id": "r1", "attempt": 0}]}}


def tree(top: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``top`` with its size and mtime: a write anywhere shows."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


# -- 1: checkpoint directories are confined --------------------------------------------------------

async def test_checkpoint_directories_outside_the_roots_are_refused(journal_url: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "LATEST").write_text("unrelated\n")
    async with serve_process(journal_url, tmp_path / "srv") as served:
        (served.root / "escape").symlink_to(outside)
        before_tree, before_events = tree(tmp_path), await journal_events(journal_url)
        cases = [str(outside), "../../", "relative/dir", "/", str(served.root / "escape"),
                 str(served.root / ".." / "outside"), str(served.root / "escape" / "deeper")]
        for route in ("/v1/checkpoints", "/v1/restores"):
            for directory in cases:
                status, reply = await call("POST", f"{served.base}{route}", headers=AUTH, json={"directory": directory})
                assert status == 422, (route, directory, reply)
                err = reply["error"]
                assert (err["code"], err["field"]) == ("directory_refused", "directory"), err
                rule = "absolute" if not directory.startswith("/") else "not under a configured checkpoint root"
                assert rule in err["detail"], err
        assert tree(tmp_path) == before_tree
        assert await journal_events(journal_url) == before_events
        assert (outside / "LATEST").read_text() == "unrelated\n"
        # The roots themselves (and what lies below them) pass the rule; here nobody is configured.
        for directory in (served.root, served.extra_root, served.extra_root / "sub"):
            status, reply = await call("POST", f"{served.base}/v1/checkpoints", headers=AUTH,
                                       json={"directory": str(directory)})
            assert (status, reply["error"]["code"]) == (409, "no_participants"), (directory, reply)
        assert_no_traceback(served)


# -- 2: only a checkpoint the journal says was published is restored -------------------------------

async def test_a_restore_needs_a_checkpoint_the_journal_records_as_published(journal_url: str, tmp_path: Path) -> None:
    root = tmp_path / "srv" / "ckpts"
    root.mkdir(parents=True)
    scope = ["r1"]
    # An aborted checkpoint whose files are there (its publication failed, an operator aborted it).
    await checkpoint_rows(journal_url, "ck-aborted", root, "aborted", MEMBERS, scope)
    publish_files(root, "ck-aborted", MEMBERS, scope)
    # A published one whose checkpoint.json was changed afterwards.
    await checkpoint_rows(journal_url, "ck-done", root, "done", MEMBERS, scope)
    tampered = {"env-0": {**MEMBERS["env-0"], "manifest": {"records": "records-ff.jsonl", "count": 1}}}
    publish_files(root, "ck-done", tampered, scope)
    async with serve_process(journal_url, tmp_path / "srv") as served:
        before = await journal_events(journal_url)
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH, json={})
        assert (status, reply["error"]["code"]) == (409, "checkpoint_mismatch"), reply  # LATEST names ck-done
        assert "members" in reply["error"]["detail"], reply
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH,
                                   json={"checkpoint_id": "ck-aborted"})
        assert (status, reply["error"]["code"]) == (409, "checkpoint_not_published"), reply
        assert "aborted" in reply["error"]["detail"], reply
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH,
                                   json={"checkpoint_id": "ck-nowhere"})
        assert (status, reply["error"]["code"]) == (404, "not_found"), reply
        # The journal's record names the directory: another allowed root is not where it was published.
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH,
                                   json={"checkpoint_id": "ck-done", "directory": str(served.extra_root)})
        assert (status, reply["error"]["code"]) == (409, "checkpoint_mismatch"), reply
        assert await journal_events(journal_url) == before
        # Put back as published: it passes every check of the files and the journal, and is refused
        # only because its member env-0 is not among this orchestrator's participants (membership
        # fails closed); test_api_checkpoints restores into the real members.
        publish_files(root, "ck-done", MEMBERS, scope)
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH, json={})
        assert (status, reply["error"]["code"]) == (409, "membership_mismatch"), reply
        assert reply["error"]["missing"] == {"env-0": "not configured"}, reply
        assert await journal_events(journal_url) == before
        assert_no_traceback(served)


# -- 3: a FIFO (or anything but a regular file) never blocks a thread ------------------------------

async def test_fifos_and_links_where_checkpoint_files_belong_are_refused_at_once(
        journal_url: str, tmp_path: Path) -> None:
    root = tmp_path / "srv" / "ckpts"
    root.mkdir(parents=True)
    await checkpoint_rows(journal_url, "ck-fifo", root, "done", MEMBERS, ["r1"])
    (root / "ck-fifo").mkdir()
    os.mkfifo(root / "ck-fifo" / "checkpoint.json")
    os.mkfifo(root / "LATEST")
    # The served config's 1 s header and body deadlines are for the trickling tests: forty clients
    # connecting at once on a loaded machine may take longer than that to send a request, and be cut
    # off ("Can not write request body", seen once in the full suite) before the refusal under test.
    roomy = {"header_timeout_s": 30, "body_timeout_s": 30}
    async with serve_process(journal_url, tmp_path / "srv", api=roomy) as served:
        # More requests than the file pool and the default executor have threads.
        replies = await asyncio.gather(*(call("POST", f"{served.base}/v1/restores", headers=AUTH, json={})
                                         for _ in range(40)))
        assert {(s, r["error"]["code"]) for s, r in replies} == {(404, "not_found")}, replies[:3]
        replies = await asyncio.gather(*(call("POST", f"{served.base}/v1/restores", headers=AUTH,
                                              json={"checkpoint_id": "ck-fifo"}) for _ in range(40)))
        assert {(s, r["error"]["code"]) for s, r in replies} == {(409, "checkpoint_mismatch")}, replies[:3]
        assert "not a regular file" in replies[0][1]["error"]["detail"], replies[0]
        # A symlinked manifest (even to a real manifest) is refused, not followed.
        os.unlink(root / "ck-fifo" / "checkpoint.json")
        real = tmp_path / "elsewhere.json"
        real.write_text(json.dumps({"checkpoint_id": "ck-fifo", "scope": ["r1"], "members": MEMBERS}))
        (root / "ck-fifo" / "checkpoint.json").symlink_to(real)
        status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH,
                                   json={"checkpoint_id": "ck-fifo"})
        assert (status, reply["error"]["code"]) == (409, "checkpoint_mismatch") and "symlink" in reply["error"]["detail"]
        # The server still answers everything else.
        assert (await call("GET", f"{served.base}/v1/checkpoints"))[0] == 200
        assert_no_traceback(served)


async def test_the_restore_404_says_the_same_whatever_is_or_is_not_there(journal_url: str, tmp_path: Path) -> None:
    async with serve_process(journal_url, tmp_path / "srv") as served:
        details = set()
        for setup in ("missing", "fifo", "garbage", "directory"):
            latest = served.root / "LATEST"
            if latest.is_dir():
                latest.rmdir()
            elif latest.exists() or latest.is_fifo():
                latest.unlink()
            if setup == "fifo":
                os.mkfifo(latest)
            elif setup == "garbage":
                latest.write_bytes(b"\xff\xfe not an id")
            elif setup == "directory":
                latest.mkdir()
            status, reply = await call("POST", f"{served.base}/v1/restores", headers=AUTH, json={})
            assert (status, reply["error"]["code"]) == (404, "not_found"), (setup, reply)
            details.add(reply["error"]["detail"])
        assert len(details) == 1, details
        assert str(served.root) not in details.pop()


# -- 6, 7: no 500s, authenticated or not -----------------------------------------------------------

async def test_input_that_used_to_answer_500_is_a_typed_4xx(journal_url: str, tmp_path: Path) -> None:
    async with serve_process(journal_url, tmp_path / "srv") as served:
        before = await journal_events(journal_url)
        # A bearer header with bytes that are not UTF-8.
        for route in (b"POST /v1/checkpoints", b"POST /v1/participants/probe"):
            reply = await raw(served.port, route + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80"
                                                   b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            status, body = status_and_json(reply)
            assert (status, body["error"]["code"]) == (401, "unauthorized"), reply
        # Times that overflow once converted to UTC.
        for param in ("since", "until"):
            for value in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
                status, reply = await call("GET", f"{served.base}/v1/events", params={param: value})
                assert (status, reply["error"]["code"]) == (400, "invalid_query"), (param, value, reply)
                assert "out of range" in reply["error"]["detail"]
        # NUL bytes in an id and in a query value (PostgreSQL text cannot hold them).
        for path in ("/v1/checkpoints/ck%00x", "/v1/restores/a%00", "/v1/jobs/j%00", "/v1/retirements/%00"):
            status, reply = await call("GET", f"{served.base}{path}")
            assert (status, reply["error"]["code"]) == (404, "not_found"), (path, reply)
        for query in ("entity=a%00b", "kind=%00", "state=x%00"):
            status, reply = await call("GET", f"{served.base}/v1/events?{query}")
            assert (status, reply["error"]["code"]) == (400, "invalid_query"), (query, reply)
        status, reply = await call("GET", f"{served.base}/v1/checkpoints?before=a%00")
        assert (status, reply["error"]["code"]) == (400, "invalid_query"), reply
        # Deeply nested bodies, NaN, infinities and NULs in bodies (with the token).
        deep = "[" * 100_000 + "]" * 100_000
        for route in ("/v1/checkpoints", "/v1/rollouts/r1/forget", "/v1/jobs", "/v1/rollouts/r1/retire",
                      "/v1/checkpoints/ck-1/abort", "/v1/restores"):
            for body in (deep, '{"a":' * 5000 + "1" + "}" * 5000, '{"attempt": NaN}', '{"attempt": 1e999}',
                         '{"reason": "a\\u0000b"}', '{"payload": {"x\\u0000": 1}}', "\xff\xfe"):
                status, reply = await call("POST", f"{served.base}{route}", headers={**AUTH, "Content-Type":
                                                                                     "application/json"},
                                           data=body.encode("utf-8", "surrogateescape"))
                assert status == 422 and reply["error"]["code"] == "invalid_body", (route, body[:20], reply)
        assert await journal_events(journal_url) == before
        assert_no_traceback(served)


# -- 9: bounded values -------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "values", "where"), [
    ("orchestrator", {"lease_ttl_s": float("inf")}, "orchestrator.lease_ttl_s"),
    ("orchestrator", {"lease_ttl_s": 3e11, "lease_renew_s": 1}, "orchestrator.lease_ttl_s"),
    ("orchestrator", {"id": "x" * 1_000_000}, "orchestrator.id"),
    ("orchestrator", {"id": "two words"}, "orchestrator.id"),
    ("reconciler", {"resync_interval_s": float("nan")}, "reconciler.resync_interval_s"),
    ("checkpoint", {"commit_timeout_s": float("inf")}, "checkpoint.commit_timeout_s"),
    ("api", {"header_timeout_s": 0}, "api.header_timeout_s"),
    ("api", {"body_timeout_s": 1e9}, "api.body_timeout_s"),
])
def test_configuration_values_have_bounds(tmp_path: Path, section: str, values: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(json.dumps({section: values}))  # JSON is YAML; .inf/.nan below
        cfg.write_text(cfg.read_text().replace("Infinity", ".inf").replace("NaN", ".nan"))
        load(cfg)
    assert Settings().orchestrator.lease_ttl_s == 10.0


async def test_a_retire_attempt_past_the_bound_is_refused(journal_url: str, tmp_path: Path) -> None:
    async with serve_process(journal_url, tmp_path / "srv") as served:
        before = await journal_events(journal_url)
        status, reply = await call("POST", f"{served.base}/v1/rollouts/r1/retire", headers=AUTH,
                                   json={"attempt": 10**26})
        assert (status, reply["error"]["code"], reply["error"]["field"]) == (422, "invalid_body", "attempt"), reply
        assert "less than or equal to 2147483647" in reply["error"]["detail"]
        assert await journal_events(journal_url) == before


# -- 10: slow clients --------------------------------------------------------------------------------

async def test_clients_trickling_headers_or_bodies_are_cut_off(journal_url: str, tmp_path: Path) -> None:
    async with serve_process(journal_url, tmp_path / "srv") as served:
        async def trickle_headers() -> float:
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            start = time.monotonic()
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            try:
                # One header byte every 0.2 s, for at most 60 s: the server must hang up long before.
                for _ in range(300):
                    writer.write(b"X")
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                            return time.monotonic() - start
                    except TimeoutError:
                        continue
                return float("inf")
            except ConnectionError:
                return time.monotonic() - start
            finally:
                writer.close()

        cut = await asyncio.gather(*(trickle_headers() for _ in range(50)))
        assert all(t != float("inf") for t in cut), cut
        # A body that never finishes arriving: 408 in the JSON shape, then the connection closes.
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        status, body = status_and_json(reply)
        assert (status, body["error"]["code"]) == (408, "body_timeout"), reply
        # The server still answers.
        assert (await call("GET", f"{served.base}/healthz"))[0] == 200


# -- 11: the 413 and aiohttp's own refusals are JSON -------------------------------------------------

async def test_oversize_bodies_and_unknown_routes_answer_in_the_json_error_shape(
        journal_url: str, tmp_path: Path) -> None:
    async with serve_process(journal_url, tmp_path / "srv") as served:
        status, reply = await call("POST", f"{served.base}/v1/checkpoints", headers=AUTH, data=b"x" * (3 << 20))
        assert (status, reply["error"]["code"]) == (413, "request_too_large"), reply
        status, reply = await call("GET", f"{served.base}/nowhere")
        assert (status, reply["error"]["code"]) == (404, "not_found"), reply
        status, reply = await call("DELETE", f"{served.base}/v1/checkpoints")
        assert (status, reply["error"]["code"]) == (405, "method_not_allowed"), reply
        assert_no_traceback(served)


@pytest.mark.parametrize("url", ["http://user:p/a@ss@x:1", "ftp://user:hunter2/x@x", "http://u:hunter2@h:1"])
def test_a_participant_url_with_a_password_is_refused_without_showing_it(tmp_path: Path, url: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"participants": [{"name": "p", "url": url}]}))
    with pytest.raises(ConfigError, match=r"participants\.0\.url") as refused:
        load(cfg)
    assert "hunter2" not in str(refused.value) and "p/a" not in str(refused.value), refused.value
