"""Crash points of the training and publication workflows (issue 6): kill a part at every named
point, bring it back, and check that nothing was trained twice or served uncommitted.

Every run is ``python -m tests.support.training_worker``, forked from a zygote that has imported its
modules once (``tests.support.zygote``: a second and a half of CPU saved per process; the process
is as real as a fresh one: its own pid, SIGKILLed and reaped): a real orchestrator (built from its
configuration with ``training.enabled``: an ``mp`` trainer process, two real reference inference
engines) training two jobs on a fresh journal and a fresh working directory. The engines are
processes that live through the runs, put back on their initial weights before each one; runs go
two at a time (``LANES``), each on its own pair of engines. On a two-core machine the orchestrator
drill takes about five minutes per backend alone and six in the full suite (its 47 trainer
processes, 5.6 s of CPU each to import torch, are most of it); the module's other drills about two.

- Orchestrator: an uncrashed run on each backend tells which hooks of ``training_jobs``,
  ``weight_versions`` and ``engines`` a run passes through (enumerated from the machines with
  ``engine.runtime.crash.hook_names``, not picked by hand); then, for every one of them — and for the
  second passing of each ``training_jobs`` and ``weight_versions`` hook (``NAME@2``: the second
  job's commit, when the trainer holds the first job's step) — on SQLite and on PostgreSQL alike,
  a run with ``TIDELOG_CRASH_AT`` set is SIGKILLed right after that commit (its trainer process
  goes with it) and a second run without it must finish. A hook must fire, except the gate's
  ``engines`` self-edges and pauses (``TIMING``), which depend on when a resync lands (such a run
  is still checked, as an uncrashed one); an engine's ``registered->serving`` (``RACY``), which a
  loaded machine can turn into ``registered->paused``, is run again until it fires (three tries).
- Trainer: the trainer process SIGKILLs itself (``tests.support.faulty_trainer``) at
  ``train:before``, ``train:after``, ``save_checkpoint:after`` and ``prepare_weights:before``, of
  the first job and of the second (whose fresh trainer must first load the first job's
  checkpoint); the orchestrator lives and must finish on a fresh trainer process. SQLite only:
  the journal is not what differs between these runs.
- Engine: one engine SIGKILLs itself (the reference engine's test-only ``/_test/die_next``) on the
  first publication's ``/pause_generation``, ``/update_weights_from_disk`` and
  ``/continue_generation``, before acting; the harness restarts it on the same port on its initial
  weights, and the orchestrator's retries and the engine gate must bring it to the committed head.
  SQLite only.

Invariants after every run, from the journal, the trainer's files and the engines:

- both jobs ``COMPLETE``; no job entered ``CHECKPOINT`` twice; every ``AMBIGUOUS -> RUNNING`` was
  settled on evidence (its reason starts ``settled:``) or by an operator;
- no optimizer step applied twice: the trainer's persisted step record (``step.json``) says step 2
  = the number of jobs kept (``CHECKPOINT`` or later), each job's checkpoint holds step k for the
  k-th job, and the last checkpoint's and the served weights' tensors equal the uncrashed run's
  bit for bit (the trainer is deterministic on the CPU);
- every engine serves the last job's ``runtime_load_id`` (the committed head); in its
  ``/_test/history`` since the run started, every ``continue`` was on a version the journal had
  committed before that moment (or on ``initial``, its start-up label, before anything was
  labelled or loaded, in a process that was there before the run: an engine restarted mid-run
  must not resume on it), no weights were loaded or relabelled while it generated, and it is not
  left paused. A killed engine's history dies with it; its replacement's is checked;
- every weight version is committed (none left ``target`` or ``loaded``);
- ``journal.audit.verify`` is clean.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.runtime.crash import ENV, hook_names
from journal import Journal, audit, machines, models
from tests.engine.runtime.test_crash_recovery import new_journal_url
from tests.support.backends import only_sqlite
from tests.support.databases import migrate, sqlite_url
from tests.support.training import payload
from tests.support.training_worker import ENGINE_DIE_ENV, PAYLOADS, TRAINER_DIE_ENV
from tests.support.zygote import Zygote, shared
from tests.workers.inference.engines import EngineProc
from workers.policy import Policy, load_weights, save_weights
from workers.trainer.checkpoint import read_checkpoint
from workers.trainer.steps import read_step_record

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[4]
N = 2
KINDS = ["training_jobs", "weight_versions", "engines"]
KEPT = ("CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT", "HEAD_COMMITTED", "COMPLETE")
#: Hooks whose passing depends on when the engine gate's resync lands, not on the workflow.
TIMING = ("engines:serving->serving", "engines:serving->paused", "engines:paused->paused",
          "engines:paused->serving", "engines:registered->paused")
#: Hooks that fire in nearly every run but not all: an engine's first probe lands before the first
#: publication pauses it (``registered->serving``), or, on a loaded machine, after (then
#: ``registered->paused`` fires instead). Such a point is run again until it fires, at most
#: ``RACY_TRIES`` times in all; every run is checked in full.
RACY = ("engines:registered->serving",)
RACY_TRIES = 3
#: Runs go this many at a time, each on its own pair of engines: a run mostly waits (for a lease to
#: lapse, a retry, a resync), so two share this machine's two cores well.
LANES = 2
#: Kinds whose hooks are also crashed at their second passing (the second job's commit).
SECOND = ("training_jobs:", "weight_versions:")
#: A safety net per worker process (a run takes seconds), not a measure; beyond the worker's own
#: deadline (``training_worker.DEADLINE_S``), so a slow run reports what it saw rather than being
#: killed silently.
WORKER_TIMEOUT_S = 360
TRAINER_POINTS = ["train:before", "train:after", "save_checkpoint:after", "prepare_weights:before",
                  "train:before@2", "train:after@2", "save_checkpoint:after@2", "prepare_weights:before@2"]
ENGINE_PHASES = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
#: The uncrashed run's digests (the same payloads on a deterministic trainer give the same weights
#: whatever the backend): the first suite to run one records them, the others compare against them.
CLEAN_DIGESTS: dict[str, tuple[str, str]] = {}


# -- the engines: real processes, put back on their initial weights before each run ----------------

@dataclass
class Engine:
    proc: EngineProc
    port: int
    #: Where this run's history starts in the live process, and whether that process predates the run.
    offset: int = 0
    original: bool = True
    restarts: int = 0


@dataclass
class Engines:
    initial: Path
    logs: Path
    items: list[Engine] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{e.port}" for e in self.items]

    def start(self, count: int) -> None:
        for i in range(count):
            proc = EngineProc(["--port", "0", "--model-dir", str(self.initial), "--enable-test-faults"],
                              self.logs / f"engine-{i}.log").start()
            self.items.append(Engine(proc, int(proc.url.rsplit(":", 1)[1])))

    def restart_dead(self) -> list[int]:
        """Start again (same port, initial weights) every engine whose process has exited."""
        restarted = []
        for i, e in enumerate(self.items):
            assert e.proc.proc is not None
            if e.proc.proc.poll() is not None:
                e.proc = EngineProc(["--port", str(e.port), "--model-dir", str(self.initial), "--enable-test-faults"],
                                    e.proc.log).start()
                e.offset, e.original = 0, False
                e.restarts += 1
                restarted.append(i)
        return restarted

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Back on the initial weights as ``initial``, generating; this run's history starts here."""
        await asyncio.to_thread(self.restart_dead)
        for url, e in zip(self.urls, self.items):
            for path, body in (("/update_weights_from_disk", {"model_path": str(self.initial),
                                                             "weight_version": "initial"}),
                               ("/continue_generation", {})):
                async with http.post(url + path, json=body) as resp:
                    assert resp.status == 200, (path, await resp.text())
            e.offset, e.original = len(await history(http, url)), True

    def kill_all(self) -> None:
        for e in self.items:
            e.proc.kill()


