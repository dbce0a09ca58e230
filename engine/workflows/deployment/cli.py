"""``tidelog up``, ``tidelog down`` and ``tidelog services``: the stack of the running orchestrator,
through its HTTP API (``tidelog serve`` owns the stack; these ask it and follow its rows).

``up``/``down`` follow every declared service to ``ready``/``stopped``, printing each change, unless
``--no-wait``; they exit 1 when the stack failed (the failed service and why on stderr), 2 when the
API is unreachable or refuses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from engine.cli.client import api_arguments as _api
from engine.cli.client import client_for as _client
from engine.config import Settings
from engine.runtime.workflow import Command


def add_commands(sub: Any) -> Mapping[str, Command]:
    for name, text in (("up", "bring the stack up (deployment.services), dependencies first, and follow it"),
                       ("down", "bring the stack down, dependents first, and follow it")):
        p = _api(sub.add_parser(name, help=text), wait=True)
        p.add_argument("--timeout", type=float, default=600.0, help="stop following after this many seconds")
    _api(sub.add_parser("services", help="the stack's services as the journal records them"))
    return {"up": updown, "down": updown, "services": services}


def services(settings: Settings, args: argparse.Namespace) -> int:
    body = _client(settings, args).get("/v1/services")
    if args.json:
        print(json.dumps(body))
        return 0
    stack = body.get("stack")
    if stack is not None:
        print(f"stack: {stack['state']}" + (f" ({stack['reason']})" if stack["reason"] else ""))
    print(f"{'service':<20}  {'state':<10}  {'pid':>7}  {'exit':>4}  {'endpoint':<28}  detail")
    for s in body["services"]:
        pid = (s["pids"] or {}).get("service") or ""
        exit_code = "" if s["exit_code"] is None else s["exit_code"]
        print(f"{s['name']:<20}  {s['state']:<10}  {pid:>7}  {exit_code:>4}  {s['endpoint'] or '':<28}  "
              f"{s['detail'] or ''}".rstrip())
    return 0


def updown(settings: Settings, args: argparse.Namespace) -> int:
    client = _client(settings, args)
    want = args.command
    reply = client.post(f"/v1/services/{want}")
    declared = set(reply["services"])
    if not args.wait:
        print(json.dumps(reply) if args.json else f"stack: {want} requested ({len(declared)} services)")
        return 0
    out = sys.stderr if args.json else sys.stdout
    goal = "ready" if want == "up" else "stopped"
    seen: dict[str, str] = {}
    end = time.monotonic() + args.timeout
    time.sleep(0.1)  # let the stack take the request before its rows are read
    while True:
        body = client.get("/v1/services")
        rows = {s["name"]: s for s in body["services"] if s["name"] in declared}
        for name, s in rows.items():
            if seen.get(name) != s["state"]:
                seen[name] = s["state"]
                print(f"  {name}: {s['state']}" + (f" ({s['detail']})" if s["detail"] else ""), file=out, flush=True)
        stack = body.get("stack") or {}
        if want == "up" and stack.get("state") == "failed":
            print(f"stack failed: {stack.get('reason')}", file=sys.stderr)
            return 1
        if rows and all(s["state"] == goal for s in rows.values()) and (
                want == "down" or stack.get("state") == "ready"):
            if args.json:
                print(json.dumps(body))
            else:
                print(f"stack {'ready' if want == 'up' else 'down'}: {len(rows)} services")
            return 0
        if time.monotonic() > end:
            print(f"stack not {goal} within {args.timeout:g} s: "
                  + ", ".join(f"{n} {s['state']}" for n, s in sorted(rows.items())), file=sys.stderr)
            return 1
        time.sleep(0.2)
