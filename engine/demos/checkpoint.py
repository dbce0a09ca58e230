"""``tidelog demo``: checkpoint a fleet mid-episode, crash it, restore, finish.

Runs everything as real processes on loopback: the orchestrator (``tidelog serve`` over a SQLite
journal file, or ``--journal-url``), whose configuration (``WORKDIR/tidelog.yaml``, one file)
declares the four reference participants as its stack (``deployment.services``): the orchestrator
starts them in dependency order and owns them. Then, as a trainer would:

1. submit the episodes as rollouts (``POST /v1/rollouts``); the orchestrator dispatches them, and
   they get mid-way;
2. take a checkpoint through the API and wait until it is published and resumed;
3. SIGKILL the orchestrator: every participant dies with it (its owner is gone) and the episodes in
   flight with them; the demo checks that each recorded process group is gone;
4. request the restore of the latest checkpoint in the journal and start a fresh orchestrator,
   which brings the stack back from the journal (same ports, same state directories); the restore
   waits for it;
5. the orchestrator restores the participants and sends each rollout again as its next attempt,
   which continues from its checkpointed boundary, then forgets it;

and prints a short report — episodes continued, steps not repeated (the participants count every
step they complete), time per phase — and the SQL that shows the audit trail. Exit 0 when every
episode finished and no step ran twice, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from journal import machines

from engine.demos.arguments import checkpoint_demo_arguments
from engine.demos.ports import free_port

KINDS = ("environment", "model", "agent", "resources")
#: The stack's dependency order: an agent needs its model, an environment its agent and resources.
DEPENDS_ON = {"agent": ["model"], "environment": ["agent", "resources"]}
ROOT = Path(__file__).resolve().parents[2]


class Fleet:
    """The processes the demo runs, and their logs under ``workdir/logs``."""

    def __init__(self, workdir: Path, token: str) -> None:
        self.workdir = workdir
        self.env = {**os.environ, "TIDELOG_CONTROL_TOKEN": token, "PYTHONPATH": str(ROOT)}
        self.ports = {kind: free_port() for kind in KINDS}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.ports[kind]}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=log, stderr=log)
        self.procs[name] = proc
        return proc

    def participant_service(self, kind: str, extra: list[str], depends_on: list[str]) -> dict[str, Any]:
        """The reference participant ``kind`` as a service of the stack (``deployment.services``):
        ``extra`` its own arguments (``${endpoints.X}`` wires it to the others)."""
        return {
            "command": [sys.executable, "-m", f"workers.reference.{kind}", "--port", str(self.ports[kind]),
                        "--state-dir", str(self.workdir / "state" / kind),
                        # the orchestrator's checkpoint directory (see the config) lies here
                        "--checkpoint-root", str(self.workdir), *extra],
            "cwd": str(ROOT),
            "depends_on": depends_on,
            "endpoint": f"http://{{host}}:{self.ports[kind]}",
            # The token reaches the service through its environment only (the process table is public).
            "env": {"TIDELOG_CONTROL_TOKEN": "${env.TIDELOG_CONTROL_TOKEN}"},
            "readiness": {"command": [sys.executable, "-m", "workers.participant.ready", f"${{endpoints.{kind}}}"],
                          "interval_s": 0.2, "deadline_s": 60},
        }

    def services(self, step_delay: float) -> dict[str, Any]:
        """The four reference participants as the stack's services."""
        extra = {"agent": ["--model", "${endpoints.model}"],
                 "environment": ["--agent", "${endpoints.agent}", "--resources", "${endpoints.resources}",
                                 "--step-delay", str(step_delay)]}
        return {kind: self.participant_service(kind, extra.get(kind, []), DEPENDS_ON.get(kind, []))
                for kind in KINDS}

    def kill(self, *names: str) -> None:
        """SIGKILL the named processes at once, then reap them."""
        procs = [self.procs.pop(name) for name in names]
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc in procs:
            proc.wait()

    def start_orchestrator(self, config: Path) -> None:
        self._spawn("orchestrator", ["-m", "engine.cli", "--config", str(config), "serve"])

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Api:
    def __init__(self, http: aiohttp.ClientSession, base: str, token: str) -> None:
        self.http, self.base = http, base
        self.auth = {"Authorization": f"Bearer {token}"}

    async def get(self, path: str) -> Any:
        async with self.http.get(self.base + path) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        async with self.http.post(self.base + path, json=body, headers=self.auth) as resp:
            reply = await resp.json(content_type=None)
            if resp.status >= 300:
                raise RuntimeError(f"POST {path}: HTTP {resp.status} {reply}")
            return reply

    async def wait(self, path: str, done: Collection[str], timeout: float = 120.0, *, quiet: bool = False
                   ) -> dict[str, Any]:
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            row = await self.get(path)
            if row is not None:
                state = row.get("state")
                if state != last and not quiet:
                    print(f"  {path.rsplit('/', 1)[-1]}: {state}", flush=True)
                    last = state
                if state in done:
                    return dict(row)
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{path} did not finish within {timeout:.0f} s")


    async def wait_stack(self, state: str, timeout: float = 120.0) -> None:
        await wait_stack(self.get, state, timeout)


