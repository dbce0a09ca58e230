"""The RL demo: a real training loop on the CPU, through crashes, with every step applied once.

    tidelog demo-train [--rounds 10] [--episodes 8] [--turns 3] [--workdir DIR]

Real processes on loopback: ``tidelog serve`` over a SQLite journal (or ``--journal-url``) with
``training`` enabled (an ``mp`` trainer: ``workers.trainer.worker.Trainer``, seed 0) and
``training.batching`` (batches of ``--episodes`` rollouts, ``max_staleness`` 0, the reference task's
sample ``workers.reference.samples:episode``), one reference inference engine
(``python -m workers.inference.reference``) started from the same seed-0 weights (the deployment's
``initial_weights``, registered as its committed head at start), and the four reference participants
— the model generating each action on the engine (``--engine``: 6 tokens sampled at temperature 1
with a seed from the conversation's digest), the resources server checking each action against a
rule a policy can learn (``--task letter:s``: the action holds an ``s``). The engine and the
participants are the orchestrator's stack, declared in its one configuration file
(``WORKDIR/tidelog.yaml``, ``deployment.services``): it starts them in dependency order and gates
the engine onto the committed head before the stack is ready. Each round:

1. ``--episodes`` episodes of ``--turns`` turns are submitted as rollouts (``POST /v1/rollouts``)
   and the orchestrator runs them on the environment; the verifier's reward of an episode is the
   fraction of its actions that passed; each rollout row records the version it ran on;
2. the orchestrator groups the finished rollouts into a batch (``GET /v1/batches/{id}``) and submits
   it as a training job in the same write — the demo submits no job itself;
3. the orchestrator trains it (one REINFORCE step), checkpoints it, and publishes the weights to
   the engine behind the commit gate; the demo waits for ``COMPLETE`` and checks that the
   engine serves the job's ``runtime_load_id`` — the next round's actions are generated on it.

Mid-way it SIGKILLs the orchestrator twice (``TIDELOG_CRASH_AT``: right after a job's
``RUNNING->CHECKPOINT`` commit, and right after another's ``UPDATING_WEIGHTS->READY_TO_COMMIT``
commit, engines paused on the candidate) and the trainer process once (right after a batch's job
is submitted); after each the next orchestrator (or trainer) finishes the same job, never training
it twice. A crashed orchestrator's stack dies with it; the next one brings it back from the journal,
its fresh engine paused and put on the committed head before it serves a request. It ends with a report and exits 0 only if the mean reward of the last rounds beats the
first rounds', every round's rollouts made up exactly one batch, every job is ``COMPLETE`` with
trainer steps 1..N, the trainer's persisted step counter (``step.json``) is N, every round generated
on (and its rollout rows record) the version the previous job published, every crash happened, and
``tidelog verify`` is clean.
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
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa
import yaml

from journal import machines

from engine.demos.arguments import training_demo_arguments
from engine.demos.checkpoint import DEPENDS_ON, KINDS, ROOT, Fleet, until_up, wait_stack
from engine.demos.ports import free_port

CRASH_CHECKPOINT = "training_jobs:RUNNING->CHECKPOINT"
CRASH_PUBLICATION = "training_jobs:UPDATING_WEIGHTS->READY_TO_COMMIT"
DEPLOYMENT = "demo"
ENGINE = "engine-0"


class TrainingFleet(Fleet):
    """The demo's processes: the participants, one reference engine, successive orchestrators."""

    def __init__(self, workdir: Path, token: str, args: argparse.Namespace) -> None:
        super().__init__(workdir, token)
        self.args = args
        self.ports["engine"] = free_port()
        self.serves = 0

    def rl_services(self, initial: Path) -> dict[str, Any]:
        """The stack: the reference engine (``training.engines`` entry ``engine-0``, started from the
        seed-0 weights; each launch is gated onto the committed head before the stack is ready) and
        the four participants, the model generating on the engine."""
        engine = {"command": [sys.executable, "-m", "workers.inference.reference", "--port", str(self.ports["engine"]),
                              "--model-dir", str(initial)],
                  "cwd": str(ROOT), "endpoint": f"http://{{host}}:{self.ports['engine']}", "engine": ENGINE,
                  "readiness": {"http": "${endpoints.engine}/get_weight_version", "interval_s": 0.2,
                                "deadline_s": 120}}
        extra = {"agent": ["--model", "${endpoints.model}"],
                 "environment": ["--agent", "${endpoints.agent}", "--resources", "${endpoints.resources}"],
                 "model": ["--engine", "${endpoints.engine}", "--temperature", str(self.args.temperature)],
                 "resources": ["--task", self.args.task]}
        depends = {**DEPENDS_ON, "model": ["engine"]}
        return {"engine": engine, **{kind: self.participant_service(kind, extra[kind], depends.get(kind, []))
                                     for kind in KINDS}}

    def start_serve(self, config: Path, crash_at: str | None) -> subprocess.Popen[bytes]:
        """A new orchestrator (armed to SIGKILL itself at ``crash_at``); its log is ``orchestrator-N``."""
        self.serves += 1
        env = dict(self.env)
        env.pop("TIDELOG_CRASH_AT", None)
        if crash_at:
            env["TIDELOG_CRASH_AT"] = crash_at
        log = open(self.workdir / "logs" / f"orchestrator-{self.serves}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "--config", str(config), "serve"],
                                cwd=ROOT, env=env, stdout=log, stderr=log)
        self.procs[f"orchestrator-{self.serves}"] = proc
        return proc