async def history(http: aiohttp.ClientSession, url: str) -> list[tuple[str, str, float]]:
    """The engine process's pauses, continues, loads and labels: (event, version after, Unix time)."""
    async with http.get(url + "/_test/history") as resp:
        assert resp.status == 200, await resp.text()
        return [(event, version, at) for event, version, at in (await resp.json())["history"]]


async def served(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/get_weight_version") as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["weight_version"])


@pytest.fixture(scope="module")
def lanes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``LANES`` pairs of reference engines (processes), started together; runs go two at a time."""
    root = tmp_path_factory.mktemp("crash-engines")
    save_weights(Policy(seed=0), root / "initial", "initial")
    pairs = [Engines(root / "initial", root / f"lane-{n}") for n in range(LANES)]
    try:
        with ThreadPoolExecutor(LANES) as pool:
            for pair in pairs:
                pair.logs.mkdir()
            list(pool.map(lambda pair: pair.start(2), pairs))
        yield pairs
    finally:
        for pair in pairs:
            pair.kill_all()


@pytest.fixture(scope="module")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite journal, copied for each run (cheaper than migrating each one)."""
    path = tmp_path_factory.mktemp("crash-journal") / "template.db"
    migrate(sqlite_url(path))
    return path


async def fresh_journal(backend: str, request: pytest.FixtureRequest, path: Path) -> str:
    """A fresh journal at the head revision for one run (PostgreSQL: skipped, or failed with
    ``TIDELOG_TEST_REQUIRE_POSTGRES=1``, when no server answers)."""
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{template}{suffix}").exists():
                shutil.copyfile(f"{template}{suffix}", f"{path}{suffix}")
        return sqlite_url(path)
    request.getfixturevalue("pg_admin_url")  # skips (or fails) the test when no server answers
    return await new_journal_url(backend, request, path)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


# -- one run ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    codes: list[int]
    edges: Counter[str]  # hook name -> how many commits passed through it
    digests: tuple[str, str]  # the last checkpoint's model tensors, the served head's tensors
    seconds: float


async def run_worker(zygote: Zygote, url: str, workdir: Path, engines: Engines, env_extra: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, TRAINER_DIE_ENV, ENGINE_DIE_ENV)}
    env.update(env_extra)
    stamp = time.monotonic_ns()
    out, err = workdir / f"worker-{stamp}.out", workdir / f"worker-{stamp}.log"
    code = await zygote.run("tests.support.training_worker",
                            [url, str(workdir), str(N), str(engines.initial), *engines.urls],
                            env=env, cwd=ROOT, stdout=out, stderr=err, timeout=WORKER_TIMEOUT_S)
    if code not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {code} ({env_extra}):\n{err.read_text()[-4000:]}")
    return code


