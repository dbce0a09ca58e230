"""The commit gate (engine/workflows/training/commit_gate.py), driven step by step: the training
controller's reconcile is called on a journal Context whose clock is virtual, so a timeout is crossed
by ``advance`` and nothing waits on the wall clock. Real parts: a torch trainer (uni executor), two
reference engines on loopback (started on ``initial``), the journal on both backends.

- ``acknowledge``: a candidate stays READY_TO_COMMIT with every engine paused until an operator's
  verdict is recorded; then its head is committed; a second acknowledgement or one of another state
  is refused; an operator's reject meanwhile wins without a race.
- the acknowledgement timeout, counted from ``ready_at`` on the orchestrator's clock: ``reject``
  rejects it (the incumbent served again), ``hold`` keeps it waiting and says so once.
- ``evaluate``: the evaluator's reject leaves the incumbent served with its reason and metrics on the
  job; one that fails is said in detail and asked again; it is given the candidate's and the
  incumbent's checkpoints and weights; a malformed reply is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, load
from engine.runtime.clock import VirtualClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.reconciler import Context
from engine.workflows.training import (JobClosed, JobNotFound, JobStateRefused, VerdictRecorded, acknowledge_job,
                                      reject_job, submit_job)
from engine.workflows.training.commit_gate import CommitGateSettings, Evaluator, EvaluatorReplyError, check_reply
from engine.workflows.training.controller import TrainingController, TrainingSettings
from engine.workflows.training.publication import PublicationSettings
from engine.workflows.training.wiring import build_training
from journal import Journal, audit, lease
from tests.engine.workflows.training.test_publication_gate import Rig
from tests.support.training import payload
from tests.workers.inference.engines import EngineProc
from workers.executor import Executor
from workers.inference import SGLangConfig, SGLangEngine

pytestmark = pytest.mark.slow


class GateRig(Rig):
    """The publication rig with a commit gate, the engines' start-up weights restorable, a virtual clock."""

    def __init__(self, gate: CommitGateSettings, initial: Path, *args: Any) -> None:
        super().__init__(*args)
        journal, tmp_path = args[0], args[-1]
        journal.remove_commit_listener(self.controller.on_commit)
        self.controller = TrainingController(
            self.executor, TrainingSettings(str(tmp_path / "checkpoints"), retry_after_s=0),
            (self.engines, PublicationSettings("dep", str(tmp_path / "weights"), retry_after_s=0,
                                               initial_weights=str(initial), gate=gate)))
        journal.add_commit_listener(self.controller.on_commit)
        self.clock = VirtualClock()
        self.ctx = Context(journal, self.committer, self.clock)

    async def ready(self, salt: int) -> dict[str, Any]:
        job_id = await self.submit(salt)
        return await self.drive(job_id, "READY_TO_COMMIT")

    async def look(self, job_id: str) -> float | None:
        """One reconcile; how soon it asked to look again."""
        return (await self.controller.reconcile(self.ctx, job_id)).requeue_after

    async def operator(self, fn: Any, job_id: str, reason: str) -> None:
        async with self.journal.write() as tx:
            await fn(tx, job_id, reason=reason)


async def first_head(make_rig: Any) -> dict[str, Any]:
    """Publish job 0 with an ``auto`` gate: a rejection later has a head with a checkpoint to put the
    trainer back on (the rig's trainer is handed in, so it cannot be replaced by a fresh one)."""
    first = make_rig(CommitGateSettings(mode="auto"))
    row: dict[str, Any] = await first.drive(await first.submit(0), "COMPLETE")
    return row


