"""Bring your own trainer: a class defined only in the tests (``tests.support.own_trainer.SgdTrainer``),
selected by import path in a YAML file with its keyword arguments and the executor's options, trains
through the orchestrator ``tidelog serve`` builds from that file (``engine.config.load`` then
``Orchestrator``) to ``COMPLETE``: on ``mp`` on both journal backends, with two ``mp`` ranks (every
rank steps, rank 0 answers), and on a real local Ray cluster with Ray actor options. The
configuration's refusals of a bad class, backend or option are typed and name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, Settings, load
from engine.runtime.service import Orchestrator
from engine.workflows.training.wiring import executor_config
from tests.engine.workflows.training.test_executors import ray_runtime  # noqa: F401 - a module fixture
from tests.engine.workflows.training.test_serve_training import (  # noqa: F401 - orchestrators is a fixture
    adapters, orchestrators, serving, until_engines)
from tests.support import own_executor
from tests.support.backends import only_sqlite
from tests.support.training import edges, payload, submit, until_state
from tests.workers.inference.engines import EngineProc
from workers.trainer.steps import read_step_record

OWN = "tests.support.own_trainer:SgdTrainer"
TRAIL = [(None, "RUNNING"), ("RUNNING", "CHECKPOINT"), ("CHECKPOINT", "CHECKPOINT"), ("CHECKPOINT", "UPDATING_WEIGHTS"),
         ("UPDATING_WEIGHTS", "READY_TO_COMMIT"), ("READY_TO_COMMIT", "HEAD_COMMITTED"),
         ("HEAD_COMMITTED", "COMPLETE")]


def write_config(tmp: Path, url: str, engines: list[EngineProc], initial: Path, executor: str) -> Path:
    """A YAML file as a user writes it: their class, its kwargs, the executor block."""
    lines = [
        "journal:", f"  url: '{url}'",
        "orchestrator: {lease_ttl_s: 5, lease_renew_s: 1, shutdown_grace_s: 1}",
        "reconciler: {resync_interval_s: 1}",
        "logging: {level: WARNING}",
        "training:",
        "  enabled: true",
        "  deployment: dep",
        "  trainer:",
        f"    class: '{OWN}'",
        "    kwargs: {lr: 0.2}",
        "    seed: 0",
        f"    state_dir: '{tmp / 'trainer'}'",
        "  executor:", *[f"    {line}" for line in executor.splitlines()],
        f"  checkpoint_dir: '{tmp / 'checkpoints'}'",
        f"  weights_dir: '{tmp / 'weights'}'",
        f"  initial_weights: '{initial}'",
        "  retry_after_s: 0.2",
        "  publish_retry_after_s: 0.2",
        "  engines:", *[f"  - {{name: e{i}, url: '{p.url}'}}" for i, p in enumerate(engines)],
    ]
    path = tmp / "tidelog.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def through_serve(settings: Settings, tmp: Path, engines: list[EngineProc],
                        orchestrators: list[Orchestrator]) -> dict[str, Any]:
    orch = await serving(settings, orchestrators)
    job_id = await submit(orch.journal, payload(7), deployment="dep")
    row = await until_state(orch.journal, job_id, "COMPLETE", "FAILED", "AMBIGUOUS")
    assert row["state"] == "COMPLETE", (row["ambiguity"], row["detail"])
    assert await edges(orch.journal, job_id) == TRAIL
    # The user's trainer took the step: its metrics, and its own step record naming the job.
    assert row["metrics"]["optimizer"] == "sgd" and row["metrics"]["step"] == 1, row["metrics"]
    record = read_step_record(tmp / "trainer")
    assert record is not None and (record.job_id, record.phase, record.step) == (job_id, "applied", 1)
    await until_engines(orch.journal, "serving", row["runtime_load_id"])
    for engine in adapters(engines):
        try:
            assert await engine.weight_version() == row["runtime_load_id"]
        finally:
            await engine.close()
    return row


@pytest.mark.slow
async def test_an_own_trainer_trains_through_serve_on_mp(journal_url: str, tmp_path: Path,
                                                         engine_procs: list[EngineProc], initial_dir: Path,
                                                         orchestrators: list[Orchestrator]) -> None:
    settings = load(write_config(tmp_path, journal_url, engine_procs, initial_dir,
                                 "backend: mp\nlaunch_timeout_s: 120"))
    assert settings.training.trainer.class_ == OWN
    await through_serve(settings, tmp_path, engine_procs, orchestrators)


@pytest.mark.slow
@only_sqlite
async def test_two_mp_ranks_each_take_the_step(journal_url: str, tmp_path: Path, engine_procs: list[EngineProc],
                                               initial_dir: Path, orchestrators: list[Orchestrator]) -> None:
    settings = load(write_config(tmp_path, journal_url, engine_procs, initial_dir,
                                 "backend: mp\nworkers: 2\nlaunch_timeout_s: 120"))
    row = await through_serve(settings, tmp_path, engine_procs, orchestrators)
    # Rank 1 got the group's calls too (declare, train), keeping its own record beside rank 0's.
    other = read_step_record(tmp_path / "trainer" / "rank-1")
    assert other is not None and (other.job_id, other.phase, other.step) == (row["id"], "applied", 1)


@pytest.mark.slow
@only_sqlite
async def test_an_own_trainer_trains_through_serve_on_ray(ray_runtime: Any, journal_url: str,  # noqa: F811
                                                          tmp_path: Path, engine_procs: list[EngineProc],
                                                          initial_dir: Path,
                                                          orchestrators: list[Orchestrator]) -> None:
    settings = load(write_config(tmp_path, journal_url, engine_procs, initial_dir,
                                 "backend: ray\noptions: {num_cpus: 1}\nlaunch_timeout_s: 120"))
    assert settings.training.executor.options == {"num_cpus": 1}
    await through_serve(settings, tmp_path, engine_procs, orchestrators)


@pytest.mark.slow
@only_sqlite
async def test_a_custom_executor_named_by_import_path_runs_the_ranks(journal_url: str, tmp_path: Path,
                                                                    engine_procs: list[EngineProc],
                                                                    initial_dir: Path,
                                                                    orchestrators: list[Orchestrator]) -> None:
    settings = load(write_config(tmp_path, journal_url, engine_procs, initial_dir,
                                 "backend: 'tests.support.own_executor:ThreadRanksExecutor'\n"
                                 "workers: 2\noptions: {label: from-yaml}"))
    before = len(own_executor.LAUNCHES)
    row = await through_serve(settings, tmp_path, engine_procs, orchestrators)
    assert own_executor.LAUNCHES[before:] == [("from-yaml", 2)]
    other = read_step_record(tmp_path / "trainer" / "rank-1")
    assert other is not None and other.job_id == row["id"]


# -- the configuration ----------------------------------------------------------------------------------

def refused(tmp_path: Path, training: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n" + training)
    with pytest.raises(ConfigError) as err:
        load(path)
    return str(err.value)


def test_a_trainer_class_that_cannot_be_found_is_refused_naming_the_key(tmp_path: Path) -> None:
    said = refused(tmp_path, "  trainer: {class: 'no_such_pkg.mod:Trainer'}\n")
    assert "training.trainer.class" in said and "no_such_pkg.mod" in said and "cannot be found" in said
    said = refused(tmp_path, "  trainer: {class: 'workers.trainer.worker.Trainer'}\n")
    assert "training.trainer.class" in said and "package.module:Name" in said


def test_a_shorthand_given_twice_is_refused(tmp_path: Path) -> None:
    said = refused(tmp_path, "  trainer: {seed: 1, kwargs: {seed: 2}}\n")
    assert "kwargs.seed" in said and "training.trainer.seed" in said


def test_executor_options_and_backends_are_checked(tmp_path: Path) -> None:
    said = refused(tmp_path, "  executor: {backend: mp, options: {num_gpus: 1}}\n")
    assert "training.executor" in said and "num_gpus" in said and "backend ray" in said
    said = refused(tmp_path, "  executor: {backend: uni, workers: 2}\n")
    assert "training.executor" in said and "exactly one rank" in said
    said = refused(tmp_path, "  executor: {backend: 'gone.module:Executor'}\n")
    assert "training.executor.backend" in said and "gone.module" in said
    # The trainer as a service: one http(s) URL per rank, and only the http backend's own options.
    said = refused(tmp_path, "  executor: {backend: http, workers: 2, options: {urls: ['http://a:1']}}\n")
    assert "training.executor" in said and "options.urls" in said and "one http(s) URL per rank (2 ranks)" in said
    said = refused(tmp_path, "  executor: {backend: http, options: {urls: ['ftp://a']}}\n")
    assert "options.urls[0]" in said and "ftp://a" in said and "must be an http(s) URL" in said
    said = refused(tmp_path, "  executor: {backend: http, options: {urls: ['http://a:1'], pool: 2}}\n")
    assert "knows only 'urls' and 'token_env'" in said and "pool" in said
    said = refused(tmp_path, "  executor: {backend: http, gpus_per_worker: 1, options: {urls: ['http://a:1']}}\n")
    assert "the http backend places nothing" in said
    said = refused(tmp_path, "  executor: threads\n")
    assert "training.executor.backend" in said and "'threads'" in said
    said = refused(tmp_path, "  executor: {backend: mp, workers: 0}\n")
    assert "training.executor.workers" in said


def test_the_launch_config_carries_the_class_kwargs_and_options(tmp_path: Path) -> None:
    settings = Settings.model_validate({"training": {
        "trainer": {"class": OWN, "kwargs": {"lr": 0.3}, "seed": 4, "state_dir": str(tmp_path / "t")},
        "executor": {"backend": "ray", "workers": 2, "options": {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}}},
                     "gpus_per_worker": 0.5, "launch_timeout_s": 9}}})
    config = executor_config(settings)
    assert config.backend == "ray" and config.options == {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}}}
    assert config.gpus_per_worker == 0.5 and config.launch_timeout_s == 9
    assert [spec.worker_cls for spec in config.workers] == [OWN, OWN]
    assert [dict(spec.kwargs) for spec in config.workers] == [
        {"lr": 0.3, "seed": 4, "state_dir": str(tmp_path / "t")},
        {"lr": 0.3, "seed": 4, "state_dir": str(tmp_path / "t" / "rank-1")}]
    # The old spelling still means the backend alone, and the reference trainer's defaults are its own.
    plain = executor_config(Settings.model_validate({"training": {"executor": "uni", "trainer": {"state_dir": None}}}))
    assert plain.backend == "uni" and [dict(s.kwargs) for s in plain.workers] == [{}]
    assert plain.workers[0].worker_cls == "workers.trainer.worker:Trainer"


def test_loading_a_config_that_names_the_reference_trainer_imports_no_torch() -> None:
    # The class is found, not imported: the orchestrator loads torch only to train in process.
    import subprocess
    import sys
    code = ("import sys; from engine.config import load; s = load('config.example.yaml'); "
            "assert s.training.trainer.class_ == 'workers.trainer.worker:Trainer'; "
            "print(sorted(m for m in ('torch', 'transformers', 'workers.trainer') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[4],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
