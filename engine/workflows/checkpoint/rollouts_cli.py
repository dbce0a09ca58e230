"""``tidelog rollouts submit|list|show``: rollouts through the running orchestrator's HTTP API
(:mod:`engine.workflows.checkpoint.rollouts_api`).

- ``tidelog rollouts submit FILE.jsonl [--batch N]``: a dataset file, one task a line (a JSON object
  ``{"rollout_id"?, "input", "labels"?}``; blank lines are skipped; ``-`` reads stdin). The file is
  read twice, streamed: first every line is checked (nothing is sent while any line is bad: the
  error names the file, the line and what is wrong; an explicit id ending in the reserved ``-a<N>``
  suffix is named with the attempt and rollout it would name; one id on two lines with different
  inputs is refused naming both lines), then the tasks go in batches of ``--batch`` (at most
  :data:`~engine.workflows.checkpoint.rollout_tasks.MAX_BATCH`) with a progress line on stderr. Submitting the
  same file again is a no-op (every task comes back ``existing``); a batch the orchestrator refuses
  (``rollout_conflict``) stops the command, the batches before it recorded.
- ``tidelog rollouts list [--state S] [--limit N]``, ``tidelog rollouts show ID``.

Every command takes ``--url`` and ``--json``. Exit codes: 0 done, 2 bad input or an API that is
unreachable or refuses (one line saying why).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO, Any

from engine.cli.client import api_arguments, client_for, printed, quote
from engine.config import Settings
from engine.runtime.workflow import Command
from engine.workflows.checkpoint.rollout_tasks import MAX_BATCH, InvalidTask, canonical, check_task

#: Bytes of tasks per request, below the API's 1 MiB body limit with room for the envelope.
BATCH_BYTES = 768 << 10


def add_commands(sub: Any) -> Mapping[str, Command]:
    """Add ``rollouts`` (``submit``, ``list``, ``show``) to ``tidelog``'s subcommands."""
    r = sub.add_parser("rollouts", help="submit a dataset of rollouts, list them, show one")
    act = r.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = api_arguments(act.add_parser("submit", help="submit a dataset file (JSON lines, one task a line)"))
    s.add_argument("file", help="the dataset (JSON lines; '-' reads stdin)")
    s.add_argument("--batch", type=int, default=1000, help=f"tasks per request (1..{MAX_BATCH}, default 1000)")
    ls = api_arguments(act.add_parser("list", help="the latest rollouts, newest first"))
    ls.add_argument("--state", help="only rollouts in this state (pending, dispatched, finished, failed, ...)")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    api_arguments(act.add_parser("show", help="one rollout: its attempts, where each ran, how it ended")
                  ).add_argument("id")
    return {"rollouts": rollouts}


class DatasetError(ValueError):
    """A dataset line the orchestrator would refuse: names the file and the line."""


def _lines(stream: IO[str], name: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed task)`` for every non-blank line of ``stream``."""
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{name}:{number}: not JSON ({exc})") from None


def check_dataset(stream: IO[str], name: str) -> int:
    """Check every line (see the module docstring); the number of tasks, or :class:`DatasetError`."""
    ids: dict[str, tuple[int, str]] = {}
    count = 0
    for number, raw in _lines(stream, name):
        try:
            task = check_task(raw)
        except InvalidTask as exc:
            raise DatasetError(f"{name}:{number}: {exc}") from None
        if isinstance(raw, Mapping) and raw.get("rollout_id") is not None:
            digest = hashlib.sha256(canonical(raw["input"])).hexdigest()
            seen = ids.setdefault(task.rollout_id, (number, digest))
            if seen[1] != digest:
                raise DatasetError(f"{name}:{number}: rollout_id {task.rollout_id!r} is also on line {seen[0]} "
                                   "with another input")
        count += 1
    return count


def _batches(stream: IO[str], name: str, size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    used = 0
    for _, raw in _lines(stream, name):
        cost = len(json.dumps(raw)) + 1
        if batch and (len(batch) >= size or used + cost > BATCH_BYTES):
            yield batch
            batch, used = [], 0
        batch.append(raw)
        used += cost
    if batch:
        yield batch


class Progress:
    """``submitted N/M (P%)`` on ``out``: rewritten in place on a terminal, a line per batch otherwise."""

    def __init__(self, out: IO[str], total: int) -> None:
        self.out, self.total, self.tty = out, total, out.isatty()

    def show(self, done: int) -> None:
        text = f"submitted {done:,}/{self.total:,} ({100 * done // max(self.total, 1)}%)"
        self.out.write(f"\r{text}" if self.tty else f"{text}\n")
        self.out.flush()

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _open(name: str) -> IO[str]:
    """The dataset to read twice: the file, or stdin spooled to a temporary file."""
    if name != "-":
        try:
            return open(name, encoding="utf-8")  # noqa: SIM115 - closed by the caller
        except OSError as exc:
            raise ValueError(f"cannot read the dataset {name}: {exc.strerror or exc}") from None
    spool = tempfile.TemporaryFile("w+", encoding="utf-8")
    for line in sys.stdin:
        spool.write(line)
    spool.seek(0)
    return spool


def submit(settings: Settings, args: argparse.Namespace) -> int:
    if not 1 <= args.batch <= MAX_BATCH:
        raise ValueError(f"--batch {args.batch}: must be 1..{MAX_BATCH}")
    name = "stdin" if args.file == "-" else args.file
    stream = _open(args.file)
    with stream:
        try:
            total = check_dataset(stream, name)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        client = client_for(settings, args)
        stream.seek(0)
        progress = Progress(sys.stderr, total)
        done = new = 0
        for batch in _batches(stream, name, args.batch):
            reply = client.post("/v1/rollouts", {"tasks": batch})
            done += reply["submitted"]
            new += reply["new"]
            progress.show(done)
        progress.end()
    summary = {"file": name, "submitted": done, "new": new, "existing": done - new}
    return printed(args, summary, f"{name}: {done} rollout(s) submitted ({new} new, {done - new} already recorded)")


def rollouts(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "submit":
        return submit(settings, args)
    client = client_for(settings, args)
    if args.action == "list":
        params: dict[str, Any] = {"limit": args.limit}
        if args.state:
            params["state"] = args.state
        rows = client.get("/v1/rollouts", params)["rollouts"]
        if args.json:
            print(json.dumps(rows))
            return 0
        out = io.StringIO()
        out.write(f"{'rollout':<40}  {'state':<10}  {'attempt':>7}  {'failures':>8}  environment\n")
        for r in rows:
            out.write(f"{r['id']:<40}  {r['state']:<10}  {r['attempt']:>7}  {r['failures']:>8}  "
                      f"{r['environment'] or ''}".rstrip() + "\n")
        sys.stdout.write(out.getvalue())
        return 0
    body = client.get(f"/v1/rollouts/{quote(args.id)}")
    if args.json:
        print(json.dumps(body))
        return 0
    lines = [f"rollout {body['id']}: {body['state']}, attempt {body['attempt']}, {body['failures']} failure(s)"]
    if body.get("environment"):
        lines.append(f"  environment {body['environment']}")
    if body.get("result") is not None:
        lines.append(f"  result      {json.dumps(body['result'])[:200]}")
    if body.get("detail"):
        lines.append(f"  detail      {body['detail']}")
    lines.append("  history")
    lines += [f"    {ev['at'][:23]}  {ev['from_state'] or '-':>10} -> {ev['to_state']:<10}  {ev['reason']}"
              for ev in body["history"]]
    print("\n".join(lines))
    return 0


__all__ = ["DatasetError", "add_commands", "check_dataset", "rollouts"]
