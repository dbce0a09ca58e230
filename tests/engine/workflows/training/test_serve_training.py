"""The training half as ``tidelog serve`` builds it from the ``training`` configuration: the trainer
host (an executor built again after its trainer process dies), the engine gate at start-up, and the
configuration's refusals. Both journal backends; real torch trainers, real reference engines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from engine.config import ConfigError, Settings, load
from engine.workflows.training.engine_gate import EngineGateController, GateSettings, engine_id, sync_engines
from engine.runtime.service import Orchestrator
from engine.workflows.training import reject_job, resolve_job, submit_job
from engine.workflows.training.trainer_host import TrainerHost, TrainerRestartPending, TrainerUnavailable
from engine.runtime.clock import VirtualClock
from engine.runtime.restarts import RestartPolicy
from journal import Journal, models
from tests.support.pid_worker import PidWorker
from tests.support.training import job_row, payload, submit, until_state, versions
from tests.workers.inference.engines import EngineProc
from workers.executor import Executor, ExecutorConfig, WorkerSpec
from workers.inference.sglang import SGLangConfig, SGLangEngine
from workers.policy import Policy, save_weights
from workers.trainer.worker import Trainer


def training_settings(url: str, tmp: Path, engines: list[EngineProc], initial: Path,
                      executor: str = "uni") -> Settings:
    return Settings.model_validate({
        "journal": {"url": url},
        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1, "shutdown_grace_s": 1},
        "reconciler": {"resync_interval_s": 1},
        "logging": {"level": "WARNING"},
        "training": {"enabled": True, "executor": executor, "deployment": "dep",
                     "trainer": {"state_dir": str(tmp / "trainer")},
                     "checkpoint_dir": str(tmp / "checkpoints"), "weights_dir": str(tmp / "weights"),
                     "initial_weights": str(initial), "retry_after_s": 0.2, "publish_retry_after_s": 0.2,
                     "engines": [{"name": f"e{i}", "url": p.url} for i, p in enumerate(engines)]}})


async def leading(orch: Orchestrator) -> Orchestrator:
    await orch.start()
    for _ in range(200):
        if orch.is_leader and orch.working():
            return orch
        await asyncio.sleep(0.05)
    raise AssertionError("the orchestrator did not lead")


async def serving(settings: Settings, started: list[Orchestrator]) -> Orchestrator:
    """An orchestrator built from ``settings`` (training included), leading; stopped by the fixture."""
    orch = Orchestrator(settings, unbuilt=["discovery"])
    started.append(orch)
    return await leading(orch)


async def engine_rows(journal: Journal) -> dict[str, dict[str, Any]]:
    t = models.engines
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(t))).all()}


async def until_engines(journal: Journal, state: str, version: str | None, timeout: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rows = await engine_rows(journal)
        if rows and all(r["state"] == state and r["serving_version"] == version for r in rows.values()):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engines are {[(r['id'], r['state'], r['serving_version']) for r in rows.values()]}"
                                 f", not all {state} on {version}")
        await asyncio.sleep(0.05)


async def engine_events(journal: Journal, epoch: int) -> dict[str, list[tuple[str | None, str]]]:
    """Each engine row's transitions (from, to) made under lease epoch ``epoch``, in order."""
    e = models.events
    out: dict[str, list[tuple[str | None, str]]] = {}
    async with journal.read() as conn:
        for r in (await conn.execute(sa.select(e.c.entity_id, e.c.from_state, e.c.to_state).where(
                e.c.entity_kind == "engines", e.c.epoch == epoch).order_by(e.c.seq))).all():
            out.setdefault(r.entity_id, []).append((r.from_state, r.to_state))
    return out


