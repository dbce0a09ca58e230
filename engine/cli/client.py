"""What every API-backed command shares: its ``--url``/``--wait``/``--json`` arguments, the client
built from the settings, following a workflow row to its end, and printing a reply.

Workflow families build their commands from these (``engine.workflows.<family>.cli``); the
blocking HTTP client and the progress display are in :mod:`engine.cli.progress`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from typing import Any

from engine.config import Settings
from engine.cli.progress import Client, Display, api_url, watch


def quote(entity_id: str) -> str:
    """``entity_id`` as one path segment of a route."""
    return urllib.parse.quote(entity_id, safe="")


def api_arguments(p: argparse.ArgumentParser, *, wait: bool = False) -> argparse.ArgumentParser:
    """Add ``--url`` and ``--json`` (and, for a workflow that runs on, ``--wait/--no-wait``) to ``p``."""
    p.add_argument("--url", help="the orchestrator's API (default http://<api.host>:<api.port>)")
    if wait:
        p.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                       help="follow it to the end, showing progress (default), or return once it is accepted")
    p.add_argument("--json", action="store_true", help="print JSON (progress goes to stderr)" if wait
                   else "print the API's JSON reply")
    return p


def workflow_command(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand that starts a workflow and follows it (``--url``, ``--wait``, ``--json``)."""
    return api_arguments(sub.add_parser(name, help=text), wait=True)


def client_for(settings: Settings, args: argparse.Namespace) -> Client:
    """The API client of this command: ``--url`` or ``api.host``/``api.port``, the control token."""
    return Client(args.url or api_url(settings.api.host, settings.api.port), settings.token())


def printed(args: argparse.Namespace, reply: Any, text: str) -> int:
    """Print ``reply`` as JSON with ``--json``, else ``text``; exit code 0."""
    print(json.dumps(reply) if args.json else text)
    return 0


def follow(client: Client, args: argparse.Namespace, kind: str, entity_id: str, success: str = "done") -> int:
    """Watch the row to its end (progress on stdout, or stderr with --json); 0 when it reached ``success``,
    else 1 with the row's state and reason on stderr."""
    body = watch(client, kind, entity_id, Display(sys.stderr if args.json else sys.stdout))
    if args.json:
        print(json.dumps(body))
    else:
        summary(kind, body)
    if body["state"] == success:
        return 0
    print(f"tidelog {args.command}: {kind[:-1]} {entity_id} {body['state']}: {body.get('detail') or 'no reason recorded'}",
          file=sys.stderr)
    return 1


def summary(kind: str, body: dict[str, Any]) -> None:
    """A workflow row's ``GET`` body as a few lines: state and time, then what it carries."""
    t = body.get("timings") or {}
    took = f" after {t['total_s']:.1f}s" if "total_s" in t else ""
    print(f"{kind[:-1]} {body['id']}: {body['state']}{took}" + (f" ({body['detail']})" if body.get("detail") else ""))
    if body.get("manifest_path"):
        print(f"  manifest  {body['manifest_path']}")
    for who, listed in sorted((body.get("blockers") or {}).items()):
        print(f"  blockers  {who}: {', '.join(str(b) for b in listed) or '(none listed)'}")
    for m in body.get("members", []):
        print(f"  {m['participant']:<20} {m['kind']:<12} {m['state']:<10} {m['detail'] or ''}".rstrip())
    phases = " ".join(f"{p['state']}{'/' + p['stage'] if p['stage'] else ''}={p['seconds']}s"
                      for p in t.get("phases", []) if p["seconds"] is not None)
    if phases:
        print(f"  timings   {phases}")


__all__ = ["api_arguments", "client_for", "follow", "printed", "quote", "summary", "workflow_command"]