async def watch_engines(engines: Engines, stop: asyncio.Event) -> None:
    """Restart an engine that died, on its port and initial weights, until ``stop``."""
    while not stop.is_set():
        await asyncio.to_thread(engines.restart_dead)
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except TimeoutError:
            pass


async def one_run(backend: str, request: pytest.FixtureRequest, tmp_path: Path, engines: Engines,
                  http: aiohttp.ClientSession, tag: str, env_extra: dict[str, str], *,
                  restart: bool) -> Outcome:
    """A worker with ``env_extra``; then (``restart``, after a SIGKILL) one without; then every check."""
    started = time.monotonic()
    restarts = [e.restarts for e in engines.items]
    url = await fresh_journal(backend, request, tmp_path / f"{tag}.db")
    workdir = tmp_path / tag
    workdir.mkdir()
    (workdir / PAYLOADS).write_text(json.dumps([payload(salt) for salt in range(N)]))
    await engines.reset(http)
    zygote = shared()
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_engines(engines, stop))
    try:
        codes = [await run_worker(zygote, url, workdir, engines, env_extra)]
        if codes[-1] != 0 and restart:
            codes.append(await run_worker(zygote, url, workdir, engines, {}))
    finally:
        stop.set()
        await watcher
    if [e.restarts for e in engines.items] != restarts:
        (workdir / "engine-died").write_text("restarted during this run\n")
    assert codes[-1] == 0, (tag, codes)
    edges, digests = await check_invariants(url, workdir, engines, http, tag)
    return Outcome(codes, edges, digests, time.monotonic() - started)