async def until_verified(journal: Journal, epoch: int, state: str, version: str | None,
                         timeout: float = 120) -> None:
    """Wait until every engine row is ``state`` on ``version`` *as the gate found it under epoch
    ``epoch``*: the row was made ``unverified`` at that election and the gate moved it on since. A
    row still saying what an earlier leader recorded does not count, whatever it says."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rows = await engine_rows(journal)
        events = await engine_events(journal, epoch)

        def verified(r: dict[str, Any]) -> bool:
            moves = events.get(r["id"], [])
            looked = [i for i, (_, to) in enumerate(moves) if to == "unverified"]
            return (r["state"] == state and r["serving_version"] == version and bool(looked)
                    and moves[-1][1] == state and looked[-1] < len(moves) - 1)
        if rows and all(verified(r) for r in rows.values()):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engines are {[(r['id'], r['state'], r['serving_version']) for r in rows.values()]}"
                                 f" (epoch {epoch} moves {events}), not all verified {state} on {version}")
        await asyncio.sleep(0.05)


def adapters(procs: list[EngineProc]) -> list[SGLangEngine]:
    return [SGLangEngine(SGLangConfig(url=p.url, timeout=10)) for p in procs]


async def paused(engine: SGLangEngine) -> bool:
    """Whether the engine holds generation paused (its server info's internal state)."""
    return bool((await engine.server_info())["internal_states"][0]["paused"])


@pytest.fixture
async def orchestrators() -> AsyncIterator[list[Orchestrator]]:
    started: list[Orchestrator] = []
    try:
        yield started
    finally:
        for orch in started:
            if not orch.stopped.is_set():
                await orch.stop()


# -- configuration ------------------------------------------------------------------------------------

def test_training_enabled_without_engines_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  enabled: true\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert "training" in str(err.value) and "at least one engine" in str(err.value)


def test_engine_names_must_be_unique_and_urls_plain(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  engines:\n  - {name: a, url: 'http://h:1'}\n  - {name: a, url: 'http://h:2'}\n")
    with pytest.raises(ConfigError, match="engine name 'a' appears twice"):
        load(path)
    path.write_text("training:\n  engines:\n  - {name: a, url: 'http://u:secret@h:1'}\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert "must not carry credentials" in str(err.value) and "secret" not in str(err.value)


# -- serve: the whole loop, and the gate at start-up ----------------------------------------------------

async def test_serve_trains_publishes_and_records_every_engine(journal_url: str, tmp_path: Path,
                                                              engine_procs: list[EngineProc], initial_dir: Path,
                                                              orchestrators: list[Orchestrator]) -> None:
    orch = await serving(training_settings(journal_url, tmp_path, engine_procs, initial_dir), orchestrators)
    job_id = await submit(orch.journal, payload(), deployment="dep")
    row = await until_state(orch.journal, job_id, "COMPLETE")
    head = row["runtime_load_id"]
    await until_engines(orch.journal, "serving", head)
    for engine in adapters(engine_procs):
        try:
            assert await engine.weight_version() == head and not await paused(engine)
        finally:
            await engine.close()
    # The first publication registered the engines' start-up weights, restorable from disk.
    t = models.weight_versions
    async with orch.journal.read() as conn:
        first = (await conn.execute(sa.select(t).where(t.c.sequence == 0))).one()
    assert first.state == "committed" and first.weights_path == str(initial_dir)


async def test_start_up_puts_an_engine_back_on_the_committed_head(journal_url: str, tmp_path: Path,
                                                                 engine_procs: list[EngineProc], initial_dir: Path,
                                                                 orchestrators: list[Orchestrator]) -> None:
    settings = training_settings(journal_url, tmp_path, engine_procs, initial_dir)
    orch = await serving(settings, orchestrators)
    job_id = await submit(orch.journal, payload(), deployment="dep")
    head = (await until_state(orch.journal, job_id, "COMPLETE"))["runtime_load_id"]
    await orch.stop()
    # While no orchestrator runs, engine 1 is put on other weights and left paused (as an engine
    # restarted on its start-up weights, or one a crashed operator script touched).
    rogue = tmp_path / "rogue"
    save_weights(Policy(seed=5), rogue, "rogue")
    e1 = adapters(engine_procs)[1]
    try:
        await e1.pause_generation("retract")
        await e1.update_weights_from_disk(str(rogue), "rogue")
        assert await e1.weight_version() == "rogue" and await paused(e1)
        again = Orchestrator(settings, unbuilt=["discovery"])
        orchestrators.append(again)
        await leading(again)
        # The rows said ``serving`` on the head before the stop: only a look by this leader counts.
        assert again.leader.epoch is not None
        await until_verified(again.journal, again.leader.epoch, "serving", head)
        assert await e1.weight_version() == head and not await paused(e1)  # loaded the head, then resumed
        assert await e1.health()
    finally:
        await e1.close()


async def test_after_a_restart_no_engine_row_claims_a_version_until_the_gate_looked(
        journal_url: str, tmp_path: Path, engine_procs: list[EngineProc], initial_dir: Path,
        orchestrators: list[Orchestrator]) -> None:
    """Issue 13, defect 12: rows from before a restart said ``serving`` on the head while engine 1
    had been given other weights meanwhile. The election now makes every live row ``unverified``
    (claiming no version) in the write that syncs them, and only the gate's look moves it on."""
    settings = training_settings(journal_url, tmp_path, engine_procs, initial_dir)
    orch = await serving(settings, orchestrators)
    first_epoch = orch.leader.epoch
    job_id = await submit(orch.journal, payload(), deployment="dep")
    head = (await until_state(orch.journal, job_id, "COMPLETE"))["runtime_load_id"]
    await until_engines(orch.journal, "serving", head)
    await orch.stop()
    rogue = tmp_path / "rogue"
    save_weights(Policy(seed=5), rogue, "rogue")
    e1 = adapters(engine_procs)[1]
    try:
        await e1.pause_generation("retract")
        await e1.update_weights_from_disk(str(rogue), "rogue")
        again = Orchestrator(settings, unbuilt=["discovery"])
        orchestrators.append(again)
        assert again.handle("training") is not None
        # Hold the gate off (it never looks while the publisher's lock is taken): what the rows say
        # right after the election committed is what the election wrote, nothing the gate saw.
        gate_lock = again.handle("training").gate.lock
        await gate_lock.acquire()
        try:
            await leading(again)
            epoch = again.leader.epoch
            assert epoch is not None and first_epoch is not None and epoch > first_epoch
            rows = await engine_rows(again.journal)
            assert sorted(rows) == ["dep/e0", "dep/e1"]
            for r in rows.values():
                assert (r["state"], r["serving_version"], r["health"]) == ("unverified", None, None), r
                assert f"serving {head}" in r["detail"], r["detail"]  # what the earlier leader recorded
            # The election's write is each row's first (and, so far, only) move under the new epoch.
            assert await engine_events(again.journal, epoch) == {
                "dep/e0": [("serving", "unverified")], "dep/e1": [("serving", "unverified")]}
            # No reader may take e1 for serving the head: it serves the rogue weights, paused.
            assert await e1.weight_version() == "rogue" and await paused(e1)
        finally:
            gate_lock.release()
        # Once the gate looked: serving on the head again, e1 for real (it loaded the head).
        await until_verified(again.journal, epoch, "serving", head)
        for moves in (await engine_events(again.journal, epoch)).values():
            assert moves[0] == ("serving", "unverified") and moves[-1][1] == "serving", moves
        assert await e1.weight_version() == head and not await paused(e1)
    finally:
        await e1.close()


async def test_an_uncommitted_candidate_keeps_every_engine_paused(journal_url: str, tmp_path: Path,
                                                                 engine_procs: list[EngineProc],
                                                                 orchestrators: list[Orchestrator]) -> None:
    """The gate alone (no training controller): a job held in UPDATING_WEIGHTS, as a crash leaves it."""
    journal = Journal.open(journal_url)
    try:
        async with journal.write() as tx:
            job = await submit_job(tx, "dep", payload())
            await tx.transition("training_jobs", job.job_id, from_state="RUNNING", version=job.row.version,
                                to_state="CHECKPOINT", reason="test: trained", changes={"checkpoint_path": "x"})
            await tx.transition("training_jobs", job.job_id, from_state="CHECKPOINT", version=job.row.version + 1,
                                to_state="UPDATING_WEIGHTS", reason="test: candidate on its way",
                                changes={"target_load_id": "abc:1"})
            await sync_engines(tx, "dep", {f"e{i}": p.url for i, p in enumerate(engine_procs)})
    finally:
        await journal.dispose()
    engines = adapters(engine_procs)
    gate = EngineGateController({engine_id("dep", f"e{i}"): e for i, e in enumerate(engines)},
                                GateSettings("dep", retry_after_s=0.2),
                                asyncio.Lock())
    settings = Settings.model_validate({"journal": {"url": journal_url}, "logging": {"level": "WARNING"},
                                        "orchestrator": {"lease_ttl_s": 5, "lease_renew_s": 1,
                                                         "shutdown_grace_s": 1},
                                        "reconciler": {"resync_interval_s": 1}})
    orch = Orchestrator(settings, controllers=[gate], unbuilt=["discovery"])
    orchestrators.append(orch)
    try:
        await leading(orch)
        for _ in range(200):
            rows = await engine_rows(orch.journal)
            if all(r["state"] == "paused" for r in rows.values()):
                break
            await asyncio.sleep(0.05)
        assert all(r["state"] == "paused" and r["paused"] and "held paused" in r["detail"] for r in rows.values())
        assert [await paused(e) for e in engines] == [True, True]
        await asyncio.sleep(1.5)  # a resync later: still paused
        assert [await paused(e) for e in engines] == [True, True]
    finally:
        for e in engines:
            await e.close()


# -- the trainer host ----------------------------------------------------------------------------------

def _trainer_executor(state_dir: Path) -> Executor:
    return Executor.create(ExecutorConfig(backend="mp", workers=(
        WorkerSpec(Trainer, kwargs={"seed": 0, "state_dir": str(state_dir)}),)))


def _pid_executor() -> Executor:
    return Executor.create(ExecutorConfig(backend="mp", workers=(WorkerSpec(PidWorker),)))


def _kill(host: TrainerHost) -> int:
    """SIGKILL the host's trainer process and wait until a call meets the failure; returns its pid."""
    pid = int(host.rpc(0, "health")["pid"])
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception):  # noqa: B017 - whichever failure the call meets first
        for _ in range(200):
            host.rpc(0, "health", timeout=5)
            time.sleep(0.05)
    return pid


async def test_a_trainer_that_keeps_failing_is_restarted_within_the_policy_then_not_again() -> None:
    clock = VirtualClock()
    policy = RestartPolicy(3, 300.0, (1.0, 2.0, 4.0), setting="training.recovery")
    host = TrainerHost(_pid_executor, policy, clock)
    try:
        assert host.ensure() is True  # the first start is no restart
        for n, delay in enumerate((1.0, 2.0, 4.0), start=1):
            _kill(host)
            assert host.unready() is not None and "is being started again" in str(host.unready())
            # The n-th restart waits its delay on the orchestrator's clock; asking sooner says when.
            with pytest.raises(TrainerRestartPending,
                               match=rf"restart {n} of at most 3 within 300 s in {delay:.1f} s") as pending:
                host.ensure()
            assert pending.value.delay_s == delay
            await clock.advance(delay - 0.5)
            with pytest.raises(TrainerRestartPending, match=r"in 0\.5 s") as pending:
                host.ensure()
            assert pending.value.delay_s == 0.5
            assert host.generation == n and "is being started again" in str(host.unready())
            await clock.advance(0.5)
            assert host.ensure() is True and host.generation == n + 1 and host.unready() is None
        # A release is this orchestrator's decision (a lost lease, say), not a failure: not counted.
        host.release("lease lost")
        assert host.ensure() is True and host.generation == 5
        # The fourth failure within five minutes: not started again, and every later ask says why.
        _kill(host)
        with pytest.raises(TrainerUnavailable, match=r"exceeded 3 restarts within 300 s \(training.recovery\)"):
            host.ensure()
        assert host.gave_up is not None and "it is not started again" in host.gave_up
        assert host.unready() == host.gave_up
        await clock.advance(3600)
        with pytest.raises(TrainerUnavailable, match="it is not started again"):
            host.ensure()
        assert host.generation == 5
    finally:
        host.shutdown()


async def test_the_trainer_restart_window_slides_on_the_clock() -> None:
    clock = VirtualClock()
    host = TrainerHost(_pid_executor, RestartPolicy(1, 300.0, (0.0,), setting="training.recovery"), clock)
    try:
        assert host.ensure() is True
        _kill(host)
        assert host.ensure() is True  # the one restart the window allows, at once (delay 0)
        await clock.advance(300.5)  # that restart has left the window
        _kill(host)
        assert host.ensure() is True and host.generation == 3 and host.gave_up is None
    finally:
        host.shutdown()


async def test_past_training_recovery_jobs_wait_with_the_reason_and_readiness_is_absent(
        journal_url: str, tmp_path: Path, engine_procs: list[EngineProc], initial_dir: Path,
        orchestrators: list[Orchestrator]) -> None:
    """Through serve, the real clock and a real mp trainer: one restart is allowed (after 0.2 s); the
    second failure stops the trainer for good: the next job waits RUNNING with the reason in its row,
    untrained, and /readyz's reason (Orchestrator.not_ready) says it."""
    settings = training_settings(journal_url, tmp_path, engine_procs, initial_dir, executor="mp")
    settings = settings.model_copy(update={"training": settings.training.model_copy(update={
        "recovery": settings.training.recovery.model_copy(update={"max_restarts": 1, "delays_s": [0.2]})})})
    orch = await serving(settings, orchestrators)
    parts = orch.handle("training")
    assert parts is not None
    first = await submit(orch.journal, payload(0), deployment="dep")
    await until_state(orch.journal, first, "COMPLETE")
    assert await orch.not_ready() is None
    os.kill((await asyncio.to_thread(parts.host.rpc, 0, "health"))["pid"], signal.SIGKILL)
    second = await submit(orch.journal, payload(1), deployment="dep")
    row = await until_state(orch.journal, second, "COMPLETE", "AMBIGUOUS")
    if row["state"] == "AMBIGUOUS":  # the dead executor met train itself: settled from evidence
        row = await until_state(orch.journal, second, "COMPLETE")
    assert parts.host.generation == 2 and row["metrics"]["step"] == 2  # the one restart, on the checkpoint
    os.kill((await asyncio.to_thread(parts.host.rpc, 0, "health"))["pid"], signal.SIGKILL)
    third = await submit(orch.journal, payload(2), deployment="dep")
    for _ in range(600):
        row = await job_row(orch.journal, third)
        if row["detail"] and "training.recovery" in row["detail"]:
            break
        await asyncio.sleep(0.05)
    assert row["state"] == "RUNNING" and "exceeded 1 restart within 300 s (training.recovery)" in row["detail"], row
    why = await orch.not_ready()
    assert why is not None and "it is not started again" in why, why
    await asyncio.sleep(1.0)  # several retries later: still waiting, the reason written once
    assert (await job_row(orch.journal, third))["state"] == "RUNNING" and parts.host.generation == 2
    e = models.events
    async with orch.journal.read() as conn:
        trail = (await conn.execute(sa.select(e.c.reason, e.c.payload).where(e.c.entity_id == third))).all()
    said = [t for t in trail if "training.recovery" in f"{t.reason} {t.payload}"]
    assert len(said) == 1, trail


def test_the_host_starts_a_fresh_trainer_only_when_asked(tmp_path: Path) -> None:
    host = TrainerHost(lambda: _trainer_executor(tmp_path / "trainer"))
    try:
        with pytest.raises(TrainerUnavailable, match="not started"):
            host.rpc(0, "health")
        assert host.ensure() is True and host.ensure() is False and host.generation == 1
        first = host.rpc(0, "health")
        os.kill(first["pid"], signal.SIGKILL)
        # Calls to the dead trainer fail (the executor's own failure, then TrainerUnavailable); none
        # starts another one behind the caller's back.
        with pytest.raises(Exception):  # noqa: B017 - whichever failure the call meets first
            for _ in range(200):
                host.rpc(0, "health", timeout=5)
                time.sleep(0.05)
        with pytest.raises(TrainerUnavailable):
            host.rpc(0, "health")
        assert host.generation == 1
        assert host.ensure() is True
        second = host.rpc(0, "health")
        assert host.generation == 2 and second["pid"] != first["pid"] and second["step"] == 0
        # A leader that lost its lease releases its trainer: the process stops; a sync point starts another.
        host.release()
        with pytest.raises(TrainerUnavailable):
            host.rpc(0, "health")
        with pytest.raises(ProcessLookupError):
            os.kill(second["pid"], 0)
        assert host.ensure() is True and host.rpc(0, "health")["pid"] != second["pid"] and host.generation == 3
    finally:
        host.shutdown()
    with pytest.raises(TrainerUnavailable, match="shut down"):
        host.ensure()


async def test_a_restarted_trainer_continues_from_the_latest_checkpoint(journal_url: str, tmp_path: Path,
                                                                       engine_procs: list[EngineProc],
                                                                       initial_dir: Path,
                                                                       orchestrators: list[Orchestrator]) -> None:
    orch = await serving(training_settings(journal_url, tmp_path, engine_procs, initial_dir, executor="mp"),
                         orchestrators)
    assert orch.handle("training") is not None
    first = await submit(orch.journal, payload(0), deployment="dep")
    await until_state(orch.journal, first, "COMPLETE")
    health = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert health["step"] == 1
    os.kill(health["pid"], signal.SIGKILL)  # the trainer process dies between jobs
    second = await submit(orch.journal, payload(1), deployment="dep")
    row = await until_state(orch.journal, second, "COMPLETE", "AMBIGUOUS")
    if row["state"] == "AMBIGUOUS":  # the dead executor met train itself: settled from evidence
        row = await until_state(orch.journal, second, "COMPLETE")
    after = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert after["pid"] != health["pid"] and orch.handle("training").host.generation >= 2
    assert after["step"] == 2 and after["last_job_id"] == second
    # Bitwise the weights an uninterrupted trainer reaches with the same two steps.
    reference = Trainer(seed=0)
    reference.train({**payload(0), "job_id": first})
    reference.train({**payload(1), "job_id": second})
    digest = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "weights_digest")
    assert digest == reference.weights_digest()
    assert (await job_row(orch.journal, second))["metrics"]["step"] == 2


async def test_a_step_no_kept_job_accounts_for_is_dropped_by_a_fresh_trainer(journal_url: str, tmp_path: Path,
                                                                            engine_procs: list[EngineProc],
                                                                            initial_dir: Path,
                                                                            orchestrators: list[Orchestrator]
                                                                            ) -> None:
    """A job whose step ran but whose checkpoint cannot be written is abandoned by an operator: the
    next job must not train on top of that step (the deployment has no kept step, so the trainer is
    started again and declares its initial weights)."""
    settings = training_settings(journal_url, tmp_path, engine_procs, initial_dir, executor="mp")
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")  # a real fault
    orch = await serving(settings, orchestrators)
    assert orch.handle("training") is not None
    bad = await submit(orch.journal, payload(0), deployment="dep")
    row = await until_state(orch.journal, bad, "AMBIGUOUS")
    held = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert held["last_job_id"] == bad and held["step"] == 1 and "checkpoint failed" in str(row["ambiguity"])
    # As the API does: the controller may rewrite the AMBIGUOUS row (its reason) meanwhile.
    await orch.committer.run_fresh(lambda tx: resolve_job(tx, bad, "abandon",
                                                          reason="its checkpoint cannot be written"))
    (tmp_path / "checkpoints").unlink()
    good = await submit(orch.journal, payload(1), deployment="dep")
    done = await until_state(orch.journal, good, "COMPLETE")
    health = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert health["pid"] != held["pid"] and health["step"] == 1 and done["metrics"]["step"] == 1
    assert done["trainer_step"] == 0
    reference = Trainer(seed=0)
    reference.train({**payload(1), "job_id": good})
    assert await asyncio.to_thread(orch.handle("training").host.rpc, 0, "weights_digest") == reference.weights_digest()


async def test_a_trainer_that_cannot_be_made_ready_is_said_and_train_waits(journal_url: str, tmp_path: Path,
                                                                          engine_procs: list[EngineProc],
                                                                          initial_dir: Path,
                                                                          orchestrators: list[Orchestrator]) -> None:
    orch = await serving(training_settings(journal_url, tmp_path, engine_procs, initial_dir, executor="mp"),
                         orchestrators)
    assert orch.handle("training") is not None
    first = await submit(orch.journal, payload(0), deployment="dep")
    kept = Path((await until_state(orch.journal, first, "COMPLETE"))["checkpoint_path"])
    aside = tmp_path / "aside.ckpt"
    kept.rename(aside)  # the latest checkpoint is gone (a real fault: a volume not mounted)...
    health = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    os.kill(health["pid"], signal.SIGKILL)  # ...and the trainer that held its step dies
    second = await submit(orch.journal, payload(1), deployment="dep")
    for _ in range(400):
        row = await job_row(orch.journal, second)
        if row["detail"]:
            break
        await asyncio.sleep(0.05)
    assert row["state"] == "RUNNING" and "the trainer is not ready" in row["detail"], row
    assert "train not called" in row["detail"]
    aside.rename(kept)  # the volume is back: the fresh trainer loads the step, then trains on it
    done = await until_state(orch.journal, second, "COMPLETE")
    assert done["metrics"]["step"] == 2 and done["trainer_step"] == 1 and done["detail"] is None


async def test_rejecting_a_first_job_puts_back_the_initial_weights_and_a_fresh_trainer(
        journal_url: str, tmp_path: Path, engine_procs: list[EngineProc], initial_dir: Path,
        orchestrators: list[Orchestrator]) -> None:
    settings = training_settings(journal_url, tmp_path, engine_procs, initial_dir, executor="mp")
    # A failed transfer waits a long time before its retry: the job sits in UPDATING_WEIGHTS.
    settings = settings.model_copy(update={"training": settings.training.model_copy(
        update={"publish_retry_after_s": 60.0})})
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{engine_procs[1].url}/_test/fail_next",
                             json={"path": "/update_weights_from_disk", "mode": "error"}) as resp:
            assert resp.status == 200, await resp.text()
    orch = await serving(settings, orchestrators)
    assert orch.handle("training") is not None
    job = await submit(orch.journal, payload(0), deployment="dep")
    for _ in range(400):
        row = await job_row(orch.journal, job)
        if row["state"] == "UPDATING_WEIGHTS" and row["detail"]:
            break
        await asyncio.sleep(0.05)
    assert row["state"] == "UPDATING_WEIGHTS" and "failed" in row["detail"], row
    held = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert held["last_job_id"] == job
    await orch.committer.run_fresh(lambda tx: reject_job(tx, job, reason="its reward looked wrong"))
    await until_state(orch.journal, job, "REJECTED")
    initial = (await versions(orch.journal))
    head = next(v for v, (state, job_id) in initial.items() if state == "committed" and job_id is None)
    for engine in adapters(engine_procs):
        try:
            assert await engine.weight_version() == head and not await paused(engine)
        finally:
            await engine.close()
    fresh = await asyncio.to_thread(orch.handle("training").host.rpc, 0, "health")
    assert fresh["pid"] != held["pid"] and fresh["step"] == 0 and fresh["step_record"]["job_id"] == "initial"
    # The next job trains on the initial weights, not on the rejected step.
    after = await submit(orch.journal, payload(1), deployment="dep")
    done = await until_state(orch.journal, after, "COMPLETE")
    assert done["metrics"]["step"] == 1
    reference = Trainer(seed=0)
    reference.train({**payload(1), "job_id": after})
    assert await asyncio.to_thread(orch.handle("training").host.rpc, 0, "weights_digest") == reference.weights_digest()
    t = models.weight_versions
    async with orch.journal.read() as conn:
        confirmed = (await conn.execute(sa.select(t.c.confirmed_by).where(t.c.id == done["runtime_load_id"]))).scalar()
    assert confirmed == ["dep/e0", "dep/e1"]