@pytest.fixture
async def make_rig(journal: Journal, executor: Executor, engine_procs: list[EngineProc], initial_dir: Path,
                   tmp_path: Path) -> AsyncIterator[Any]:
    made: list[GateRig] = []
    held = await lease.acquire(journal, "orchestrator", "test-rig", 600)
    assert held is not None

    def make(gate: CommitGateSettings) -> GateRig:
        engines = [SGLangEngine(SGLangConfig(p.url, timeout=10, weight_update_timeout=30)) for p in engine_procs]
        r = GateRig(gate, initial_dir, journal, held.fence(), executor, engines, engine_procs, tmp_path)
        made.append(r)
        return r
    try:
        yield make
    finally:
        for r in made:
            journal.remove_commit_listener(r.controller.on_commit)
            await r.committer.close()
            for e in r.engines:
                await e.close()


async def test_acknowledge_holds_the_candidate_paused_until_the_operator_says_commit(make_rig: Any) -> None:
    rig = make_rig(CommitGateSettings(mode="acknowledge"))
    job_id = await rig.submit(1)
    await rig.drive(job_id, "CHECKPOINT")
    with pytest.raises(JobStateRefused):  # only a READY_TO_COMMIT candidate is acknowledged
        await rig.operator(acknowledge_job, job_id, "too early")
    with pytest.raises(JobNotFound):
        await rig.operator(acknowledge_job, "f" * 64, "no such job")
    row = await rig.drive(job_id, "READY_TO_COMMIT")
    candidate = row["runtime_load_id"]
    assert row["ready_at"] == rig.clock.now() and row["verdict"] is None
    for _ in range(3):
        assert await rig.look(row["id"]) is None  # nothing to time: the acknowledgement wakes it
        await rig.clock.advance(3600)
    assert (await rig.row(row["id"]))["state"] == "READY_TO_COMMIT"
    assert await rig.served() == [candidate, candidate] and await rig.paused() == [True, True]
    await rig.operator(acknowledge_job, row["id"], "eval suite green")
    with pytest.raises(VerdictRecorded):
        await rig.operator(acknowledge_job, row["id"], "twice")
    done = await rig.drive(row["id"], "COMPLETE")
    assert done["verdict"]["decision"] == "commit" and done["verdict"]["by"] == "operator"
    assert done["verdict"]["reason"] == "eval suite green"
    assert await rig.served() == [candidate, candidate] and await rig.paused() == [False, False]
    assert await audit.verify(rig.journal) == []


async def test_an_operators_reject_wins_over_a_waiting_candidate(make_rig: Any) -> None:
    head = await first_head(make_rig)
    rig = make_rig(CommitGateSettings(mode="acknowledge"))
    row = await rig.ready(1)
    await rig.operator(reject_job, row["id"], "regressed on the held-out set")
    with pytest.raises(JobStateRefused):
        await rig.operator(acknowledge_job, row["id"], "too late")
    done = await rig.drive(row["id"], "REJECTED")
    assert done["verdict"]["decision"] == "reject" and done["verdict"]["by"] == "operator"
    incumbent = head["runtime_load_id"]
    assert await rig.served() == [incumbent, incumbent] and await rig.paused() == [False, False]
    # The same batch again is refused (docs/training.md: a decision); with another field it is a new job.
    with pytest.raises(JobClosed) as closed:
        async with rig.journal.write() as tx:
            await submit_job(tx, "dep", payload(1))
    assert closed.value.state == "REJECTED" and '"retry": 2' in str(closed.value)
    async with rig.journal.write() as tx:
        again = await submit_job(tx, "dep", {**payload(1), "retry": 2})
    assert again.disposition == "new" and again.job_id != row["id"]


async def test_no_acknowledgement_within_the_timeout_rejects_on_the_orchestrators_clock(make_rig: Any) -> None:
    head = await first_head(make_rig)
    rig = make_rig(CommitGateSettings(mode="acknowledge", acknowledge_timeout_s=600, on_acknowledge_timeout="reject"))
    row = await rig.ready(1)
    assert await rig.look(row["id"]) == pytest.approx(600)
    await rig.clock.advance(599)
    assert await rig.look(row["id"]) == pytest.approx(1)
    assert (await rig.row(row["id"]))["state"] == "READY_TO_COMMIT" and await rig.paused() == [True, True]
    await rig.clock.advance(2)
    await rig.look(row["id"])
    done = await rig.drive(row["id"], "REJECTED")
    assert done["verdict"]["by"] == "timeout" and "acknowledge_timeout_s=600" in done["verdict"]["reason"]
    assert await rig.served() == [head["runtime_load_id"]] * 2 and await rig.paused() == [False, False]
    assert (await rig.versions())[row["runtime_load_id"]][0] == "rejected"


