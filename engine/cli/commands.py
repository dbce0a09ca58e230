"""``tidelog`` command line: serve, migrate, status, events, verify, replay, the demos, and every
registered workflow's commands (``Workflow.commands``): the checkpoint family's checkpoint, restore,
retire and forget (:mod:`engine.workflows.checkpoint.cli`), training's jobs, publications and
engines (:mod:`engine.workflows.training.cli`).

Every subcommand reads the same config (``--config PATH``, else
``TIDELOG_CONFIG``, else the defaults). Secrets are never taken from the
command line: the control token comes from ``TIDELOG_CONTROL_TOKEN`` or the
config file. ``status``, ``events``, ``verify`` and ``replay`` read the journal
directly; the workflow commands talk to the running orchestrator's HTTP API
(``--url``, default from ``api.host``/``api.port``) and, unless ``--no-wait``,
show its progress until it ends. Exit codes: 0 ok (a workflow done), 1 a check
found problems (a workflow aborted or failed, with the reason), 2 bad input, an
unusable configuration/journal, or an API that is unreachable or refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sqlite3
import sys
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.exc import ArgumentError, DBAPIError

from journal import Journal, JournalError, JournalURL, UnsupportedJournalURL, audit, lease, schema

import engine.workflows  # noqa: F401 - registers the built-in families (and their commands)
from engine.runtime import logs, workflow
from engine.runtime.workflow import Command
from engine.runtime.clock import SystemClock
from engine.config import ConfigError, Settings, load
from engine.demos.arguments import checkpoint_demo_arguments, training_demo_arguments
from engine.runtime.leader import LEASE_NAME
from engine.cli.progress import ApiFailure
from engine.runtime.service import open_journal

log = logging.getLogger("tidelog.cli")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    """The ``tidelog`` parser: the journal commands, every registered workflow's, the demos."""
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
    r = sub.add_parser("replay", help="what was in flight when the last leader died, and what the next one did")
    r.add_argument("--epoch", type=int, help="the take-over into this epoch (default: the last one)")
    r.add_argument("--kind", help="only entities of this kind (checkpoints, rpc_calls, ...)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    handlers: dict[str, Command] = {"serve": _serve, "migrate": _migrate, "status": _status, "events": _events,
                                    "verify": _verify, "replay": _replay, "demo": _demo, "demo-train": _demo_train}
    for wf in workflow.registered():
        if wf.commands is not None:
            for name, handler in wf.commands(sub).items():
                if name in handlers:
                    raise ValueError(f"workflow {wf.name!r}: command {name!r} is already taken")
                handlers[name] = handler
    d = sub.add_parser("demo", help="checkpoint reference participants mid-episode, SIGKILL them, restore, finish")
    checkpoint_demo_arguments(d)
    t = sub.add_parser("demo-train", help="an RL loop through crashes: rollouts score a batch, one training step, "
                                          "weights published behind the commit gate, the reward rising")
    training_demo_arguments(t)
    return p, handlers


def _demo_train(_settings: Settings, args: argparse.Namespace) -> int:
    from engine.demos import training as demo_training
    return demo_training.run_demo(args)


def _demo(settings: Settings, args: argparse.Namespace) -> int:
    from engine.demos import checkpoint as demo  # only this command needs it: keeps every other command's start-up short

    return demo.run_demo(args)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit code (0 ok, 1 a check found problems, 2 bad input).

    Bad input of every kind ends in one line on stderr, ``tidelog <command>: <what is wrong>``,
    and exit code 2, never a traceback: a refused configuration, an API that refuses or
    cannot be reached, and a journal that cannot be opened or reached (no such file or
    database, connection refused, authentication failed: :func:`_journal_failure`), with the
    journal URL shown only redacted and the password scrubbed from the driver's message. Any
    other exception is a bug and still ends in a traceback and exit code 1.
    """
    # The config first (``--config`` alone): its ``workflows:`` may register families whose
    # commands the full parser then offers.
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config")
    known, _ = early.parse_known_args(argv)
    try:
        settings = load(known.config)
    except ConfigError as exc:
        print(f"tidelog: {exc}", file=sys.stderr)
        return 2
    parser, handlers = _parser()
    args = parser.parse_args(argv)
    logs.setup(settings.logging.level, settings.logging.format)
    try:
        return handlers[args.command](settings, args)
    except ApiFailure as exc:
        print(f"tidelog {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tidelog {args.command}: interrupted; a workflow already started goes on", file=sys.stderr)
        return 130
    except (JournalError, ValueError) as exc:
        print(f"tidelog {args.command}: {_one_line(_scrub(settings, str(exc)))}", file=sys.stderr)
        return 2
    except Exception as exc:
        detail = _journal_failure(exc)
        if detail is None:
            raise
        where = f"{_journal_where(settings)}: " if args.command in _JOURNAL_COMMANDS else ""
        print(f"tidelog {args.command}: {where}{_one_line(_scrub(settings, detail))}", file=sys.stderr)
        return 2


#: The commands that open the journal themselves: a driver or OS error there is the journal's.
_JOURNAL_COMMANDS = {"serve", "migrate", "status", "events", "verify", "replay"}


def _journal_failure(exc: BaseException) -> str | None:
    """What went wrong, if ``exc`` is a failure to open or reach a journal (or bind a port); else ``None``.

    Those are: :class:`OSError` (connection refused, a host name that does not resolve, an
    unwritable path, a timeout, a port in use), SQLAlchemy's driver errors (``DBAPIError`` and
    its ``OperationalError``; ``ArgumentError`` for a URL the dialect refuses), :mod:`sqlite3`
    errors, and asyncpg's server and client errors raised while connecting (no such database:
    ``InvalidCatalogNameError``; a wrong password; a bad SSL set-up), which SQLAlchemy does not
    wrap when they happen at connect time.
    """
    if isinstance(exc, DBAPIError):
        return str(exc.orig if exc.orig is not None else exc)
    if isinstance(exc, (OSError, ArgumentError, sqlite3.Error)):
        return str(exc) or type(exc).__name__
    asyncpg = sys.modules.get("asyncpg")
    if asyncpg is not None and isinstance(exc, (asyncpg.PostgresError, asyncpg.InterfaceError)):
        return f"{exc} ({type(exc).__name__})"
    return None


def _journal_where(settings: Settings) -> str:
    try:
        return f"journal.url {JournalURL.parse(settings.journal.url).redacted()}"
    except UnsupportedJournalURL:  # cannot happen: the configuration was validated
        return "journal.url"


def _scrub(settings: Settings, text: str) -> str:
    """``text`` without the journal URL's password (a driver may echo what it was given)."""
    try:
        return JournalURL.parse(settings.journal.url).scrub(text)
    except UnsupportedJournalURL:
        return text


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines) if lines else "(no detail)"


