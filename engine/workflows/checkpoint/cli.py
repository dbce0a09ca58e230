"""``tidelog checkpoint|restore|retire|forget``: the checkpoint family's workflows through the running
orchestrator's HTTP API (:mod:`engine.workflows.checkpoint.api`), followed to their end unless
``--no-wait``.

- ``tidelog checkpoint [--id ID] [--directory DIR]``, ``--abort ID [--reason TEXT]``, ``--show ID``,
  ``--list``;
- ``tidelog restore [--checkpoint ID] [--directory DIR]``;
- ``tidelog retire ROLLOUT --attempt N`` and ``tidelog forget ROLLOUT``.

Exit codes: 0 done (for ``--abort``: aborted), 1 the workflow ended otherwise (its state and reason
on stderr), 2 bad input or an API that is unreachable or refuses.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from engine.cli.client import client_for, follow, printed, quote, summary, workflow_command
from engine.config import Settings
from engine.runtime.workflow import Command


def add_commands(sub: Any) -> Mapping[str, Command]:
    """Add ``checkpoint``, ``restore``, ``retire`` and ``forget`` to ``tidelog``'s subcommands."""
    c = workflow_command(sub, "checkpoint", "start a checkpoint and follow it (or --abort/--show/--list)")
    c.add_argument("--id", dest="checkpoint_id", help="checkpoint id (default ck-<UTC time>-<4 hex>)")
    c.add_argument("--directory", help="root checkpoint directory on the orchestrator (default checkpoint.directory)")
    act = c.add_mutually_exclusive_group()
    act.add_argument("--abort", metavar="ID", help="abort this open checkpoint (and follow it to aborted)")
    act.add_argument("--show", metavar="ID", help="show one checkpoint: state, members, blockers, timings")
    act.add_argument("--list", action="store_true", help="the latest checkpoints, newest first")
    c.add_argument("--reason", help="with --abort: why (kept in the checkpoint's detail)")
    rs = workflow_command(sub, "restore", "restore a published checkpoint into the participants and follow it")
    rs.add_argument("--checkpoint", dest="checkpoint_id", help="checkpoint id (default: the one LATEST names)")
    rs.add_argument("--directory", help="root checkpoint directory on the orchestrator (default checkpoint.directory)")
    rt = workflow_command(sub, "retire", "retire an attempt of a rollout (and every earlier one) everywhere")
    rt.add_argument("rollout", help="rollout id")
    rt.add_argument("--attempt", type=int, required=True, help="the attempt to retire (0 is the first)")
    fg = workflow_command(sub, "forget", "forget a finished or retired rollout everywhere")
    fg.add_argument("rollout", help="rollout id")
    return {"checkpoint": checkpoint, "restore": restore, "retire": retire, "forget": forget}


def checkpoint(settings: Settings, args: argparse.Namespace) -> int:
    client = client_for(settings, args)
    if (args.abort or args.show or args.list) and (args.checkpoint_id or args.directory):
        raise ValueError("--id and --directory start a checkpoint; they do not go with --abort, --show or --list")
    if args.reason and not args.abort:
        raise ValueError("--reason goes with --abort")
    if args.list:
        rows = client.get("/v1/checkpoints", {"limit": 20})["checkpoints"]
        if args.json:
            print(json.dumps(rows))
            return 0
        print(f"{'checkpoint':<32}  {'state':<10}  {'created (UTC)':<26}  {'seconds':>8}  detail")
        for r in rows:
            print(f"{r['id']:<32}  {r['state']:<10}  {r['created_at'][:26]:<26}  {r['timings']['total_s']:>8.1f}  "
                  f"{r['detail'] or ''}".rstrip())
        return 0
    if args.show:
        body = client.get(f"/v1/checkpoints/{quote(args.show)}")
        if args.json:
            print(json.dumps(body))
        else:
            summary("checkpoints", body)
        return 0
    if args.abort:
        reply = client.post(f"/v1/checkpoints/{quote(args.abort)}/abort", {"reason": args.reason} if args.reason else {})
        if not args.wait:
            return printed(args, reply, f"checkpoint {args.abort}: aborting (was {reply['was']})")
        return follow(client, args, "checkpoints", args.abort, success="aborted")
    body = {k: v for k, v in (("checkpoint_id", args.checkpoint_id), ("directory", args.directory)) if v}
    reply = client.post("/v1/checkpoints", body)
    cid = reply["checkpoint_id"]
    if not args.wait:
        return printed(args, reply, f"checkpoint {cid} started with {len(reply['participants'])} participant(s) "
                                    f"in {reply['directory']}")
    if not args.json:
        print(f"checkpoint {cid}: {', '.join(reply['participants'])} -> {reply['directory']}")
    return follow(client, args, "checkpoints", cid)


def restore(settings: Settings, args: argparse.Namespace) -> int:
    client = client_for(settings, args)
    body = {k: v for k, v in (("checkpoint_id", args.checkpoint_id), ("directory", args.directory)) if v}
    reply = client.post("/v1/restores", body)
    text = f"restore {reply['restore_id']} of checkpoint {reply['checkpoint_id']} ({reply['episodes']} episode(s))"
    if not args.wait:
        return printed(args, reply, text + " started")
    if not args.json:
        print(text)
    return follow(client, args, "restores", reply["restore_id"])


def _retirement(settings: Settings, args: argparse.Namespace, op: str, body: dict[str, Any]) -> int:
    client = client_for(settings, args)
    reply = client.post(f"/v1/rollouts/{quote(args.rollout)}/{op}", body)
    what = f"{op} {reply['retirement_id']} of rollout {reply['rollout_id']}" + (
        f" attempt {reply['attempt']}" if reply.get("attempt") is not None else "")
    if not args.wait:
        return printed(args, reply, what + " queued")
    if not args.json:
        print(what)
    return follow(client, args, "retirements", reply["retirement_id"])


def retire(settings: Settings, args: argparse.Namespace) -> int:
    return _retirement(settings, args, "retire", {"attempt": args.attempt})


def forget(settings: Settings, args: argparse.Namespace) -> int:
    return _retirement(settings, args, "forget", {})


__all__ = ["add_commands", "checkpoint", "forget", "restore", "retire"]
