"""Fuzzing every route of a real ``tidelog serve`` (issue 13), on both journal backends.

Hypothesis sends random methods, paths and ids (NULs, non-ASCII, bad percent escapes), query
strings, headers (with and without the token, bytes that are not UTF-8) and bodies (random JSON
with the routes' own field names, directories inside, outside and through symlinks out of the
roots, deep nesting, non-UTF-8 bytes). After each request:

- the status is never a 500 (a 503 only with its typed code), and every refusal has the JSON
  error shape ``{"error": {"code", "detail"}}``;
- a refused request (4xx/5xx) added no event to the journal;
- at the end, nothing was written anywhere under the test's directory outside the configured
  checkpoint roots, and the server's log holds no traceback.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.served import TOKEN, Served, journal_events, serve_process_sync

ROUTES: list[tuple[str, str]] = [
    ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/status"),
    ("GET", "/v1/participants"), ("GET", "/v1/events"), ("POST", "/v1/participants/probe"),
    ("POST", "/v1/checkpoints"), ("GET", "/v1/checkpoints"), ("GET", "/v1/checkpoints/{id}"),
    ("POST", "/v1/checkpoints/{id}/abort"), ("POST", "/v1/restores"), ("GET", "/v1/restores"),
    ("GET", "/v1/restores/{id}"), ("GET", "/v1/retirements"), ("GET", "/v1/retirements/{id}"),
    ("POST", "/v1/rollouts/{id}/retire"), ("POST", "/v1/rollouts/{id}/forget"), ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"), ("GET", "/v1/jobs/{id}"), ("POST", "/v1/jobs/{id}/resolve"),
    ("POST", "/v1/jobs/{id}/reject"), ("GET", "/v1/publications"), ("GET", "/v1/publications/{id}"),
    ("GET", "/v1/engines"),
]
FIELDS = ["checkpoint_id", "directory", "attempt", "reason", "payload", "decision", "checkpoint_path",
          "deployment", "state", "limit", "before", "after", "since", "until", "kind", "entity", "name"]
#: 503 codes that are a typed answer ("nothing here would advance it"), not a failure.
TYPED_503 = {"not_leader", "workflow_unavailable", "training_disabled", "trainer_unavailable"}

texts = st.text(st.characters(codec="utf-8"), max_size=40)
ids = st.one_of(st.sampled_from(["ck-1", "r1", "r1-a2", "..", "%00", "%ff", "a%2Fb", "x" * 300]), texts)


def directories(served: Served) -> st.SearchStrategy[str]:
    return st.sampled_from([str(served.root), str(served.extra_root), str(served.root / "sub"), "/", "..",
                            "../../", "relative", str(served.root / "escape"), str(served.root / "escape" / "x"),
                            str(served.root.parent / "outside"), str(served.root / ".." / "outside"),
                            "/etc", "a\x00b", ""])


def json_values(served: Served) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
                       st.floats(allow_nan=False, allow_infinity=False), texts, directories(served))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(FIELDS), texts), inner, max_size=4)),
        max_leaves=12)


def bodies(served: Served) -> st.SearchStrategy[bytes | None]:
    as_json = json_values(served).map(lambda v: json.dumps(v).encode())
    objects = st.dictionaries(st.sampled_from(FIELDS), json_values(served), max_size=4).map(
        lambda v: json.dumps(v).encode())
    return st.one_of(st.none(), objects, objects, as_json, st.binary(max_size=64),
                     st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),
                     st.sampled_from([b'{"attempt": NaN}', b'{"attempt": 1e999}', b'{"a": "\\u0000"}',
                                      b"\xff\xfe{}", b"{", b'{"directory": "/"}', b'{"attempt": 0}']))


def queries(served: Served) -> st.SearchStrategy[str]:
    pairs = st.lists(st.tuples(st.one_of(st.sampled_from(FIELDS), texts),
                               st.one_of(texts, st.sampled_from(["0001-01-01T00:00:00+14:00", "-1", "9" * 30,
                                                                 "1", "done", "leases"]))), max_size=3)
    encoded = pairs.map(lambda ps: urllib.parse.urlencode(ps))
    return st.one_of(st.just(""), encoded, st.sampled_from(["a=%00", "limit=%ff", "kind=%", "state&state", "=x"]))


def auth_headers() -> st.SearchStrategy[list[tuple[str, bytes]]]:
    auth = st.one_of(st.just(None), st.just(f"Bearer {TOKEN}".encode()), st.just(b"Bearer wrong"),
                     st.just(TOKEN.encode()), st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b)
                     .map(lambda b: b"Bearer " + b))
    extra = st.lists(st.tuples(st.sampled_from(["X-Fuzz", "Content-Type", "Accept", "If-None-Match"]),
                               st.binary(max_size=30).filter(lambda b: not set(b) & {0, 10, 13})), max_size=2)
    return st.tuples(auth, extra).map(lambda ae: ([("Authorization", ae[0])] if ae[0] is not None else []) + ae[1])


def tree(top: Path, skip: tuple[Path, ...]) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d not in skip]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p in skip:
                continue
            st_ = p.lstat()
            out[str(p)] = (st_.st_size, st_.st_mtime_ns)
    return out


def send(served: Served, method: str, path: str, query: str, headers: list[tuple[str, bytes]],
         body: bytes | None) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        target = path + (f"?{query}" if query else "")
        conn.putrequest(method, target, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("Content-Type") or ""
    finally:
        conn.close()


def quiet(url: str) -> int:
    """The journal's event count once it stops changing (an accepted request's workflow has settled)."""
    last, since = asyncio.run(journal_events(url)), time.monotonic()
    deadline = since + 20
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = asyncio.run(journal_events(url))
        if now == last and time.monotonic() - since >= 1.0:
            return now
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_no_request_to_the_orchestrator_answers_500_or_writes_when_refused(journal_url: str, tmp_path: Path) -> None:
    outside = tmp_path / "srv" / "outside"
    outside.mkdir(parents=True)
    (outside / "LATEST").write_text("keep\n")
    with serve_process_sync(journal_url, tmp_path / "srv") as served:
        (served.root / "escape").symlink_to(outside)
        skip = (served.root, served.extra_root, served.log, tmp_path / "srv" / "tidelog.yaml")
        journal_files = tuple(p for p in tmp_path.iterdir() if p.name.endswith((".db", "-wal", "-shm")))
        before = tree(tmp_path, skip + journal_files)
        state = {"events": quiet(journal_url)}

        @settings(max_examples=int(os.environ.get("TIDELOG_FUZZ_EXAMPLES", "400")), deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(route=st.sampled_from(ROUTES), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", None]),
               entity=ids, query=queries(served), headers=auth_headers(), body=bodies(served))
        def one(route: tuple[str, str], method: str | None, entity: str, query: str,
                headers: list[tuple[str, bytes]], body: bytes | None) -> None:
            verb, template = route
            path = template.replace("{id}", urllib.parse.quote(entity, safe="%"))
            status, raw, ctype = send(served, method or verb, path, query, headers, body)
            where = (method or verb, path, query, headers, (body or b"")[:60])
            assert status != 500 and status < 600, (where, status, raw[:300])
            if status == 400 and ctype.startswith("text/plain"):
                # Malformed HTTP (a header with control characters): aiohttp's parser refuses it
                # before any route runs (docs/security.md); nothing can have been written.
                assert asyncio.run(journal_events(journal_url)) == state["events"], where
                return
            if status >= 400:
                assert ctype.startswith("application/json"), (where, status, ctype, raw[:200])
                err = json.loads(raw)["error"]
                assert isinstance(err["code"], str) and isinstance(err["detail"], str), (where, err)
                if status >= 500:
                    assert err["code"] in TYPED_503 or path == "/readyz", (where, err)
                now = asyncio.run(journal_events(journal_url))
                assert now == state["events"], (where, status, err, "a refused request wrote to the journal")
            elif verb == "POST" and (method or verb) == "POST":
                state["events"] = quiet(journal_url)  # accepted: let its workflow settle

        one()
        assert tree(tmp_path, skip + journal_files) == before
        assert (outside / "LATEST").read_text() == "keep\n"
        text = served.log_text()
        assert "Traceback" not in text and TOKEN not in text, text[-4000:]