async def test_hold_keeps_waiting_past_the_timeout_and_says_so_once(make_rig: Any) -> None:
    rig = make_rig(CommitGateSettings(mode="acknowledge", acknowledge_timeout_s=60, on_acknowledge_timeout="hold"))
    row = await rig.ready(1)
    await rig.clock.advance(61)
    assert await rig.look(row["id"]) is None
    held = await rig.row(row["id"])
    assert held["state"] == "READY_TO_COMMIT" and "held for an operator" in held["detail"]
    await rig.clock.advance(3600)  # later looks say nothing new: no other event is written
    assert await rig.look(row["id"]) is None and (await rig.row(row["id"]))["version"] == held["version"]
    assert await rig.paused() == [True, True]
    await rig.operator(acknowledge_job, row["id"], "late but fine")
    assert (await rig.drive(row["id"], "COMPLETE"))["verdict"]["by"] == "operator"


async def test_an_evaluator_that_rejects_leaves_the_incumbent_served_and_its_reason_on_the_job(
        make_rig: Any, tmp_path: Path) -> None:
    log = tmp_path / "eval.jsonl"
    head = await first_head(make_rig)
    rig = make_rig(CommitGateSettings(mode="evaluate", evaluator=Evaluator(
        "tests.support.evaluators:reject_all", {"why": "reward fell 12%", "log": str(log)})))
    job_id = await rig.submit(1)
    done = await rig.drive(job_id, "REJECTED")
    verdict = done["verdict"]
    assert (verdict["decision"], verdict["by"], verdict["reason"]) == ("reject", "evaluator", "reward fell 12%")
    assert verdict["metrics"] == {"eval_reward": 0.25, "episodes": 8}
    assert await rig.served() == [head["runtime_load_id"]] * 2 and await rig.paused() == [False, False]
    [seen] = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen["candidate"]["checkpoint_path"] == done["checkpoint_path"]
    assert seen["candidate"]["load_id"] == done["runtime_load_id"] and Path(seen["candidate"]["weights_path"]).is_dir()
    assert seen["incumbent"]["job_id"] == head["id"] and seen["incumbent"]["checkpoint_path"] == head["checkpoint_path"]
    assert seen["incumbent"]["load_id"] == head["runtime_load_id"]


async def test_a_failed_evaluation_is_said_and_asked_again(make_rig: Any, tmp_path: Path) -> None:
    log = tmp_path / "eval.jsonl"
    rig = make_rig(CommitGateSettings(mode="evaluate", evaluator=Evaluator(
        "tests.support.evaluators:CommitAfterAFailure", {"log": str(log)})))
    row = await rig.ready(2)
    await rig.look(row["id"])
    failed = await rig.row(row["id"])
    assert failed["state"] == "READY_TO_COMMIT" and "evaluation cluster unreachable" in failed["detail"]
    assert await rig.paused() == [True, True]
    done = await rig.drive(row["id"], "COMPLETE")
    assert done["verdict"]["by"] == "evaluator" and done["verdict"]["metrics"] == {"candidate_step": 1}
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    # The incumbent is the weights the engines started with: no job, no checkpoint, their directory.
    assert len(seen) == 2 and seen[1]["incumbent"]["job_id"] is None
    assert seen[1]["incumbent"]["checkpoint_path"] is None and seen[1]["incumbent"]["weights_path"]


