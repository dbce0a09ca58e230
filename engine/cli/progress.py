"""The client side of the workflow commands: the orchestrator's HTTP API, waiting for a workflow row
to end (its machine's terminal states), and a progress display while it runs (stage names as its
workflow declares them, :mod:`engine.runtime.workflow`).

:class:`Client` calls the API (bearer token on POSTs) and turns every failure into
:class:`ApiFailure` (the command exits 2): an unreachable API, or a typed refusal, quoted.
:func:`watch` follows one workflow row through ``GET /v1/events`` (every transition, so no
state is missed however short) until a terminal state, showing each change of state or stage
as it comes — one line per change with the time since the workflow was created, e.g.
``preparing stage 2/4 (model) 0.8s``; on a terminal the current line's time keeps ticking —
and returns the final ``GET /v1/<kind>/<id>``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import IO, Any

from engine.runtime import workflow


class ApiFailure(Exception):
    """The API could not be reached, or refused the request (the message says which and why)."""


def api_url(host: str, port: int) -> str:
    """The API's base URL from ``api.host``/``api.port`` (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Client:
    """Blocking JSON calls to one orchestrator's API."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float = 15.0) -> None:
        self.base = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return self._call(urllib.request.Request(self.base + path + query, method="GET"))

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        if not self.token:
            raise ApiFailure("no control token: set TIDELOG_CONTROL_TOKEN or control.token in the config")
        req = urllib.request.Request(self.base + path, method="POST", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.token}"})
        return self._call(req)

    def _call(self, req: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                err = json.loads(raw)["error"]
                said = f"{err['code']}: {err['detail']}"
            except (ValueError, KeyError, TypeError):
                said = raw.decode(errors="replace").strip()[:300] or exc.reason
            raise ApiFailure(f"{req.get_method()} {urllib.parse.urlsplit(req.full_url).path}: "
                             f"HTTP {exc.code} {said}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ApiFailure(f"cannot reach the orchestrator's API at {self.base}: {reason} "
                             f"(is `tidelog serve` running? --url sets the address)") from None


def label(kind: str, state: str, stage: int | None, scope: int | None = None) -> str:
    """``preparing stage 2/4 (model)``, ``running stage 1/3 (environment)``, ``committing (scope 3)``."""
    names = workflow.stage_names(kind)
    if names and stage is not None and state in ("preparing", "running") and 0 <= stage < len(names):
        return f"{state} stage {stage + 1}/{len(names)} ({names[stage]})"
    if kind == "checkpoints" and state == "committing" and scope is not None:
        return f"committing (scope {scope} episode{'s' if scope != 1 else ''})"
    return state


class Display:
    """Progress on ``stream``: a line per change. On a terminal the current line also ticks (its
    elapsed time is rewritten in place) until the next change starts a new line."""

    def __init__(self, stream: IO[str], tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self._open = False

    def change(self, text: str) -> None:
        if self.tty:
            self.stream.write(("\n" if self._open else "") + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def tick(self, text: str) -> None:
        """A live update of the current line (on a terminal only)."""
        if self.tty and self._open:
            self.stream.write(f"\r\x1b[2K{text}")
            self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def watch(client: Client, kind: str, entity_id: str, display: Display, *, poll_s: float = 0.1,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
          ) -> dict[str, Any]:
    """Follow ``kind``/``entity_id`` until it is terminal (as the kind's machine says); its final ``GET`` body."""
    terminal = workflow.terminal(kind)
    after, stage, scope = 0, None, None
    start: datetime | None = None
    shown = ""
    seen_at, seen_elapsed = clock(), 0.0
    try:
        while True:
            page = client.get("/v1/events", {"kind": kind, "entity": entity_id, "after": after, "limit": 1000})
            ended = False
            for ev in page["events"]:
                after = ev["seq"]
                ts = datetime.fromisoformat(ev["ts"])
                start = start or ts
                sets = (ev.get("payload") or {}).get("set", {})
                stage = sets.get("stage", stage)
                if isinstance(sets.get("scope"), list):
                    scope = len(sets["scope"])
                now_label = label(kind, ev["to_state"], stage, scope)
                seen_at, seen_elapsed = clock(), (ts - start).total_seconds()
                if now_label != shown:
                    shown = now_label
                    display.change(f"{shown} {seen_elapsed:.1f}s")
                ended = ev["to_state"] in terminal
            if ended:
                display.close()
                body: dict[str, Any] = client.get(f"/v1/{kind}/{urllib.parse.quote(entity_id, safe='')}")
                return body
            if page["next_after"] is None:
                if shown:
                    display.tick(f"{shown} {seen_elapsed + clock() - seen_at:.1f}s")
                sleep(poll_s)
    finally:
        display.close()


__all__ = ["ApiFailure", "Client", "Display", "api_url", "label", "watch"]
