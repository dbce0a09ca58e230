"""``tidelog jobs|publications|engines``: training jobs, their publications and the engines, through the
running orchestrator's HTTP API (engine/workflows/training/api.py), with the same client and token as the
workflow commands (split from :mod:`engine.cli`).

- ``tidelog jobs submit FILE`` (a JSON payload; ``-`` reads stdin): the job's id and what the
  orchestrator made of it (``new``, ``replay``, ``resume``, ``in_progress``);
- ``tidelog jobs list [--state S]``, ``tidelog jobs show ID``: the jobs newest first; one job with its
  ambiguity, phases and publication;
- ``tidelog jobs resolve ID --decision {ran,not_run,abandon} --reason TEXT [--checkpoint PATH]``
  ``tidelog jobs acknowledge ID --reason TEXT`` (a READY_TO_COMMIT candidate becomes the head) and
  ``tidelog jobs reject ID --reason TEXT``: the operator's decisions (docs/training.md);
- ``tidelog publications [ID]``, ``tidelog engines``, ``tidelog batches [ID]``.

Every command takes ``--url`` and ``--json``. Exit codes as the other commands: 0 done, 2 bad input or
an API that is unreachable or refuses (the refusal quoted on one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.cli.client import api_arguments as _api
from engine.cli.client import client_for as _client
from engine.cli.client import printed as _print
from engine.cli.client import quote as _q
from engine.config import Settings
from engine.runtime.workflow import Command

DECISIONS = ("ran", "not_run", "abandon")


def add_commands(sub: Any) -> Mapping[str, Command]:
    """Add ``jobs``, ``publications`` and ``engines`` to the ``tidelog`` parser's subcommands."""
    jobs = sub.add_parser("jobs", help="submit, list, show, resolve, acknowledge or reject training jobs")
    act = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = _api(act.add_parser("submit", help="submit a training job (its batch) from a JSON payload file"))
    s.add_argument("file", help="JSON payload file ('-' reads stdin)")
    s.add_argument("--deployment", help="refuse unless the orchestrator trains this deployment")
    ls = _api(act.add_parser("list", help="the latest jobs, newest first"))
    ls.add_argument("--state", help="only jobs in this state (RUNNING, AMBIGUOUS, COMPLETE, ...)")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    _api(act.add_parser("show", help="one job: state, ambiguity, phases, publication")).add_argument("id")
    r = _api(act.add_parser("resolve", help="settle an AMBIGUOUS job as an operator decided"))
    r.add_argument("id")
    r.add_argument("--decision", required=True, choices=DECISIONS,
                   help="ran (with --checkpoint: its step ran and that checkpoint holds it), not_run (train it "
                        "once), abandon (FAILED)")
    r.add_argument("--reason", required=True, help="why (kept in the job's history)")
    r.add_argument("--checkpoint", help="with --decision ran: the checkpoint that holds the job's step")
    ak = _api(act.add_parser("acknowledge", help="commit a READY_TO_COMMIT candidate as the head (training.commit: "
                                                 "acknowledge)"))
    ak.add_argument("id")
    ak.add_argument("--reason", required=True, help="why (kept in the job's verdict)")
    rj = _api(act.add_parser("reject", help="reject a job's candidate weights (the committed head is put back)"))
    rj.add_argument("id")
    rj.add_argument("--reason", required=True, help="why (kept in the job's detail)")
    p = _api(sub.add_parser("publications", help="published weight versions, newest first (or one of them)"))
    p.add_argument("id", nargs="?", help="a runtime load id <incarnation>:<sequence>")
    p.add_argument("--state", help="only versions in this state (target, loaded, committed, rejected)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    _api(sub.add_parser("engines", help="the deployment's inference engines as the journal records them"))
    b = _api(sub.add_parser("batches", help="training batches of finished rollouts, newest first (or one of them)"))
    b.add_argument("id", nargs="?", help="a batch id <deployment>.b<number>")
    b.add_argument("--state", help="only batches in this state (open, submitted, trained, rejected, failed)")
    b.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    return HANDLERS


def read_payload(name: str) -> dict[str, Any]:
    """The JSON object in file ``name`` (``-``: stdin); :class:`ValueError` says what is wrong with it."""
    try:
        raw = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the payload file {name}: {getattr(exc, 'strerror', None) or exc}") from None
    where = "stdin" if name == "-" else name
    try:
        payload = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"the payload in {where} is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"the payload in {where} must be a JSON object, not {type(payload).__name__}")
    return payload


def jobs(settings: Settings, args: argparse.Namespace) -> int:
    action = args.action
    if action == "resolve" and args.checkpoint and args.decision != "ran":
        raise ValueError("--checkpoint goes with --decision ran")
    client = _client(settings, args)
    if action == "submit":
        body: dict[str, Any] = {"payload": read_payload(args.file)}
        if args.deployment:
            body["deployment"] = args.deployment
        reply = client.post("/v1/jobs", body)
        job = reply["job"]
        return _print(args, reply, f"job {job['id']}: {reply['disposition']} ({_state(job)})")
    if action == "list":
        params: dict[str, Any] = {"limit": args.limit}
        if args.state:
            params["state"] = args.state
        rows = client.get("/v1/jobs", params)["jobs"]
        if args.json:
            print(json.dumps(rows))
            return 0
        print(f"{'job':<64}  {'state':<16}  {'step':>5}  {'created (UTC)':<26}  version / why")
        for j in rows:
            print(f"{j['id']:<64}  {j['state']:<16}  {j['scenario_step']:>5}  {j['created_at'][:26]:<26}  "
                  f"{j['runtime_load_id'] or j['ambiguity'] or j['detail'] or ''}".rstrip())
        return 0
    if action == "show":
        body = client.get(f"/v1/jobs/{_q(args.id)}")
        if args.json:
            print(json.dumps(body))
        else:
            show_job(body)
        return 0
    if action == "resolve":
        req: dict[str, Any] = {"decision": args.decision, "reason": args.reason}
        if args.checkpoint:
            req["checkpoint_path"] = args.checkpoint
        reply = client.post(f"/v1/jobs/{_q(args.id)}/resolve", req)
        return _print(args, reply, f"job {args.id}: resolved {reply['decision']}: {reply['was']} -> {reply['state']}")
    if action == "acknowledge":
        reply = client.post(f"/v1/jobs/{_q(args.id)}/acknowledge", {"reason": args.reason})
        return _print(args, reply, f"job {args.id}: acknowledged; its head commit follows")
    reply = client.post(f"/v1/jobs/{_q(args.id)}/reject", {"reason": args.reason})
    return _print(args, reply, f"job {args.id}: {reply['was']} -> REJECTING; the committed head is put back")


def _state(job: dict[str, Any]) -> str:
    version = job.get("runtime_load_id") or job.get("target_load_id")
    return str(job["state"]) + (f", version {version}" if version else "")


def show_job(body: dict[str, Any]) -> None:
    print(f"job {body['id']}: {_state(body)}")
    print(f"  deployment  {body['deployment']}  scenario step {body['scenario_step']}"
          + (f"  batch {body['batch_number']}" if body.get("batch_number") is not None else "")
          + (f"  base {body['base_version']}" if body.get("base_version") else ""))
    for label, key in (("ambiguity", "ambiguity"), ("detail", "detail"), ("checkpoint", "checkpoint_path")):
        if body.get(key):
            print(f"  {label:<10}  {body[key]}")
    verdict = body.get("verdict")
    if verdict:
        metrics = f" {json.dumps(verdict['metrics'])}" if verdict.get("metrics") else ""
        print(f"  verdict     {verdict['decision']} by {verdict['by']}: {verdict['reason']}{metrics}")
    if body.get("publish_attempts"):
        print(f"  attempts    {body['publish_attempts']} failed publication attempt(s)")
    phases = " ".join(f"{p['state']}={p['seconds']}s" if p["seconds"] is not None else p["state"]
                      for p in body.get("phases", []))
    if phases:
        print(f"  phases      {phases}")
    pub = body.get("publication")
    if pub:
        print(f"  published   {pub['id']} {pub['state']}" + (f" ({pub['detail']})" if pub.get("detail") else ""))


def publications(settings: Settings, args: argparse.Namespace) -> int:
    client = _client(settings, args)
    if args.id:
        if args.state:
            raise ValueError("--state lists versions; it does not go with an ID")
        v = client.get(f"/v1/publications/{_q(args.id)}")
        job = v.get("job")
        return _print(args, v, f"version {v['id']}: {v['state']}\n"
                               f"  job         {job['id'] + ' ' + job['state'] if job else '(initial weights)'}\n"
                               f"  weights     {v['weights_path'] or '(not on disk)'}\n"
                               f"  served by   {', '.join(v['served_by']) or 'no engine'}")
    params: dict[str, Any] = {"limit": args.limit}
    if args.state:
        params["state"] = args.state
    rows = client.get("/v1/publications", params)["publications"]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'version':<40}  {'state':<10}  {'created (UTC)':<26}  job")
    for v in rows:
        print(f"{v['id']:<40}  {v['state']:<10}  {v['created_at'][:26]:<26}  {v['job_id'] or '(initial weights)'}")
    return 0