def trainer_pids(serve_pid: int) -> list[int]:
    """The orchestrator's trainer processes: its children that multiprocessing spawned."""
    proc = Path("/proc")
    if proc.is_dir():  # Linux: the children the kernel lists, and their command lines
        pids = []
        for listing in (proc / str(serve_pid) / "task").glob("*/children"):
            for child in listing.read_text().split():
                try:
                    if b"spawn_main" in (proc / child / "cmdline").read_bytes():
                        pids.append(int(child))
                except FileNotFoundError:
                    continue  # it ended meanwhile
        return pids
    # Elsewhere ps, at unlimited width (a COLUMNS in the environment would cut the command lines).
    out = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,args="], capture_output=True, text=True,
                         check=True).stdout
    pids = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] == str(serve_pid) and "spawn_main" in parts[2]:
            pids.append(int(parts[0]))
    return pids


class JobsApi:
    """The orchestrator's training routes, riding out its restarts."""

    def __init__(self, http: aiohttp.ClientSession, base: str, token: str) -> None:
        self.http, self.base = http, base
        self.auth = {"Authorization": f"Bearer {token}"}

    async def get(self, path: str) -> Any:
        try:
            async with self.http.get(self.base + path) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except aiohttp.ClientError:
            return None  # between two orchestrators

    async def batch_of(self, rollout_ids: list[str], serve: subprocess.Popen[bytes],
                       timeout: float = 90.0) -> dict[str, Any] | None:
        """The batch that took ``rollout_ids`` (each rollout's ``batch_id``), once it is submitted;
        ``None`` if the orchestrator died first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if serve.poll() is not None:
                return None
            rows = [await self.get(f"/v1/rollouts/{rid}") for rid in rollout_ids]
            held = {None if r is None else r.get("batch_id") for r in rows}
            if len(held) == 1 and None not in held:
                batch = await self.get(f"/v1/batches/{held.pop()}")
                if batch is not None and batch["state"] != "open":
                    return dict(batch)
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no submitted batch took the rollouts {rollout_ids} within {timeout:.0f} s")

    async def head(self, timeout: float = 60.0) -> str:
        """The deployment's committed head once the engine serves it (the gate put it there)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            versions = await self.get("/v1/publications?state=committed&limit=1") or {"publications": []}
            engines = await self.get("/v1/engines") or {"engines": []}
            if versions["publications"] and engines["engines"] and all(
                    e["state"] == "serving" and e["serving_version"] == versions["publications"][0]["id"]
                    for e in engines["engines"]):
                return str(versions["publications"][0]["id"])
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the engine did not serve the committed head within {timeout:.0f} s")

    async def submit(self, tasks: dict[str, dict[str, Any]], timeout: float = 90.0) -> None:
        """Submit ``tasks`` as rollouts (``POST /v1/rollouts``, again while no leader answers)."""
        end = time.monotonic() + timeout
        body = {"tasks": [{"rollout_id": rid, "input": task} for rid, task in tasks.items()]}
        while True:
            try:
                async with self.http.post(self.base + "/v1/rollouts", json=body, headers=self.auth) as resp:
                    reply = await resp.json(content_type=None)
                    if resp.status in (200, 201):
                        return
                    if resp.status != 503:
                        raise RuntimeError(f"POST /v1/rollouts: HTTP {resp.status} {reply}")
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"POST /v1/rollouts: no leader took the rollouts within {timeout:.0f} s")
            await asyncio.sleep(0.1)

    async def results(self, ids: list[str], serve: subprocess.Popen[bytes], into: dict[str, dict[str, Any]],
                      timeout: float = 90.0) -> bool:
        """Wait until the orchestrator has run each rollout to its end, adding rollout id -> its
        result (the ``/run`` reply) to ``into``; ``False`` if ``serve`` died first (its job may have
        been trained, and its crash hook fired, before the last result was read here)."""
        end = time.monotonic() + timeout
        while len(into) < len(ids):
            if serve.poll() is not None:
                return False
            for rid in ids:
                row = None if rid in into else await self.get(f"/v1/rollouts/{rid}")
                if row is not None and row["state"] in ("finished", "forgotten"):
                    into[rid] = dict(row["result"])
                elif row is not None and row["state"] == "failed":
                    raise RuntimeError(f"rollout {rid} failed: {row.get('detail')}")
            if time.monotonic() > end:
                raise TimeoutError(f"rollouts not finished within {timeout:.0f} s: {await self.stuck(set(ids) - set(into))}")
            await asyncio.sleep(0.05)
        return True

    async def stuck(self, ids: set[str]) -> str:
        """What the journal says of rollouts that did not finish, and of the participants (for the
        error that ends the demo)."""
        said = []
        for rid in sorted(ids):
            row = await self.get(f"/v1/rollouts/{rid}") or {}
            said.append(f"{rid}: {row.get('state')} attempt {row.get('attempt')} on {row.get('environment')} "
                        f"({row.get('detail')})")
        parts = (await self.get("/v1/participants") or {}).get("participants", [])
        said.append("participants: " + ", ".join(f"{p['name']} {p['health']}" for p in parts))
        return "; ".join(said)

    async def until_complete_or_dead(self, job_id: str, serve: subprocess.Popen[bytes],
                                     timeout: float = 90.0) -> dict[str, Any] | None:
        """The job once ``COMPLETE``; ``None`` if the orchestrator died first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if serve.poll() is not None:
                return None
            row = await self.get(f"/v1/jobs/{job_id}")
            if row is not None and row["state"] == "COMPLETE":
                return dict(row)
            if row is not None and row["state"] in machines.TRAINING_JOBS.terminal - {"COMPLETE"}:
                raise RuntimeError(f"job {job_id} ended {row['state']}: {row.get('detail')}")
            await asyncio.sleep(0.05)
        raise TimeoutError(f"job {job_id} was not COMPLETE within {timeout:.0f} s")


def path_of(job: dict[str, Any]) -> str:
    return " -> ".join(p["state"] for p in job.get("phases", []))


def short(version: str) -> str:
    """A runtime load id ``<32 hex>:<n>`` as ``<8 hex>…:<n>``."""
    incarnation, sep, sequence = version.rpartition(":")
    return f"{incarnation[:8]}…:{sequence}" if sep and len(incarnation) > 8 else version


async def run(args: argparse.Namespace) -> int:
    from workers.policy import Policy, save_weights  # torch: only this command needs it

    workdir: Path = args.workdir.resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    token = secrets.token_urlsafe(24)
    fleet = TrainingFleet(workdir, token, args)
    initial = workdir / "training" / "initial"
    save_weights(Policy(seed=0), initial, "initial")  # the trainer's seed-0 weights, served at start
    journal_url = args.journal_url or f"sqlite+aiosqlite:///{workdir / 'tidelog.db'}"
    api_port = free_port()
    state_dir = workdir / "training" / "trainer"
    config = workdir / "tidelog.yaml"
    config.write_text(yaml.safe_dump({
        "journal": {"url": journal_url},
        "api": {"port": api_port},
        # A leader that misses its renewals steps down and stops its stack: 4 s rides out a loaded
        # machine; each crash's successor waits that long for the lease.
        "orchestrator": {"lease_ttl_s": 4, "lease_renew_s": 0.5, "shutdown_grace_s": 2},
        "reconciler": {"resync_interval_s": 1},
        # A probe that times out under load marks a participant unreachable, and no rollout is
        # dispatched to it until a probe answers: reprobed every 5 s at most, not on the default
        # doubling backoff (up to 10 minutes), which would outlast the demo's deadlines.
        "discovery": {"probe_timeout_s": 5, "interval_s": 5, "max_backoff_s": 5},
        "checkpoint": {"directory": str(workdir / "checkpoints")},
        "participants": [{"name": f"{kind}-0", "url": fleet.url(kind)} for kind in KINDS],
        "training": {"enabled": True, "executor": "mp", "deployment": DEPLOYMENT,
                     "trainer": {"seed": 0, "state_dir": str(state_dir)},
                     "checkpoint_dir": str(workdir / "training" / "checkpoints"),
                     "weights_dir": str(workdir / "training" / "weights"), "initial_weights": str(initial),
                     "retry_after_s": 0.3, "publish_retry_after_s": 0.3,
                     "batching": {"enabled": True, "size": args.episodes, "max_staleness": 0,
                                  "sample": "workers.reference.samples:episode"},
                     "engines": [{"name": ENGINE, "url": fleet.url("engine")}]},
        # The fleet is the orchestrator's stack: it dies with each orchestrator the demo crashes, and
        # the next one brings it back from the journal (the engine gated onto the committed head).
        "deployment": {"run_dir": str(workdir / "run"), "services": fleet.rl_services(initial)},
        "logging": {"level": "WARNING", "format": "text"},
    }))
    rounds = args.rounds
    crash_round, kill_round, crash2_round = (-1, -1, -1) if args.no_crashes else \
        (rounds // 3, rounds // 2, (2 * rounds) // 3)
    print(f"tidelog RL demo: working in {workdir}")
    print(f"  {rounds} rounds of {args.episodes} episodes x {args.turns} turns; task {args.task}; "
          f"temperature {args.temperature}")
    if not args.no_crashes:
        print(f"  crashes: orchestrator after RUNNING->CHECKPOINT in round {crash_round + 1}, trainer in round "
              f"{kill_round + 1}, orchestrator after UPDATING_WEIGHTS->READY_TO_COMMIT in round {crash2_round + 1}")
    migrate = subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(config), "migrate"], cwd=ROOT,
                             env=fleet.env, capture_output=True, text=True)
    if migrate.returncode != 0:
        print(migrate.stderr, file=sys.stderr)
        return 1
    problems: list[str] = []
    rewards: list[float] = []
    jobs: list[str] = []
    crashes: list[str] = []
    digest = "-"
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            # Armed for the first crash: the (crash_round+1)-th RUNNING->CHECKPOINT of this process.
            serve = fleet.start_serve(config, None if crash_round < 0 else f"{CRASH_CHECKPOINT}@{crash_round + 1}")
            api = JobsApi(http, f"http://127.0.0.1:{api_port}", token)
            await until_up(http, api.base + "/healthz")
            await wait_stack(api.get, "ready")
            auth = {"Authorization": f"Bearer {token}"}

            async def generated_on() -> dict[str, int]:
                async with http.get(f"{fleet.url('model')}/ng-control/v1/checkpoint/status", headers=auth) as resp:
                    return dict((await resp.json()).get("generated_on", {}))

            async def restart(after: str, crash_at: str | None) -> subprocess.Popen[bytes]:
                code = serve.wait()
                log = (workdir / "logs" / f"orchestrator-{fleet.serves}.log").read_text(errors="replace")
                if code != -signal.SIGKILL or f"crash hook {after.split('@')[0]} fired" not in log:
                    raise RuntimeError(f"the orchestrator ended with {code}, not the crash hook {after}")
                crashes.append(f"orchestrator SIGKILLed after {after.split('@')[0]}")
                print(f"  ! orchestrator SIGKILLed by its crash hook right after {after.split('@')[0]} (its stack "
                      f"died with it); starting another, which brings the stack back", flush=True)
                return fleet.start_serve(config, crash_at)

            expected = await api.head()  # the version each round's actions must come from
            print()
            print(f"  {'round':>5}  {'reward':>6}  {'actions generated on':<22}  {'job':<12}  {'serving after':<13}")
            for r in range(rounds):
                t0 = time.perf_counter()
                notes: list[str] = []
                restarted = False

                async def recover() -> None:
                    """The orchestrator died in round ``r``: by its crash hook, or this is an error."""
                    nonlocal serve, restarted
                    if restarted:
                        raise RuntimeError("the restarted orchestrator died too")
                    if r == crash_round:
                        serve = await restart(CRASH_CHECKPOINT, None if crash2_round < 0 else
                                              f"{CRASH_PUBLICATION}@{crash2_round - crash_round + 1}")
                    elif r == crash2_round:
                        serve = await restart(CRASH_PUBLICATION, None)
                    else:
                        raise RuntimeError(f"the orchestrator died unexpectedly (exit {serve.poll()})")
                    restarted = True
                    notes.append("finished by the next orchestrator")
                    # The counts below are read from the model of the rebuilt stack (they survive it).
                    await wait_stack(api.get, "ready")

                # After a crash the next orchestrator may finish the job before its stack is whole again.
                await wait_stack(api.get, "ready")
                before = await generated_on()
                # The round's episodes, submitted as rollouts: the orchestrator dispatches them.
                tasks = {f"round-{r}-ep-{k}": {"prompt": f"round {r} task {k}", "turns": args.turns}
                         for k in range(args.episodes)}
                rollout_ids = list(tasks)
                done: dict[str, dict[str, Any]] = {}
                await api.submit(tasks)
                while not await api.results(rollout_ids, serve, done):
                    await recover()
                try:
                    after = await generated_on()
                except aiohttp.ClientError:
                    if serve.poll() is None:
                        raise
                    await recover()  # its job crashed it (and the model with it) before this read
                    after = await generated_on()
                results = [done[rid] for rid in rollout_ids]
                used = {v: n - before.get(v, 0) for v, n in after.items() if n != before.get(v, 0)}
                if set(used) != {expected}:
                    problems.append(f"round {r + 1} generated on {used}, not only on {expected}")
                reward = sum(float(x["reward"]) for x in results) / len(results)
                rewards.append(reward)
                batch = await api.batch_of(rollout_ids, serve)
                job = None
                if batch is not None:
                    job_id = str(batch["job_id"])
                    if r == kill_round:
                        trainer = trainer_pids(serve.pid)
                        if not trainer:
                            problems.append(f"round {r + 1}: no trainer process of the orchestrator to kill")
                        for pid in trainer:
                            os.kill(pid, signal.SIGKILL)
                            crashes.append(f"trainer (pid {pid}) SIGKILLed right after its batch's job was submitted")
                        print(f"  ! trainer SIGKILLed right after job {job_id[:12]} was submitted", flush=True)
                        notes.append("trainer killed")
                    job = await api.until_complete_or_dead(job_id, serve)
                if job is None:
                    await recover()
                    batch = await api.batch_of(rollout_ids, serve)
                    job = None if batch is None else await api.until_complete_or_dead(str(batch["job_id"]), serve)
                    if batch is None or job is None:
                        raise RuntimeError("the restarted orchestrator died too")
                if r in (crash_round, crash2_round) and not restarted:
                    problems.append(f"round {r + 1}: the orchestrator's crash hook never fired")
                assert batch is not None and job is not None
                # Read once the job is done: the orchestrator may have died since the rollouts finished.
                recorded = {(await api.get(f"/v1/rollouts/{rid}") or {}).get("weight_version") for rid in rollout_ids}
                if recorded != {expected}:
                    problems.append(f"round {r + 1}: its rollouts record {recorded}, not {expected}")
                job_id = str(batch["job_id"])
                if sorted(batch["rollout_ids"]) != sorted(rollout_ids):
                    problems.append(f"round {r + 1}: batch {batch['id']} holds {batch['rollout_ids']}")
                notes.insert(0, f"batch {batch['id'].rpartition('.')[2]}")
                jobs.append(job_id)
                async with http.get(fleet.url("engine") + "/get_weight_version") as resp:
                    serving = (await resp.json())["weight_version"]
                if serving != job["runtime_load_id"]:
                    problems.append(f"round {r + 1}: the engine serves {serving}, not {job['runtime_load_id']}")
                expected = job["runtime_load_id"]
                digest = json.loads((Path(job["publication"]["weights_path"]) / "weights.json").read_text())["sha256"]
                shown = ", ".join(f"{short(v)} x{n}" for v, n in used.items())
                print(f"  {r + 1:>5}  {reward:6.2f}  {shown:<22}  {job_id[:12]}  {short(serving):<13}  "
                      f"({'; '.join(notes)}; {time.perf_counter() - t0:.1f} s)", flush=True)
                if len(notes) > 1:
                    print(f"         job path: {path_of(job)}", flush=True)

            listed = await api.get("/v1/jobs?limit=1000") or {"jobs": []}
        fleet.stop_all()
        by_id = {j["id"]: j for j in listed["jobs"]}
        complete = [j for j in jobs if by_id.get(j, {}).get("state") == "COMPLETE"]
        steps = sorted(int((by_id[j].get("metrics") or {}).get("step", -1)) for j in complete)
        record = json.loads((state_dir / "step.json").read_text())
        verify = subprocess.run([sys.executable, "-m", "engine.cli", "--config", str(config), "verify"], cwd=ROOT,
                                env=fleet.env, capture_output=True, text=True)
        head = max(2, rounds // 4)
        first, last = sum(rewards[:head]) / head, sum(rewards[-head:]) / head
        if not last > first:
            problems.append(f"the reward did not rise: {first:.2f} in the first {head} rounds, {last:.2f} in the last")
        if len(complete) != rounds or len(listed["jobs"]) != rounds:
            problems.append(f"{len(complete)} of {rounds} jobs COMPLETE ({len(listed['jobs'])} jobs in the journal)")
        if steps != list(range(1, rounds + 1)):
            problems.append(f"the jobs' trainer steps are {steps}, not 1..{rounds}, each once")
        if record.get("step") != len(complete):
            problems.append(f"the trainer's step.json says step {record.get('step')}, not {len(complete)}")
        if verify.returncode != 0:
            problems.append(f"tidelog verify: {verify.stdout.strip()} {verify.stderr.strip()}")
        if not args.no_crashes and len(crashes) < 3:
            problems.append(f"only {len(crashes)} of 3 crashes happened")

        print()
        print("report")
        print(f"  reward: {first:.2f} over the first {head} rounds -> {last:.2f} over the last {head} "
              f"(per round: {' '.join(f'{x:.2f}' for x in rewards)})")
        print(f"  jobs COMPLETE: {len(complete)} of {rounds}; their trainer steps: {steps[0] if steps else '-'}.."
              f"{steps[-1] if steps else '-'}, each once")
        print(f"  trainer step counter (step.json): {record.get('step')} ({record.get('phase')}, job "
              f"{str(record.get('job_id'))[:12]}) == jobs COMPLETE: {record.get('step') == len(complete)}")
        print(f"  weights published last: sha256 {digest} (a run without crashes publishes the same bytes)")
        print(f"  crashes: {len(crashes)}" + "".join(f"\n    - {c}" for c in crashes))
        print(f"  tidelog verify: {'clean' if verify.returncode == 0 else 'MISMATCHES'}")
        print(f"  wall time: {time.perf_counter() - started:.1f} s")
        print()
        shown_url = sa.engine.make_url(journal_url).render_as_string(hide_password=True)
        where = f"sqlite3 {workdir / 'tidelog.db'}" if args.journal_url is None else f"the journal at {shown_url}"
        print(f"audit the training jobs ({where}):")
        print("  SELECT scenario_step, substr(id, 1, 12) AS job, state, runtime_load_id, metrics "
              "FROM training_jobs ORDER BY scenario_step;")
        print("  SELECT id, state, job_id, base_version, rollout_ids, excluded FROM training_batches ORDER BY number;")
        print("  SELECT id, weight_version, batch_id, state FROM rollouts ORDER BY created_at;")
        print("  SELECT seq, ts, substr(entity_id, 1, 12) AS job, from_state, to_state, reason, epoch "
              "FROM events WHERE entity_kind = 'training_jobs' ORDER BY seq;")
        print("  more queries: docs/audit.md, docs/training.md")
        for problem in problems:
            print(f"tidelog RL demo: {problem}", file=sys.stderr)
        return 1 if problems else 0
    finally:
        fleet.stop_all()


def run_demo(args: argparse.Namespace) -> int:
    if args.rounds < 5 or args.episodes < 2 or args.turns < 1 or not args.temperature > 0:
        print("tidelog RL demo: --rounds must be >= 5, --episodes >= 2, --turns >= 1, --temperature > 0",
              file=sys.stderr)
        return 2
    from workers.reference.resources import checker

    try:
        checker(args.task)
    except SystemExit as exc:
        print(f"tidelog RL demo: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args))
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        print(f"tidelog RL demo: {type(exc).__name__}: {exc} (logs: {args.workdir.resolve() / 'logs'})",
              file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.demos.training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    training_demo_arguments(p)
    return run_demo(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
