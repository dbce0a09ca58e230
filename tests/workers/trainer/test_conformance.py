"""The trainer conformance kit (workers/trainer/conformance.py): it passes the reference trainer and a
trainer written only in the tests, and fails each deliberately broken trainer naming the broken
promise, through the pytest helper and through ``python -m workers.trainer.conformance``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.trainer.conformance import CHECKPOINT_PROMISES, PROMISES, ConformanceError, assert_conforms, check_trainer
from workers.trainer.worker import Trainer

REPO = Path(__file__).resolve().parents[3]


def expected(no_checkpoint: bool = False) -> list[tuple[str, str]]:
    """Every promise passed, but those that do not apply to the kind of trainer skipped."""
    skipped = set(CHECKPOINT_PROMISES) if no_checkpoint else {"loads_published_weights"}
    return [(p, "skipped" if p in skipped else "passed") for p in PROMISES]


def test_the_reference_trainer_keeps_every_promise(tmp_path: Path) -> None:
    report = assert_conforms(Trainer, {"seed": 3}, tmp_path)
    assert [(c.promise, c.outcome) for c in report.checks] == expected()


def test_a_trainer_written_elsewhere_keeps_every_promise(tmp_path: Path) -> None:
    report = assert_conforms("tests.support.own_trainer:SgdTrainer", {"lr": 0.1}, tmp_path)
    assert [(c.promise, c.outcome) for c in report.checks] == expected()


def test_a_trainer_without_checkpoints_is_checked_on_loading_published_weights(tmp_path: Path) -> None:
    report = assert_conforms("tests.support.own_trainer:NoCheckpointSgdTrainer", {"lr": 0.1}, tmp_path)
    assert [(c.promise, c.outcome) for c in report.checks] == expected(no_checkpoint=True)
    assert all("writes_checkpoint false" in c.detail for c in report.checks if c.promise in CHECKPOINT_PROMISES)
    with pytest.raises(ConformanceError) as err:
        assert_conforms("tests.support.own_trainer:BrokenForgetfulLoad", {}, tmp_path / "broken")
    assert err.value.promise == "loads_published_weights" and "trained the job again" in err.value.detail


@pytest.mark.parametrize(("broken", "promise"), [
    ("BrokenTrainsTwice", "trains_once"),
    ("BrokenLateRecord", "step_record_before_step"),
    ("BrokenTrustingVerify", "truncated_checkpoint_fails"),
])
def test_a_broken_trainer_is_named_by_its_broken_promise(tmp_path: Path, broken: str, promise: str) -> None:
    with pytest.raises(ConformanceError) as err:
        assert_conforms(f"tests.support.own_trainer:{broken}", {}, tmp_path)
    assert err.value.promise == promise, err.value
    report = check_trainer(f"tests.support.own_trainer:{broken}", {}, tmp_path / "again")
    # Every check before the broken one passed; the kit stops there.
    assert [c.outcome for c in report.checks[:-1]] == ["passed"] * (len(report.checks) - 1)
    assert report.checks[-1].promise == promise and report.checks[-1].outcome == "failed"


def test_a_class_without_the_methods_fails_implements(tmp_path: Path) -> None:
    with pytest.raises(ConformanceError) as err:
        assert_conforms("collections:OrderedDict", {}, tmp_path)
    assert err.value.promise == "implements" and "train" in err.value.detail


def kit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.trainer.conformance", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_command_exits_by_its_verdict_and_names_the_promise() -> None:
    ok = kit("tests.support.own_trainer:SgdTrainer", "--kwargs", '{"lr": 0.1}')
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == f"{len(PROMISES) - 1} passed, 0 failed, 1 skipped"
    bad = kit("tests.support.own_trainer:BrokenTrainsTwice")
    assert bad.returncode == 1 and "failed  trains_once" in bad.stdout, bad.stdout
    missing = kit("no_such_pkg.mod:Trainer")
    assert missing.returncode == 2 and "no_such_pkg.mod" in missing.stderr
    not_json = kit("tests.support.own_trainer:SgdTrainer", "--kwargs", "[1]")
    assert not_json.returncode == 2 and "JSON object" in not_json.stderr