def engines(settings: Settings, args: argparse.Namespace) -> int:
    rows = _client(settings, args).get("/v1/engines")["engines"]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'engine':<20}  {'state':<12}  {'serving':<40}  {'paused':<6}  {'health':<12}  detail")
    for e in rows:
        paused = "yes" if e["paused"] else "no"
        print(f"{e['id']:<20}  {e['state']:<12}  {e['serving_version'] or '-':<40}  {paused:<6}  "
              f"{e['health'] or '-':<12}  {e['detail'] or ''}".rstrip())
    return 0


def batches(settings: Settings, args: argparse.Namespace) -> int:
    client = _client(settings, args)
    if args.id:
        if args.state:
            raise ValueError("--state lists batches; it does not go with an ID")
        b = client.get(f"/v1/batches/{_q(args.id)}")
        job = b.get("job")
        excluded = b.get("excluded") or {}
        lines = [f"batch {b['id']}: {b['state']}",
                 f"  job         {job['id'] + ' ' + job['state'] if job else '(none yet)'}",
                 f"  base        {b['base_version'] or '-'}",
                 f"  members     {', '.join(b['rollout_ids'] or []) or '-'}",
                 f"  excluded    {len(excluded)}"] + [f"    {rid}: {why}" for rid, why in excluded.items()]
        return _print(args, b, "\n".join(lines))
    params: dict[str, Any] = {"limit": args.limit}
    if args.state:
        params["state"] = args.state
    rows = client.get("/v1/batches", params)["batches"]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'batch':<24}  {'state':<10}  {'members':>7}  {'excluded':>8}  job")
    for b in rows:
        print(f"{b['id']:<24}  {b['state']:<10}  {len(b['rollout_ids'] or []):>7}  {len(b['excluded'] or {}):>8}  "
              f"{b['job_id'] or '-'}")
    return 0


HANDLERS: dict[str, Command] = {"jobs": jobs, "publications": publications, "engines": engines, "batches": batches}

__all__ = ["HANDLERS", "add_commands", "read_payload"]
