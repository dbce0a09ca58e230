"""What the orchestrator adds to a training step and to a commit-gated publication.

Both are measured per journal backend (a SQLite file in WAL with ``synchronous=FULL``; a fresh
PostgreSQL database on ``TIDELOG_BENCH_POSTGRES_URL`` or 127.0.0.1:5432, created and dropped
here), against a peer that makes the same trainer and engine calls directly, with no journal and
no reconciler, alternating with Tidelog job by job in the same run.

**Training step** (``steps``). A real :class:`~engine.runtime.service.Orchestrator` (the defaults of
``config.example.yaml``) runs a :class:`~engine.workflows.training.controller.TrainingController` over
one ``workers.trainer.worker.Trainer`` rank (uni executor, with a ``state_dir``) and no engines.
``--steps`` jobs are submitted one after another (``engine.workflows.training.submit_job`` in a journal
write), each to its own deployment: with no engines a job stays ``CHECKPOINT``, which is in
flight, and a deployment has at most one job in flight. A job is timed from just before its
submit transaction to the commit of ``CHECKPOINT`` (stamped by a journal commit listener). The
peer, on a second trainer of its own (so that neither moves the other's latest step): the trainer
calls the controller makes for a new job, through ``asyncio.to_thread(executor.rpc)`` as the
controller does — ``health`` (the controller's check of the trainer's latest step), ``train``,
``save_checkpoint``, ``verify_checkpoint``.

**Publication** (``publication``). The same, with ``--engines`` reference inference engines
(``python -m workers.inference.reference`` processes on loopback, serving
``Policy(seed=0)`` saved as version ``initial``) behind ``SGLangEngine`` adapters, given to the
controller as its publication. ``--publications`` jobs of one deployment are submitted one
after another, each once the previous is ``COMPLETE``; a job is timed from the commit of
``CHECKPOINT`` to the commit of ``COMPLETE`` (commit-listener stamps, so no polling). The peer,
after an untimed step of its own trainer, makes the publication's calls in the publisher's order,
to every engine at once as the publisher does (``asyncio.gather``): pause every engine; the trainer's ``health``
(the publisher's check that its latest step is the job) and ``prepare_weights``;
``update_weights_from_disk`` on every engine; ``weight_version`` of every engine (the check of the
target); ``weight_version`` of every engine again (the check before generation continues);
``continue_generation`` on every engine. ``peer_sequential`` (informational, not a target) is the
same with the engines called one after another.

``overhead = median(Tidelog) - median(peer)``; targets: <= 20 ms per training step, <= 50 ms per
publication beyond the engines' own work. The trainer methods and the engine requests each side
made are counted, and printed when they differ. Each part's first job (first-time code paths;
a deployment's first publication also registers the engines' initial weights) is not timed.

    .venv/bin/python bench/training_loop.py                 # both backends, 100 steps and 50 publications each, ~1 min
    .venv/bin/python bench/training_loop.py --quick         # SQLite only, 5 steps and 3 publications, ~10 s
    .venv/bin/python bench/training_loop.py --backends postgresql --steps 50

The run ends with one JSON line holding every figure. The whole loop (rollouts per second through
dispatch, batch, job and publication) is ``bench/rl_loop.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _databases import Database  # noqa: E402  (bench/, the script's folder)
from engine.config import Settings  # noqa: E402
from engine.workflows.training.publication import PublicationSettings  # noqa: E402
from engine.workflows.training.controller import TrainingController, TrainingSettings  # noqa: E402
from engine.runtime.service import Orchestrator  # noqa: E402
from engine.workflows.training import job_identity, submit_job  # noqa: E402
from journal import Committed, models  # noqa: E402
from workers.executor import Executor, ExecutorConfig, WorkerSpec  # noqa: E402
from workers.inference.sglang import SGLangConfig, SGLangEngine  # noqa: E402
from workers.policy import Policy, encode, save_weights  # noqa: E402
from workers.trainer.worker import Trainer  # noqa: E402

STEP_TARGET_MS = 20.0
PUBLICATION_TARGET_MS = 50.0
PAUSE_MODE = "retract"  # PublicationSettings' default, used by both sides


# -- jobs ---------------------------------------------------------------------------------------

def payload(salt: int) -> dict[str, Any]:
    """A batch of the reference task (tests/support/training.py's, varied by ``salt``): four scored
    rollouts whose completion tokens are shifted by ``salt``'s base-27 digits, so that every salt
    below 27**12 is another job (``scenario_step`` is not part of a job's identity)."""
    digits = salt
    rollouts = []
    for index, text in enumerate(["aab", "bca", "aaa", "cab"]):
        completion = encode(text)
        for j in range(len(completion)):
            completion[j] = (completion[j] + digits % 27) % 27
            digits //= 27
        rollouts.append({"prompt": "ab c", "completion": completion,
                         "reward": float(text.count("a")) - 0.25 * index})
    return {"rollouts": rollouts, "scenario_step": salt}


class RecordingRanks:
    """An executor (or anything with its ``rpc``) that notes each trainer method called."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def rpc(self, rank: int, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
            timeout: float | None = None) -> Any:
        self.calls.append(method)
        return self.inner.rpc(rank, method, args, kwargs, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def trainer(state_dir: Path) -> Executor:
    return Executor.create(ExecutorConfig(backend="uni", workers=(
        WorkerSpec(Trainer, kwargs={"seed": 0, "state_dir": str(state_dir)}),)))


class CountingEngine(SGLangEngine):
    """The SGLang adapter, noting the route of each request it sends."""

    def __init__(self, config: SGLangConfig) -> None:
        super().__init__(config)
        self.requests: list[str] = []

    async def _call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        self.requests.append(path)
        return await super()._call(method, path, body, **kw)


def take_requests(engines: Sequence[CountingEngine]) -> Counter[str]:
    out: Counter[str] = Counter()
    for e in engines:
        out.update(e.requests)
        e.requests.clear()
    return out


# -- reference engines --------------------------------------------------------------------------

class EngineFleet:
    """``python -m workers.inference.reference`` processes, started together; SIGKILLed at the end."""

    def __init__(self, tmp: Path, n: int, model_dir: Path) -> None:
        self.tmp, self.n, self.model_dir = tmp, n, model_dir
        self.procs: list[subprocess.Popen[str]] = []
        self.urls: list[str | None] = [None] * n

    def start(self, timeout: float = 180.0) -> list[str]:
        found = [threading.Event() for _ in range(self.n)]
        for i in range(self.n):
            with open(self.tmp / f"engine-{i}.log", "ab") as stderr:
                proc = subprocess.Popen([sys.executable, "-m", "workers.inference.reference", "--port", "0",
                                         "--model-dir", str(self.model_dir)],
                                        cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
            self.procs.append(proc)

            def drain(i: int = i, proc: subprocess.Popen[str] = proc) -> None:
                assert proc.stdout is not None
                for line in proc.stdout:  # the port, then keep the pipe drained until the process exits
                    if not found[i].is_set() and line.startswith("listening on "):
                        self.urls[i] = line.split()[-1].rstrip("/")
                        found[i].set()
            threading.Thread(target=drain, name=f"drain-engine-{i}", daemon=True).start()
        end = time.monotonic() + timeout
        for i, event in enumerate(found):
            while not event.wait(0.1):
                if self.procs[i].poll() is not None or time.monotonic() > end:
                    log = (self.tmp / f"engine-{i}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"reference engine {i} did not start (exit {self.procs[i].returncode}):\n{log}")
        return [u for u in self.urls if u is not None]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)




# -- the orchestrator and its commit stamps -----------------------------------------------------

class Stamps:
    """A commit listener: when each job's row first reached each state (``perf_counter``), and its
    self-transitions (a publication step that failed and is tried again)."""

    BAD = ("AMBIGUOUS", "FAILED", "REJECTING", "REJECTED")

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}
        self.retries: Counter[str] = Counter()
        self.intents: set[str] = set()
        self.waiting: dict[tuple[str, str], asyncio.Event] = {}

    def __call__(self, committed: Sequence[Committed]) -> None:
        now = time.perf_counter()
        for c in committed:
            if c.kind != "training_jobs":
                continue
            self.at.setdefault(c.entity_id, {}).setdefault(c.to_state, now)
            if c.from_state == c.to_state:
                if c.to_state == "CHECKPOINT" and c.entity_id not in self.intents:
                    # A publication's first CHECKPOINT self-edge records its pause intent: a step, not a retry.
                    self.intents.add(c.entity_id)
                    continue
                self.retries[c.to_state] += 1
            for (job, state), event in self.waiting.items():
                if job == c.entity_id and (c.to_state == state or c.to_state in self.BAD):
                    event.set()

    async def until(self, orch: Orchestrator, job_id: str, state: str, timeout: float = 120.0) -> float:
        if state not in self.at.get(job_id, {}):
            event = self.waiting[(job_id, state)] = asyncio.Event()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                raise RuntimeError(f"job {job_id[:12]} did not reach {state} in {timeout:g} s "
                                   f"({await describe(orch, job_id)})") from None
            finally:
                self.waiting.pop((job_id, state), None)
        reached = self.at[job_id]
        if state not in reached:
            raise RuntimeError(f"job {job_id[:12]} went {sorted(set(reached) & set(self.BAD))}, not {state} "
                               f"({await describe(orch, job_id)})")
        return reached[state]


async def describe(orch: Orchestrator, job_id: str) -> str:
    t = models.training_jobs
    async with orch.journal.read() as conn:
        row = (await conn.execute(sa.select(t.c.state, t.c.detail, t.c.ambiguity).where(t.c.id == job_id))).first()
    return "no row" if row is None else f"{row.state}: {row.detail or row.ambiguity}"


def settings(url: str) -> Settings:
    """config.example.yaml's defaults, but quiet and with a short shutdown grace."""
    return Settings.model_validate({"journal": {"url": url}, "orchestrator": {"shutdown_grace_s": 2},
                                    "logging": {"level": "WARNING"}})


async def start(orch: Orchestrator) -> None:
    await orch.start()
    for _ in range(400):
        if orch.is_leader and orch.working():
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the orchestrator did not lead")


async def submit(orch: Orchestrator, deployment: str, job: dict[str, Any]) -> str:
    async with orch.journal.write() as tx:
        sub = await submit_job(tx, deployment, job)
    if sub.disposition != "new":
        raise RuntimeError(f"job {sub.job_id[:12]} was not new ({sub.disposition})")
    return sub.job_id


def call(ranks: Any, method: str, *args: Any, timeout: float = 120.0) -> Any:
    """A trainer call as the controller makes it: ``executor.rpc`` in a worker thread."""
    return asyncio.to_thread(ranks.rpc, 0, method, args, None, timeout)


# -- 1. training steps --------------------------------------------------------------------------

async def peer_step(ranks: Any, directory: Path, salt: int) -> float:
    job = payload(salt)
    job_id = job_identity(job)
    path = str(directory / f"{job_id}.ckpt")
    started = time.perf_counter()
    await call(ranks, "health")
    await call(ranks, "train", {**job, "job_id": job_id}, timeout=3600)
    await call(ranks, "save_checkpoint", path, job_id)
    info = await call(ranks, "verify_checkpoint", path)
    finished = time.perf_counter()
    if info.get("job_id") != job_id:
        raise RuntimeError(f"peer: checkpoint {path} carries {info.get('job_id')!r}")
    return finished - started


async def steps(backend: str, tmp: Path, n: int) -> dict[str, Any]:
    ours: list[dict[str, float]] = []
    theirs: list[float] = []
    calls: dict[str, Counter[str]] = {"tidelog": Counter(), "peer": Counter()}
    async with Database(backend, tmp, "tidelog_training") as url:
        ours_ranks = RecordingRanks(trainer(tmp / f"steps-{backend}-trainer"))
        peer_ranks = RecordingRanks(trainer(tmp / f"steps-{backend}-peer-trainer"))
        peer_dir = tmp / f"steps-{backend}-peer-checkpoints"
        peer_dir.mkdir()
        controller = TrainingController(ours_ranks, TrainingSettings(str(tmp / f"steps-{backend}-checkpoints"),
                                                                     retry_after_s=1.0))
        orch = Orchestrator(settings(url), controllers=[controller], unbuilt=["discovery"])
        stamps = Stamps()
        orch.journal.add_commit_listener(stamps)
        try:
            await start(orch)
            for i in range(n + 1):  # job 0 warms both sides up and is not timed
                peer_s = await peer_step(peer_ranks, peer_dir, 1_000_000 + i)
                job = payload(i)
                started = time.perf_counter()
                job_id = await submit(orch, f"steps-{i}", job)  # no engines: each job stays CHECKPOINT
                done = await stamps.until(orch, job_id, "CHECKPOINT")
                running = stamps.at[job_id]["RUNNING"]
                ours_calls, peer_calls = ours_ranks.take(), peer_ranks.take()
                if i == 0:
                    continue
                calls["tidelog"].update(ours_calls)
                calls["peer"].update(peer_calls)
                theirs.append(peer_s)
                ours.append({"total": done - started, "submit": running - started, "train": done - running})
        finally:
            await orch.stop()
            for r in (ours_ranks, peer_ranks):
                r.inner.shutdown()
    mine = {k: statistics.median(o[k] for o in ours) for k in ("total", "submit", "train")}
    peer = statistics.median(theirs)
    overhead = mine["total"] - peer
    out: dict[str, Any] = {
           "jobs": n, "tidelog_ms": ms(mine["total"]), "peer_ms": ms(peer), "overhead_ms": ms(overhead),
           "ratio_vs_peer": round(mine["total"] / peer, 2), "target_ms": STEP_TARGET_MS,
           "pass": overhead * 1000 <= STEP_TARGET_MS,
           "tidelog_p90_ms": ms(quantile([o["total"] for o in ours], 0.9)),
           "peer_p90_ms": ms(quantile(theirs, 0.9)),
           "submit_commit_ms": ms(mine["submit"]), "running_to_checkpoint_ms": ms(mine["train"]),
           "trainer_calls_per_job": {side: {m: c / n for m, c in sorted(cnt.items())} for side, cnt in calls.items()}}
    print(f"[{backend}] training step, median of {n}: tidelog {out['tidelog_ms']:.1f} ms (submit commit "
          f"{out['submit_commit_ms']:.1f}, RUNNING -> CHECKPOINT {out['running_to_checkpoint_ms']:.1f}); peer "
          f"{out['peer_ms']:.1f} ms; overhead {out['overhead_ms']:.1f} ms (target <= {STEP_TARGET_MS:g} ms: "
          f"{'PASS' if out['pass'] else 'FAIL'}); ratio {out['ratio_vs_peer']:.2f}x", flush=True)
    differ(backend, "trainer calls per step", out["trainer_calls_per_job"])
    return out


# -- 2. publication -----------------------------------------------------------------------------

async def each(engines: Sequence[SGLangEngine], fn: Any, gathered: bool) -> list[Any]:
    if gathered:
        return list(await asyncio.gather(*(fn(e) for e in engines)))
    return [await fn(e) for e in engines]


async def peer_publish(ranks: Any, engines: Sequence[SGLangEngine], directory: Path, version: str,
                       gathered: bool = False) -> dict[str, float]:
    """The publication's calls in the publisher's order, without a journal."""
    path = str(directory / version)
    t0 = time.perf_counter()
    await each(engines, lambda e: e.pause_generation(PAUSE_MODE), gathered)
    t1 = time.perf_counter()
    health = await call(ranks, "health")
    assert health.get("last_job_id")  # the peer's latest step is its job: no load_checkpoint (as for Tidelog's)
    await call(ranks, "prepare_weights", {"version": version, "directory": path})
    await each(engines, lambda e: e.update_weights_from_disk(path, version), gathered)
    served = await each(engines, lambda e: e.weight_version(), gathered)
    if any(v != version for v in served):
        raise RuntimeError(f"peer: engines serve {sorted(set(map(str, served)))}, not {version}")
    t2 = time.perf_counter()
    served = await each(engines, lambda e: e.weight_version(), gathered)
    if any(v != version for v in served):
        raise RuntimeError(f"peer: engines serve {sorted(set(map(str, served)))}, not {version}")
    await each(engines, lambda e: e.continue_generation(), gathered)
    t3 = time.perf_counter()
    return {"total": t3 - t0, "pause": t1 - t0, "transfer": t2 - t1, "resume": t3 - t2}


async def publication(backend: str, tmp: Path, n: int, urls: Sequence[str]) -> dict[str, Any]:
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    sequential: list[float] = []
    calls: dict[str, Counter[str]] = {"tidelog": Counter(), "peer": Counter()}
    requests: dict[str, Counter[str]] = {"tidelog": Counter(), "peer": Counter()}
    ours_engines = [CountingEngine(SGLangConfig(url=u)) for u in urls]
    peer_engines = [CountingEngine(SGLangConfig(url=u)) for u in urls]
    async with Database(backend, tmp, "tidelog_training") as url:
        ours_ranks = RecordingRanks(trainer(tmp / f"pub-{backend}-trainer"))
        peer_ranks = RecordingRanks(trainer(tmp / f"pub-{backend}-peer-trainer"))
        peer_ckpts, peer_weights = tmp / f"pub-{backend}-peer-checkpoints", tmp / f"pub-{backend}-peer-weights"
        peer_ckpts.mkdir()
        peer_weights.mkdir()
        controller = TrainingController(
            ours_ranks, TrainingSettings(str(tmp / f"pub-{backend}-checkpoints"), retry_after_s=1.0),
            publication=(ours_engines, PublicationSettings("bench", str(tmp / f"pub-{backend}-weights"),
                                                           pause_mode=PAUSE_MODE)))
        orch = Orchestrator(settings(url), controllers=[controller], unbuilt=["discovery"])
        stamps = Stamps()
        orch.journal.add_commit_listener(stamps)
        try:
            await start(orch)
            for i in range(n + 1):  # job 0 (the deployment's first publication) is not timed
                await peer_step(peer_ranks, peer_ckpts, 2_000_000 + i)  # untimed: the peer's job
                peer_ranks.take()
                take_requests(peer_engines)
                peer = await peer_publish(peer_ranks, peer_engines, peer_weights, f"peer-{i}", gathered=True)
                peer_calls, peer_requests = peer_ranks.take(), take_requests(peer_engines)
                one_by_one = await peer_publish(peer_ranks, peer_engines, peer_weights, f"peer-{i}-sequential")
                peer_ranks.take()
                take_requests(peer_engines)
                job_id = await submit(orch, "bench", payload(3_000_000 + i))
                checkpoint = await stamps.until(orch, job_id, "CHECKPOINT")
                complete = await stamps.until(orch, job_id, "COMPLETE")
                at = stamps.at[job_id]
                ours_calls, ours_requests = ours_ranks.take(), take_requests(ours_engines)
                if i == 0:
                    continue
                if stamps.retries:
                    raise RuntimeError(f"a publication step was retried ({dict(stamps.retries)}): the figures "
                                       f"would time the retry delay")
                # The trainer calls that trained the job (up to its CHECKPOINT) are not the publication's.
                ours_calls = ours_calls[ours_calls.index("verify_checkpoint") + 1:]
                calls["tidelog"].update(ours_calls)
                calls["peer"].update(peer_calls)
                requests["tidelog"].update(ours_requests)
                requests["peer"].update(peer_requests)
                theirs.append(peer)
                sequential.append(one_by_one["total"])
                ours.append({"total": complete - checkpoint,
                             "pause": at["UPDATING_WEIGHTS"] - checkpoint,
                             "transfer": at["READY_TO_COMMIT"] - at["UPDATING_WEIGHTS"],
                             "head_commit": at["HEAD_COMMITTED"] - at["READY_TO_COMMIT"],
                             "resume": complete - at["HEAD_COMMITTED"]})
        finally:
            await orch.stop()
            for r in (ours_ranks, peer_ranks):
                r.inner.shutdown()
            for e in [*ours_engines, *peer_engines]:
                await e.close()
    mine = {k: statistics.median(o[k] for o in ours) for k in ours[0]}
    peer_med = {k: statistics.median(t[k] for t in theirs) for k in theirs[0]}
    overhead = mine["total"] - peer_med["total"]
    out: dict[str, Any] = {
           "jobs": n, "engines": len(urls), "tidelog_ms": ms(mine["total"]), "peer_ms": ms(peer_med["total"]),
           "overhead_ms": ms(overhead), "ratio_vs_peer": round(mine["total"] / peer_med["total"], 2),
           "target_ms": PUBLICATION_TARGET_MS, "pass": overhead * 1000 <= PUBLICATION_TARGET_MS,
           "tidelog_p90_ms": ms(quantile([o["total"] for o in ours], 0.9)),
           "peer_p90_ms": ms(quantile([t["total"] for t in theirs], 0.9)),
           "peer_sequential_ms": ms(statistics.median(sequential)),
           "tidelog_phases_ms": {
               "checkpoint_to_updating_weights": ms(mine["pause"]),
               "updating_weights_to_ready_to_commit": ms(mine["transfer"]),
               "ready_to_commit_to_head_committed": ms(mine["head_commit"]),
               "head_committed_to_complete": ms(mine["resume"])},
           "peer_phases_ms": {"pause": ms(peer_med["pause"]), "transfer": ms(peer_med["transfer"]),
                              "resume": ms(peer_med["resume"])},
           # Tidelog's phase minus the peer's (medians, so they need not sum to the overhead).
           "phase_overhead_ms": {"pause_and_target": ms(mine["pause"] - peer_med["pause"]),
                                 "transfer": ms(mine["transfer"] - peer_med["transfer"]),
                                 "head_commit": ms(mine["head_commit"]),
                                 "resume": ms(mine["resume"] - peer_med["resume"])},
           "trainer_calls_per_job": {side: {m: c / n for m, c in sorted(cnt.items())} for side, cnt in calls.items()},
           "engine_requests_per_job": {side: {r: c / n for r, c in sorted(cnt.items())}
                                       for side, cnt in requests.items()}}
    ph, pp = out["tidelog_phases_ms"], out["peer_phases_ms"]
    print(f"[{backend}] publication to {len(urls)} engines, median of {n}: tidelog {out['tidelog_ms']:.1f} ms "
          f"(pause + target {ph['checkpoint_to_updating_weights']:.1f}, transfer "
          f"{ph['updating_weights_to_ready_to_commit']:.1f}, head commit "
          f"{ph['ready_to_commit_to_head_committed']:.1f}, resume {ph['head_committed_to_complete']:.1f}); peer "
          f"{out['peer_ms']:.1f} ms (pause {pp['pause']:.1f}, "
          f"transfer {pp['transfer']:.1f}, resume {pp['resume']:.1f}); overhead {out['overhead_ms']:.1f} ms "
          f"(target <= {PUBLICATION_TARGET_MS:g} ms: {'PASS' if out['pass'] else 'FAIL'}); ratio "
          f"{out['ratio_vs_peer']:.2f}x; peer with the engines called one by one {out['peer_sequential_ms']:.1f} ms",
          flush=True)
    differ(backend, "trainer calls per publication", out["trainer_calls_per_job"])
    differ(backend, "engine requests per publication", out["engine_requests_per_job"])
    return out


def differ(backend: str, what: str, sides: dict[str, dict[str, float]]) -> None:
    if sides["tidelog"] != sides["peer"]:
        print(f"[{backend}] NOTE: {what} differ: tidelog {sides['tidelog']}, peer {sides['peer']}", flush=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the run ------------------------------------------------------------------------------------

async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": f"{platform.machine()} {os.cpu_count()} cpu",
                               "python": platform.python_version(), "steps": args.steps,
                               "publications": args.publications, "engines": args.engines}
    with tempfile.TemporaryDirectory(prefix="tidelog-training-") as raw:
        tmp = Path(raw)
        initial = tmp / "initial"
        save_weights(Policy(seed=0), initial, "initial")
        fleet = EngineFleet(tmp, args.engines, initial)
        try:
            started = time.perf_counter()
            urls = await asyncio.to_thread(fleet.start) if args.publications else []
            if urls:
                print(f"{len(urls)} reference engines up in {time.perf_counter() - started:.1f} s", flush=True)
            for backend in args.backends:
                figures[backend] = {}
                if args.steps:
                    figures[backend]["steps"] = await steps(backend, tmp, args.steps)
                if args.publications:
                    figures[backend]["publication"] = await publication(backend, tmp, args.publications, urls)
        finally:
            fleet.stop()
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None,
                   help="comma-separated: sqlite,postgresql (default both; --quick: sqlite)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps per backend (default 100)")
    p.add_argument("--publications", type=int, default=None, help="timed publications per backend (default 50)")
    p.add_argument("--engines", type=int, default=8, help="reference inference engines")
    p.add_argument("--quick", action="store_true", help="SQLite only, 5 steps and 3 publications")
    args = p.parse_args()
    backends = args.backends or ("sqlite" if args.quick else "sqlite,postgresql")
    args.backends = [b.strip() for b in backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in ("sqlite", "postgresql")]
    if bad or not args.backends:
        p.error(f"--backends: {bad or backends!r}: choose from sqlite, postgresql")
    if args.steps is None:
        args.steps = 5 if args.quick else 100
    if args.publications is None:
        args.publications = 3 if args.quick else 50
    if args.steps < 0 or args.publications < 0 or args.engines < 1:
        p.error("--steps and --publications must be >= 0, --engines >= 1")
    figures = asyncio.run(run(args))
    figures["args"] = vars(args)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