def tensors_digest(state: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        flat = tensor.detach().to("cpu").contiguous().clone()
        digest.update(f"{name}:{flat.dtype}:{tuple(flat.shape)}".encode())
        digest.update(bytes(flat.untyped_storage()))
    return digest.hexdigest()


def gate_problems(seen: list[tuple[str, str, float]], committed_at: dict[str, datetime],
                  original: bool) -> list[str]:
    """What in one engine process's history breaks the commit gate: generation continued on a
    version not committed (in the journal) before it, or weights loaded or relabelled while
    generating, or the engine left paused. ``initial`` (its start-up label) may be continued only
    before anything was loaded or labelled, by a process that predates the run (the harness put
    it back on its initial weights)."""
    problems: list[str] = []
    paused = touched = False  # a process starts generating; the harness resumed the others
    for event, version, at in seen:
        when = datetime.fromtimestamp(at, timezone.utc)
        if event == "pause":
            paused = True
        elif event == "continue":
            paused = False
            if version == "initial":
                if touched or not original:
                    problems.append(f"continued on its start-up label at {when}")
            elif version not in committed_at or committed_at[version] > when:
                problems.append(f"continued on {version} at {when}, committed {committed_at.get(version)}")
        else:
            touched = True
            if not paused:
                problems.append(f"{event} of {version} at {when} while generating")
    if paused:
        problems.append("left paused")
    return problems


async def check_invariants(url: str, workdir: Path, engines: Engines, http: aiohttp.ClientSession,
                           tag: str) -> tuple[Counter[str], tuple[str, str]]:
    journal = Journal.open(url)
    try:
        j, v, e = models.training_jobs, models.weight_versions, models.events
        async with journal.read() as conn:
            jobs = (await conn.execute(sa.select(j).order_by(j.c.scenario_step))).all()
            versions = (await conn.execute(sa.select(v))).all()
            events = (await conn.execute(sa.select(e.c.entity_kind, e.c.entity_id, e.c.from_state, e.c.to_state,
                                                   e.c.reason, e.c.ts).where(e.c.entity_kind.in_(KINDS))
                                         .order_by(e.c.seq))).all()
            head = (await conn.execute(sa.select(v.c.id).where(v.c.state == "committed")
                                       .order_by(v.c.sequence.desc()).limit(1))).scalar()
        assert await audit.verify(journal) == [], tag
    finally:
        await journal.dispose()
    committed = {r.id: r for r in versions if r.state == "committed"}
    assert len(committed) == len(versions) == N + 1, (tag, [(r.id, r.state) for r in versions])
    # Every job COMPLETE, each entered CHECKPOINT once (a failed pause's CHECKPOINT self-edge is not an
    # entry), every ambiguity settled on evidence.
    assert [r.state for r in jobs] == ["COMPLETE"] * N, (tag, [(r.state, r.detail, r.ambiguity) for r in jobs])
    ids = [r.id for r in jobs]
    for job_id in ids:
        into = [ev for ev in events if ev.entity_id == job_id and ev.to_state == "CHECKPOINT"
                and ev.from_state != "CHECKPOINT"]
        assert len(into) == 1, (tag, job_id[:12], [(ev.from_state, ev.reason) for ev in into])
    for ev in events:
        if ev.entity_kind == "training_jobs" and (ev.from_state, ev.to_state) == ("AMBIGUOUS", "RUNNING"):
            assert ev.reason.startswith(("settled:", "resolved by an operator")), (tag, ev.reason)
    # No optimizer step applied twice: one step per kept job, in order, in the durable record too.
    record = read_step_record(workdir / "trainer")
    kept = sum(1 for r in jobs if r.state in KEPT)
    assert record is not None and record.step == kept == N, (tag, record)
    for k, r in enumerate(jobs, start=1):
        assert Path(r.checkpoint_path).name == f"{r.id}.ckpt", (tag, r.checkpoint_path)
        info, state = read_checkpoint(r.checkpoint_path)
        assert (info.job_id, info.step) == (r.id, k), (tag, info)
    _, last_state = read_checkpoint(jobs[-1].checkpoint_path)
    # Every engine serves the last job's version, the committed head.
    last = jobs[-1].runtime_load_id
    assert last == head and last in committed, (tag, last, head)
    head_weights, meta = load_weights(committed[head].weights_path)
    assert meta["version"] == head
    committed_at = {ev.entity_id: ev.ts for ev in events
                    if ev.entity_kind == "weight_versions" and ev.to_state == "committed"}
    for i, url_i in enumerate(engines.urls):
        assert await served(http, url_i) == last, (tag, i)
        engine = engines.items[i]
        seen = (await history(http, url_i))[engine.offset:]
        problems = gate_problems(seen, committed_at, engine.original)
        assert not problems, (tag, f"engine {i}", problems, seen)
    edges = Counter(f"{k}:created:{b}" if a is None else f"{k}:{a}->{b}" for k, _, a, b, _, _ in events)
    return edges, (tensors_digest(last_state["model"]), tensors_digest(head_weights))


# -- the suites -------------------------------------------------------------------------------------

@dataclass
class Spec:
    name: str
    tag: str
    env: dict[str, str]
    restart: bool


async def run_all(backend: str, request: pytest.FixtureRequest, tmp_path: Path, lanes: list[Engines],
                  http: aiohttp.ClientSession, specs: list[Spec]) -> dict[str, Outcome]:
    """Every spec's run, ``LANES`` at a time (each lane on its engines); the first failure stops all."""
    pending = list(specs)
    outcomes: dict[str, Outcome] = {}

    async def lane(engines: Engines) -> None:
        while pending:
            spec = pending.pop(0)
            outcomes[spec.name] = await one_run(backend, request, tmp_path, engines, http, spec.tag, spec.env,
                                                restart=spec.restart)

    tasks = [asyncio.create_task(lane(engines)) for engines in lanes]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {spec.name: outcomes[spec.name] for spec in specs}


def report(label: str, started: float, outcomes: dict[str, Outcome]) -> None:
    print(f"\n{label}: {len(outcomes)} runs in {time.monotonic() - started:.1f} s ({LANES} at a time)")
    for name, o in outcomes.items():
        print(f"  {name}: codes {o.codes}, {o.seconds:.1f} s")


async def clean_digests(backend: str, request: pytest.FixtureRequest, tmp_path: Path, lanes: list[Engines],
                        http: aiohttp.ClientSession, outcomes: dict[str, Outcome]) -> tuple[str, str]:
    """The uncrashed run's digests: recorded by an earlier suite of this module, or from a run now."""
    if "clean" not in CLEAN_DIGESTS:
        clean = await one_run(backend, request, tmp_path, lanes[0], http, "clean", {}, restart=False)
        assert clean.codes == [0]
        outcomes["clean"] = clean
        CLEAN_DIGESTS["clean"] = clean.digests
    return CLEAN_DIGESTS["clean"]


async def test_every_orchestrator_crash_point_recovers(backend: str, request: pytest.FixtureRequest,
                                                        tmp_path: Path, lanes: list[Engines],
                                                        http: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    clean = await one_run(backend, request, tmp_path, lanes[0], http, "clean", {}, restart=False)
    assert clean.codes == [0]
    assert CLEAN_DIGESTS.setdefault("clean", clean.digests) == clean.digests, "the uncrashed runs differ"
    every = hook_names([machines.TRAINING_JOBS, machines.WEIGHT_VERSIONS, machines.ENGINES])
    points = [h for h in every if h in clean.edges]
    happy = {"training_jobs:created:RUNNING", "training_jobs:RUNNING->CHECKPOINT",
             "training_jobs:CHECKPOINT->UPDATING_WEIGHTS", "training_jobs:UPDATING_WEIGHTS->READY_TO_COMMIT",
             "training_jobs:READY_TO_COMMIT->HEAD_COMMITTED", "training_jobs:HEAD_COMMITTED->COMPLETE",
             "weight_versions:created:committed", "weight_versions:created:target",
             "weight_versions:target->loaded", "weight_versions:loaded->committed",
             "engines:created:registered", "engines:registered->serving"}
    assert happy <= set(points), sorted(happy - set(points))
    # The second job's commits too (the trainer then holds the first job's step): ``NAME@2``.
    points += [f"{h}@2" for h in points if h.startswith(SECOND) and clean.edges[h] >= 2]
    outcomes = await run_all(backend, request, tmp_path, lanes, http,
                             [Spec(point, f"t{n}", {ENV: point}, True) for n, point in enumerate(points)])
    for n, point in enumerate(points):
        for again in range(1, RACY_TRIES):
            if point not in RACY or outcomes[point].codes != [0]:
                break
            assert outcomes[point].digests == clean.digests, f"{point}: the weights differ from the uncrashed run's"
            outcomes.update(await run_all(backend, request, tmp_path, lanes, http,
                                          [Spec(point, f"t{n}-again{again}", {ENV: point}, True)]))
    report(f"orchestrator crash points ({backend})", started, {"clean": clean, **outcomes})
    for point, outcome in outcomes.items():
        if point not in TIMING:
            assert outcome.codes == [-signal.SIGKILL, 0], f"{point}: the hook did not fire ({outcome.codes})"
        assert outcome.digests == clean.digests, f"{point}: the weights differ from the uncrashed run's"


@only_sqlite
async def test_a_trainer_killed_at_each_point_is_replaced_and_nothing_trains_twice(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path, lanes: list[Engines],
        http: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    digests = await clean_digests(backend, request, tmp_path, lanes, http, outcomes)
    outcomes.update(await run_all(backend, request, tmp_path, lanes, http, [
        Spec(point, f"k{n}", {TRAINER_DIE_ENV: point}, False) for n, point in enumerate(TRAINER_POINTS)]))
    report("trainer kills (sqlite)", started, outcomes)
    for n, point in enumerate(TRAINER_POINTS):
        assert (tmp_path / f"k{n}" / "trainer-died").exists(), f"{point}: the trainer did not die"
        assert outcomes[point].codes == [0], (point, outcomes[point].codes)
        assert outcomes[point].digests == digests, f"{point}: the weights differ from the uncrashed run's"


@only_sqlite
async def test_an_engine_killed_at_each_publication_phase_is_brought_to_the_head(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path, lanes: list[Engines],
        http: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    digests = await clean_digests(backend, request, tmp_path, lanes, http, outcomes)
    before = sum(engines.items[1].restarts for engines in lanes)
    outcomes.update(await run_all(backend, request, tmp_path, lanes, http, [
        Spec(phase, f"d{n}", {ENGINE_DIE_ENV: f"1:{phase}"}, False) for n, phase in enumerate(ENGINE_PHASES)]))
    report("engine kills (sqlite)", started, outcomes)
    for n, phase in enumerate(ENGINE_PHASES):
        assert (tmp_path / f"d{n}" / "engine-died").exists(), f"{phase}: the engine did not die"
        assert outcomes[phase].codes == [0], (phase, outcomes[phase].codes)
        assert outcomes[phase].digests == digests, f"{phase}: the weights differ from the uncrashed run's"
    assert sum(engines.items[1].restarts for engines in lanes) == before + len(ENGINE_PHASES)