async def wait_stack(get: Callable[[str], Awaitable[Any]], state: str, timeout: float = 120.0) -> None:
    """Until the leader's stack is in ``state`` (``GET /v1/services`` through ``get``, ``None`` while
    no orchestrator answers); a failed stack is an error naming why."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stack = (await get("/v1/services") or {}).get("stack") or {}
        if stack.get("state") == state:
            return
        if stack.get("state") == "failed":
            raise RuntimeError(f"the stack failed: {stack.get('reason')}")
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the stack was not {state} within {timeout:.0f} s")


async def died_with_owner(pids: dict[str, dict[str, Any]], timeout: float = 10.0) -> int:
    """How many of the services' process groups (``services.pids``: the leader and its start time)
    are gone within ``timeout``: a pid alive with another start time is a new process, not theirs."""
    from engine.workflows.deployment.local import group_alive

    end = time.monotonic() + timeout
    while True:
        alive = [name for name, p in pids.items() if group_alive(p)]
        if not alive or time.monotonic() >= end:
            return len(pids) - len(alive)
        await asyncio.sleep(0.05)


async def until_up(http: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            async with http.get(url) as resp:
                if resp.status < 500:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not come up within {timeout:.0f} s")


async def request_restore(journal_url: str, checkpoint_dir: str) -> tuple[str, list[str]]:
    """Write the restore of ``<checkpoint_dir>/LATEST`` into the journal (no orchestrator runs):
    its id and the scope it continues."""
    from engine.workflows.checkpoint.confined import run as confined_run
    from engine.workflows.checkpoint.restore import resolve_checkpoint, start_restore
    from journal import Journal

    checkpoint_id, scope = await confined_run(resolve_checkpoint, checkpoint_dir)
    journal = Journal.open(journal_url)
    try:
        async with journal.write() as tx:
            await start_restore(tx, "rs-demo", checkpoint_dir, checkpoint_id, scope)
    finally:
        await journal.dispose()
    return "rs-demo", scope


async def statuses(http: aiohttp.ClientSession, fleet: Fleet, token: str) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in KINDS:
        async with http.get(f"{fleet.url(kind)}/ng-control/v1/checkpoint/status",
                            headers={"Authorization": f"Bearer {token}"}) as resp:
            out[kind] = await resp.json()
    return out


def checkpointed_steps(checkpoint_dir: Path) -> dict[str, set[str]]:
    """Per rollout, the environment steps its checkpointed boundary says were already completed."""
    done: dict[str, set[str]] = {}
    for path in (checkpoint_dir / "gym" / "environment").glob("*/records-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rollout = record["episode_id"]["rollout_id"]
            boundary = record.get("boundary") or {}
            steps = {f"turn-{t}:act" for t in range(1, boundary.get("turn", 0) + 1)}
            steps |= {f"turn-{t}:check" for t in range(1, len(boundary.get("checks", [])) + 1)}
            if boundary.get("next") == "return":
                steps.add("verify")
            done[rollout] = steps
    return done


def all_steps(turns: int) -> set[str]:
    return {f"turn-{t}:{s}" for t in range(1, turns + 1) for s in ("act", "check")} | {"verify"}


async def run(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir.resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    token = secrets.token_urlsafe(24)
    fleet = Fleet(workdir, token)
    journal_url = args.journal_url or f"sqlite+aiosqlite:///{workdir / 'tidelog.db'}"
    api_port = free_port()
    config = workdir / "tidelog.yaml"
    config.write_text(yaml.safe_dump({
        "journal": {"url": journal_url},
        "api": {"port": api_port},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1},
        # Reprobed every 5 s at most (not on the doubling backoff) should a probe time out under load.
        "discovery": {"probe_timeout_s": 5, "interval_s": 5, "max_backoff_s": 5},
        "checkpoint": {"directory": str(workdir / "checkpoints"), "prepare_timeout_s": 20},
        "participants": [{"name": f"{kind}-0", "url": fleet.url(kind)} for kind in KINDS],
        # The fleet is the orchestrator's stack: it starts the participants in dependency order, they
        # die with it (owner loss), and the next orchestrator brings them back from the journal.
        "deployment": {"run_dir": str(workdir / "run"), "services": fleet.services(args.step_delay)},
        "logging": {"level": "WARNING", "format": "text"},
    }))
    phases: dict[str, float] = {}
    print(f"tidelog demo: working in {workdir}")
    migrate = subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(config), "migrate"], cwd=ROOT,
                             env=fleet.env, capture_output=True, text=True)
    if migrate.returncode != 0:
        print(migrate.stderr, file=sys.stderr)
        return 1
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            started = time.perf_counter()
            fleet.start_orchestrator(config)
            api = Api(http, f"http://127.0.0.1:{api_port}", token)
            await until_up(http, api.base + "/healthz")
            await api.wait_stack("ready")
            phases["stack start-up"] = time.perf_counter() - started
            while True:  # discovery finds the four participants healthy
                rows = await api.get("/v1/participants") or {}
                items = rows.get("participants", rows) if isinstance(rows, dict) else rows
                if len([p for p in items if p.get("health") == "healthy"]) == len(KINDS):
                    break
                await asyncio.sleep(0.2)

            tasks = {f"ep{i}": {"prompt": f"demo task {i}", "turns": args.turns} for i in range(args.episodes)}
            print(f"submitting {len(tasks)} rollouts of {args.turns} turns each; the orchestrator dispatches them")
            await api.post("/v1/rollouts", {"tasks": [{"rollout_id": rid, "input": t} for rid, t in tasks.items()]})
            while len((await api.get("/v1/rollouts?state=dispatched") or {}).get("rollouts", [])) < len(tasks):
                await asyncio.sleep(0.1)
            await asyncio.sleep(args.step_delay * 3)

            started = time.perf_counter()
            checkpoint_id = (await api.post("/v1/checkpoints", {}))["checkpoint_id"]
            print(f"checkpoint {checkpoint_id} taken mid-episode")
            row = await api.wait(f"/v1/checkpoints/{checkpoint_id}", machines.CHECKPOINTS.terminal)
            phases["checkpoint"] = time.perf_counter() - started
            if row["state"] != "done":
                print(f"tidelog demo: the checkpoint ended {row['state']}: {row.get('detail')}", file=sys.stderr)
                return 1
            row_dir = str(Path(row["checkpoint_dir"]) / checkpoint_id)
            finished_before = {r["id"] for r in (await api.get("/v1/rollouts?state=finished") or {}).get(
                "rollouts", [])} | {r["id"] for r in (await api.get("/v1/rollouts?state=forgotten") or {}).get(
                "rollouts", [])}

            services = (await api.get("/v1/services") or {}).get("services", [])
            pids = {r["name"]: r["pids"] for r in services if r.get("pids")}
            started = time.perf_counter()
            fleet.kill("orchestrator")
            gone = await died_with_owner(pids)
            phases["services gone after the owner"] = time.perf_counter() - started
            print(f"SIGKILLed the orchestrator: its {gone} of {len(KINDS)} participants died with it"
                  " (owner loss), with the episodes in flight")
            if gone != len(KINDS):
                print(f"tidelog demo: only {gone} of {len(KINDS)} services died with their owner", file=sys.stderr)
                return 1
            started = time.perf_counter()
            # Requested before a fresh orchestrator leads, as an operator's recovery does: the
            # restore then continues the rollouts before their lost attempts could be rerun. It
            # waits for the stack the new orchestrator brings back before it picks its members.
            restore_id, scope = await request_restore(journal_url, str(workdir / "checkpoints"))
            print(f"restore {restore_id} requested: {len(scope)} episodes were in the checkpoint")
            fleet.start_orchestrator(config)
            await until_up(http, api.base + "/healthz")
            await api.wait_stack("ready")
            phases["stack back from the journal"] = time.perf_counter() - started

            started = time.perf_counter()
            row = await api.wait(f"/v1/restores/{restore_id}", machines.RESTORES.terminal)
            phases["restore"] = time.perf_counter() - started
            if row["state"] != "done":
                print(f"tidelog demo: the restore failed: {row.get('detail')}", file=sys.stderr)
                return 1

            started = time.perf_counter()
            from workers.protocol import EpisodeId
            continued = [EpisodeId.from_capture_key(k) for k in scope]
            results = []
            for episode in continued:  # the orchestrator sends each as its next attempt, then forgets it
                done = await api.wait(f"/v1/rollouts/{episode.rollout_id}", {"forgotten"}, quiet=True)
                if (done.get("result") or {}).get("attempt") == episode.attempt + 1:
                    results.append(done["result"])
            phases["finish continued rollouts"] = time.perf_counter() - started
            after = await statuses(http, fleet, token)

        # The environment's steps of each continued episode: those its checkpointed boundary holds,
        # plus those the replacement attempt ran, must be every step of the episode, each once.
        done_before = checkpointed_steps(Path(row_dir))
        repeated: dict[str, list[str]] = {}
        for episode in continued:
            ran = after["environment"].get("executions", {}).get(episode.next_attempt().capture_key, {})
            again = sorted(set(ran) & done_before.get(episode.rollout_id, set()))
            twice = sorted(step for step, n in ran.items() if n != 1)
            missing = sorted(all_steps(args.turns) - set(ran) - done_before.get(episode.rollout_id, set()))
            if again or twice or missing:
                repeated[episode.rollout_id] = again + twice + [f"missing {m}" for m in missing]
        steps_after = sum(sum(v.values()) for v in after["environment"].get("executions", {}).values())
        steps_before = sum(len(v) for v in done_before.values())
        print()
        print("report")
        print(f"  episodes continued from their checkpointed boundary: {len(results)} of {len(scope)}"
              f" (finished before the crash: {len(finished_before)})")
        print(f"  environment steps: {steps_before} kept by the checkpoint, {steps_after} run after the restore; "
              f"steps run again or lost: {sum(len(v) for v in repeated.values())}")
        for name, seconds in phases.items():
            print(f"  {name:<28} {seconds:6.2f} s")
        print()
        print("audit trail (SQLite shell):")
        print(f"  sqlite3 {workdir / 'tidelog.db'} \"SELECT seq, ts, entity_kind, entity_id, from_state, to_state, "
              f"reason FROM events WHERE entity_kind IN ('rollouts', 'checkpoints', 'restores') ORDER BY seq;\"")
        print("  more queries: docs/audit.md")
        if repeated:
            print(f"tidelog demo: steps run again or lost: {json.dumps(repeated)}", file=sys.stderr)
            return 1
        return 0 if len(results) == len(scope) else 1
    finally:
        fleet.stop_all()


def run_demo(args: argparse.Namespace) -> int:
    if args.episodes < 1 or args.turns < 1 or args.step_delay < 0:
        print("tidelog demo: --episodes and --turns must be >= 1, --step-delay >= 0", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tidelog demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_demo_arguments(p)
    return run_demo(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