def _open_for_reading(settings: Settings) -> Journal:
    """The journal for ``status``, ``events``, ``verify`` and ``replay``: read-only, never created.

    A SQLite path that does not exist is refused (``no journal at PATH``) instead of leaving an
    empty database there, and a journal on a read-only file or mount can still be read.
    """
    journal = Journal.open(settings.journal.url, read_only=True, clock=SystemClock().now,
                           busy_timeout_ms=settings.journal.busy_timeout_ms, pool_size=settings.journal.pool_size)
    workflow.register_kinds(journal.kinds)  # events, verify and replay know every registered kind
    return journal


#: The range of times the journal can hold, for the messages that refuse others.
_TIME_RANGE = "0001-01-01T00:00:00 to 9999-12-31T23:59:59.999999 UTC"


def _utc(flag: str, raw: str | None) -> str | None:
    """``--since``/``--until`` as the same instant in UTC; one the journal cannot hold is refused.

    ``0001-01-01T00:00:00+14:00`` is a valid ISO-8601 time, but in UTC it falls before year 1
    (``OverflowError`` when compared or stored), so it is refused here with a message naming
    the option, the value and the range. Text that is not a timestamp with a timezone is
    passed on unchanged for the event filter to refuse with its own message.
    """
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        return raw
    if value.tzinfo is None or value.utcoffset() is None:
        return raw
    try:
        return value.astimezone(timezone.utc).isoformat()
    except OverflowError:
        raise ValueError(f"--{flag} {raw!r}: outside the times the journal can hold ({_TIME_RANGE})") from None


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from alembic.util import CommandError  # imported here only: Alembic is slow to import

    url = settings.journal.url
    try:
        schema.upgrade(url, args.revision)  # the write path: creates a SQLite journal that is not there
    except CommandError as exc:
        print(f"tidelog migrate: {exc}", file=sys.stderr)
        return 2
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

    from workers.http_limits import runner_options

    from engine.http.app import make_app
    from engine.runtime.service import Orchestrator

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
    runner = web.AppRunner(make_app(orch), access_log=None, **runner_options(settings.api.header_timeout_s))
    await runner.setup()
    site = web.TCPSite(runner, settings.api.host, settings.api.port)
    try:
        await site.start()
    except OSError as exc:  # not the journal's: say which keys to change
        await runner.cleanup()
        await orch.journal.dispose()
        print(f"tidelog serve: api.host/api.port {settings.api.host}:{settings.api.port}: cannot listen there: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
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
    from engine.http.query import entity_counts

    async def go() -> dict[str, Any]:
        journal = _open_for_reading(settings)
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
    from engine.http.query import QueryError, event_json, parse_event_filter

    query = {k: str(v) for k, v in {
        "kind": args.kind, "entity": args.entity, "state": args.state, "since": _utc("since", args.since),
        "until": _utc("until", args.until), "after": args.after, "limit": args.limit}.items() if v is not None}

    async def go() -> list[dict[str, Any]]:
        journal = _open_for_reading(settings)
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
        journal = _open_for_reading(settings)
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


def _replay(settings: Settings, args: argparse.Namespace) -> int:
    from engine.cli.replay import render, replay

    async def go() -> Any:
        journal = _open_for_reading(settings)
        try:
            await schema.check_schema(journal)
            return await replay(journal, epoch=args.epoch, kind=args.kind)
        finally:
            await journal.dispose()

    report = asyncio.run(go())
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
