"""``tidelog`` command line: serve, migrate, status, events, verify.

Every subcommand reads the same config (``--config PATH``, else
``TIDELOG_CONFIG``, else the defaults). Secrets are never taken from the
command line: the control token comes from ``TIDELOG_CONTROL_TOKEN`` or the
config file. Exit codes: 0 ok, 1 a check found problems, 2 bad input or an
unusable configuration/journal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from datetime import datetime
from typing import Any

from alembic.util import CommandError
from sqlalchemy.exc import DBAPIError

from journal import JournalError, audit, lease, schema

from . import logs
from .config import ConfigError, Settings, load
from .leader import LEASE_NAME
from .service import open_journal

log = logging.getLogger("tidelog.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidelog", description="Durable workflow engine for RL fleets.")
    p.add_argument("--config", help="YAML config file (default: $TIDELOG_CONFIG, else built-in defaults)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="run the orchestrator (reconciler, dispatcher, HTTP API)")
    m = sub.add_parser("migrate", help="apply journal schema migrations")
    m.add_argument("--revision", default="head", help="target revision (default: head)")
    s = sub.add_parser("status", help="lease holder and entity counts")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e = sub.add_parser("events", help="read the audit log")
    e.add_argument("--kind", help="entity kind (participants, rpc_calls, leases, ...)")
    e.add_argument("--entity", help="entity id (use with --kind)")
    e.add_argument("--state", help="only events that move into this state")
    e.add_argument("--since", help="ISO-8601 time with timezone")
    e.add_argument("--until", help="ISO-8601 time with timezone")
    e.add_argument("--after", type=int, default=0, help="only events after this sequence number")
    e.add_argument("--limit", type=int, default=100, help=f"at most this many (1..{audit.MAX_PAGE})")
    e.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    sub.add_parser("verify", help="fold every entity's events and compare with its row")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load(args.config)
    except ConfigError as exc:
        print(f"tidelog: {exc}", file=sys.stderr)
        return 2
    logs.setup(settings.logging.level, settings.logging.format)
    handlers = {"serve": _serve, "migrate": _migrate, "status": _status, "events": _events, "verify": _verify}
    try:
        return handlers[args.command](settings, args)
    except (JournalError, ValueError, CommandError) as exc:
        print(f"tidelog {args.command}: {exc}", file=sys.stderr)
        return 2
    except (OSError, DBAPIError) as exc:
        # Connection refused, no such database, unwritable SQLite path, port in use, ...
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"tidelog {args.command}: {detail}", file=sys.stderr)
        return 2


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    url = settings.journal.url
    schema.upgrade(url, args.revision)
    journal = open_journal(settings)
    revision = asyncio.run(_current(journal))
    print(f"journal at {journal.url.redacted()} is at revision {revision}")
    return 0


async def _current(journal: Any) -> str | None:
    try:
        return await schema.current_revision(journal)
    finally:
        await journal.dispose()


def _serve(settings: Settings, _args: argparse.Namespace) -> int:
    return asyncio.run(serve(settings))


async def serve(settings: Settings) -> int:
    from aiohttp import web

    from .api import make_app
    from .service import Orchestrator

    orch = Orchestrator(settings)
    try:
        await orch.check_schema()
    except JournalError as exc:
        await orch.journal.dispose()
        print(f"tidelog serve: {exc}", file=sys.stderr)
        return 2
    if settings.token() is None:
        log.warning("no control token configured (TIDELOG_CONTROL_TOKEN or control.token): "
                    "mutating API routes answer 401 and participants will refuse control calls")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(make_app(orch), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.api.host, settings.api.port)
    await site.start()
    await orch.start()
    port = runner.addresses[0][1] if runner.addresses else settings.api.port
    log.info("serving", extra={"api": f"http://{settings.api.host}:{port}", "holder": orch.holder,
                               "journal": orch.journal.url.redacted()})
    await stop.wait()
    log.info("stopping on signal")
    await runner.cleanup()
    await orch.stop()
    log.info("stopped")
    return 0


def _status(settings: Settings, args: argparse.Namespace) -> int:
    from .api import entity_counts

    async def go() -> dict[str, Any]:
        journal = open_journal(settings)
        try:
            await schema.check_schema(journal)
            current = await lease.read_lease(journal, LEASE_NAME)
            return {"journal": journal.url.redacted(),
                    "lease": None if current is None else {
                        "holder": current.holder, "epoch": current.epoch,
                        "expires_at": current.expires_at.isoformat()},
                    "entities": await entity_counts(journal)}
        finally:
            await journal.dispose()

    snap = asyncio.run(go())
    if args.json:
        print(json.dumps(snap))
        return 0
    print(f"journal  {snap['journal']}")
    ls = snap["lease"]
    print("leader   " + ("none" if ls is None else f"{ls['holder']} epoch {ls['epoch']} until {ls['expires_at']}"))
    for kind, states in snap["entities"].items():
        shown = ", ".join(f"{s}={n}" for s, n in sorted(states.items())) or "none"
        print(f"{kind:<14} {shown}")
    return 0


def _events(settings: Settings, args: argparse.Namespace) -> int:
    from .api import QueryError, event_json, parse_event_filter

    query = {k: str(v) for k, v in {
        "kind": args.kind, "entity": args.entity, "state": args.state, "since": args.since,
        "until": args.until, "after": args.after, "limit": args.limit}.items() if v is not None}

    async def go() -> list[dict[str, Any]]:
        journal = open_journal(settings)
        try:
            await schema.check_schema(journal)
            flt = parse_event_filter(query, journal.kinds)
            async with journal.read() as conn:
                return await audit.query_events(conn, flt)
        finally:
            await journal.dispose()

    try:
        page = asyncio.run(go())
    except QueryError as exc:
        print(f"tidelog events: --{exc.param}: {str(exc).split(': ', 1)[1]}", file=sys.stderr)
        return 2
    if args.json:
        for ev in page:
            print(json.dumps(event_json(ev)))
        return 0
    print(f"{'seq':>6}  {'time (UTC)':<26}  {'entity':<40}  {'transition':<30}  reason")
    for ev in page:
        ts: datetime = ev["ts"]
        entity = f"{ev['entity_kind']}:{ev['entity_id']}"
        if len(entity) > 40:
            entity = entity[:37] + "..."
        edge = f"{ev['from_state'] or '*'} -> {ev['to_state']}"
        print(f"{ev['seq']:>6}  {ts.strftime('%Y-%m-%d %H:%M:%S.%f'):<26}  {entity:<40}  {edge:<30}  "
              f"{ev['reason']}")
    return 0


def _verify(settings: Settings, _args: argparse.Namespace) -> int:
    async def go() -> list[audit.Mismatch]:
        journal = open_journal(settings)
        try:
            await schema.check_schema(journal)
            return await audit.verify(journal)
        finally:
            await journal.dispose()

    mismatches = asyncio.run(go())
    for m in mismatches:
        print(f"MISMATCH {m}")
    if mismatches:
        print(f"tidelog verify: {len(mismatches)} mismatch(es)", file=sys.stderr)
        return 1
    print("tidelog verify: every row matches its events")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