async def test_a_late_evaluation_is_waited_for_on_its_own_thread_not_asked_twice(make_rig: Any,
                                                                                  tmp_path: Path) -> None:
    log = tmp_path / "eval.jsonl"
    evaluator = Evaluator("tests.support.evaluators:slow", {"seconds": 1.0, "log": str(log)})
    rig = make_rig(CommitGateSettings(mode="evaluate", evaluator=evaluator, evaluate_timeout_s=0.1))
    row = await rig.ready(1)
    await rig.look(row["id"])
    late = await rig.row(row["id"])
    assert late["state"] == "READY_TO_COMMIT" and "did not reply within 0.1 s" in late["detail"]
    # Looks while it still runs wait for the same evaluation; once it replies, its verdict is taken.
    done = await rig.drive(row["id"], "COMPLETE", steps=200)
    assert done["verdict"]["by"] == "evaluator" and done["verdict"]["reason"] == "slow but sure"
    assert len(log.read_text().splitlines()) == 1  # asked once


async def test_a_malformed_evaluator_reply_is_said_by_name(make_rig: Any) -> None:
    rig = make_rig(CommitGateSettings(mode="evaluate", evaluator=Evaluator("tests.support.evaluators:malformed")))
    row = await rig.ready(1)
    await rig.look(row["id"])
    said = await rig.row(row["id"])
    assert said["state"] == "READY_TO_COMMIT" and "decision" in said["detail"] and "'ship it'" in said["detail"]


@pytest.mark.parametrize(("reply", "field"), [
    ({"decision": "commit"}, "reason"),
    ({"decision": "commit", "reason": " "}, "reason"),
    ({"decision": "maybe", "reason": "x"}, "decision"),
    ({"decision": "commit", "reason": "x", "metrics": {"r": float("nan")}}, "metrics"),
    ({"decision": "commit", "reason": "x", "metrics": [1]}, "metrics"),
    ({"decision": "commit", "reason": "x", "score": 1}, "score"),
    (["commit"], "(reply)"),
])
def test_an_evaluator_reply_is_checked_field_by_field(reply: Any, field: str) -> None:
    with pytest.raises(EvaluatorReplyError) as err:
        check_reply(reply)
    assert err.value.field == field


def test_a_good_reply_keeps_its_metrics() -> None:
    assert check_reply({"decision": "reject", "reason": "worse", "metrics": {"a": [1, 2.5]}}) == {
        "decision": "reject", "reason": "worse", "metrics": {"a": [1, 2.5]}}


@pytest.mark.parametrize(("training", "said"), [
    ("  commit: evaluate\n", "needs training.evaluator.callable"),
    ("  evaluator: {callable: 'tests.support.evaluators:reject_all'}\n", "training.commit is 'auto'"),
    ("  commit: auto\n  acknowledge_timeout_s: 60\n", "applies only to 'acknowledge'"),
    ("  commit: evaluate\n  evaluator: {callable: 'gone_pkg.evals:judge'}\n", "gone_pkg.evals"),
    ("  commit: acknowledge\n  on_acknowledge_timeout: shrug\n", "on_acknowledge_timeout"),
    ("  commit: sometimes\n", "training.commit"),
])
def test_gate_settings_of_another_mode_are_refused_not_ignored(tmp_path: Path, training: str, said: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n" + training)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert said in str(err.value), str(err.value)


def test_the_gate_settings_reach_the_publisher(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  commit: evaluate\n  evaluator:\n    callable: 'tests.support.evaluators:reject_all'\n"
                    "    kwargs: {why: nope}\n    timeout_s: 30\n  publish_retry_after_s: 3\n"
                    "  engines: [{name: e0, url: 'http://127.0.0.1:9'}]\n")
    gate = build_training(load(path)).controller.publisher.gate.settings  # type: ignore[union-attr]
    assert (gate.mode, gate.evaluate_timeout_s, gate.retry_after_s) == ("evaluate", 30, 3)
    assert gate.evaluator is not None and gate.evaluator.path == "tests.support.evaluators:reject_all"
    assert gate.evaluator({"job_id": "j"}, None)["reason"] == "nope"
