"""The trainer conformance kit: check a trainer class against every promise the orchestrator relies on.

    python -m workers.trainer.conformance package.module:Class [--kwargs JSON] [--jobs package.module:fn]

or, in a test suite::

    from workers.trainer.conformance import assert_conforms
    assert_conforms("package.module:Class", {"lr": 0.1}, tmp_path)

The kit builds the class in this process (twice: a second trainer loads the first one's checkpoint),
each with its own ``state_dir`` under a working directory, and runs it through the calls the
orchestrator makes. Each promise of :mod:`workers.trainer.contract` is one check; a report lists
every check as passed, failed (with what was seen) or skipped (with why), and the command exits 1
when one failed, naming it. Jobs are the reference task's (``reference_job``) unless ``--jobs``
names a function ``fn(salt: int) -> dict`` that returns a payload the class trains on.

"The step record says ``started`` before the optimizer moves" is observed through torch's global
optimizer pre-step hook, so it is checked for trainers that step a ``torch.optim`` optimizer and
skipped (saying so) for others. A trainer whose health says ``writes_checkpoint`` false skips the four
checkpoint promises and is checked on ``load_weights`` instead (``loads_published_weights``, skipped
for a trainer that writes checkpoints).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.executor import WorkerSpec, import_object
from workers.policy import VOCAB, encode
from workers.trainer.contract import METHODS
from workers.trainer.errors import JobError
from workers.trainer.steps import INITIAL, read_step_record

#: The promises, in the order they are checked, each with what it means.
PROMISES: dict[str, str] = {
    "implements": "the class has every method of the trainer contract",
    "health": "health() reports step, last_job_id, in_doubt and step_record",
    "declares_initial": "a fresh trainer declares its initial weights in its step record (step 0, job initial)",
    "refuses_malformed_job": "a malformed job is refused with JobError before any step",
    "step_record_before_step": "the step record says started (job and step) before the optimizer moves",
    "trains_once": "the same job twice trains once: the second is refused and nothing moves",
    "checkpoint_names_job_and_step": "a checkpoint (its parent directory created) verifies and carries its "
                                     "job and step",
    "checkpoint_refuses_other_job": "a checkpoint naming a job other than the latest step's is refused",
    "truncated_checkpoint_fails": "a truncated checkpoint fails verification",
    "load_continues": "a fresh trainer that loads a checkpoint holds its step and job, says loaded, and "
                      "refuses that job again",
    "weights": "prepare_weights writes the version's directory and send_weights accepts it",
    "loads_published_weights": "a trainer that writes no checkpoint (health says writes_checkpoint false): a "
                               "fresh one that loads a published weights directory holds its job, step and "
                               "weights, says loaded, and refuses that job again",
}
#: The promises about checkpoints: skipped for a trainer whose health says ``writes_checkpoint`` false.
CHECKPOINT_PROMISES = ("checkpoint_names_job_and_step", "checkpoint_refuses_other_job", "truncated_checkpoint_fails",
                       "load_continues")


class ConformanceError(AssertionError):
    """A trainer broke a promise; ``promise`` names it (a key of :data:`PROMISES`)."""

    def __init__(self, promise: str, detail: str) -> None:
        super().__init__(f"{promise}: {PROMISES.get(promise, promise)} — {detail}")
        self.promise = promise
        self.detail = detail


@dataclass
class Check:
    promise: str
    outcome: str  # "passed", "failed" or "skipped"
    detail: str = ""


@dataclass
class Report:
    trainer: str
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.outcome == "failed"]

    def lines(self) -> list[str]:
        out = [f"trainer conformance: {self.trainer}"]
        for c in self.checks:
            out.append(f"  {c.outcome:7} {c.promise}: {PROMISES[c.promise]}" + (f" — {c.detail}" if c.detail else ""))
        skipped = sum(c.outcome == "skipped" for c in self.checks)
        passed = len(self.checks) - len(self.failed) - skipped
        out.append(f"{passed} passed, {len(self.failed)} failed" + (f", {skipped} skipped" if skipped else ""))
        return out


def reference_job(salt: int) -> dict[str, Any]:
    """A payload of the reference task (``workers.trainer.job``): four scored rollouts, varied by ``salt``."""
    rollouts = []
    for index, text in enumerate(("aab", "bca", "aaa", "cab")):
        completion = encode(text)
        if index == 0:
            completion[0] = (completion[0] + salt) % VOCAB
        rollouts.append({"prompt": "ab c", "completion": completion, "reward": float(text.count("a")) - 0.25 * index})
    return {"rollouts": rollouts}


def _job(factory: Callable[[int], Mapping[str, Any]], salt: int) -> dict[str, Any]:
    return {**factory(salt), "job_id": hashlib.sha256(f"conformance-{salt}".encode()).hexdigest()}


class _Run:
    """One run of the kit over one class; each method is one promise and raises ConformanceError."""

    def __init__(self, cls: type, kwargs: Mapping[str, Any], workdir: Path,
                 jobs: Callable[[int], Mapping[str, Any]]) -> None:
        self.cls, self.kwargs, self.workdir, self.jobs = cls, dict(kwargs), workdir, jobs
        self.first: Any = None
        self.job = _job(jobs, 1)
        self.checkpoint = str(workdir / "checkpoints" / "first.ckpt")

    def build(self, name: str) -> Any:
        state = self.workdir / name / "state"
        state.mkdir(parents=True, exist_ok=True)
        return self.cls(**{**self.kwargs, "state_dir": str(state)})

    def state_dir(self, name: str) -> Path:
        return self.workdir / name / "state"

    def implements(self) -> None:
        missing = [m for m in METHODS if not callable(getattr(self.cls, m, None))]
        if missing:
            raise ConformanceError("implements", f"missing {missing}")
        self.first = self.build("first")

    def health(self) -> None:
        report = self.first.health()
        missing = [k for k in ("step", "last_job_id", "in_doubt", "step_record") if k not in report]
        if missing:
            raise ConformanceError("health", f"health() has no {missing} (got keys {sorted(report)})")
        if report["step"] != 0 or report["last_job_id"] is not None:
            raise ConformanceError("health", f"a fresh trainer reports step {report['step']!r}, last job "
                                             f"{report['last_job_id']!r} (expected 0 and None)")

    def declares_initial(self) -> None:
        self.first.declare_initial()
        record = self.first.health()["step_record"]
        if not record or (record.get("job_id"), record.get("phase"), record.get("step")) != (INITIAL, "loaded", 0):
            raise ConformanceError("declares_initial", f"the step record after declare_initial is {record!r}")

    def refuses_malformed_job(self) -> None:
        try:
            self.first.train({"job_id": "0" * 64, "rollouts": "not a list"})
        except JobError:
            pass
        except Exception as exc:  # noqa: BLE001 - any other refusal is the broken promise
            raise ConformanceError("refuses_malformed_job", f"refused with {type(exc).__name__}: {exc}, "
                                                            f"not JobError (the job would be ambiguous)") from None
        else:
            raise ConformanceError("refuses_malformed_job", "train accepted a job whose rollouts are not a list")
        after = self.first.health()
        if after["step"] != 0 or after["in_doubt"] is not None:
            raise ConformanceError("refuses_malformed_job", f"after the refusal: step {after['step']}, in doubt "
                                                            f"{after['in_doubt']!r}")

    def step_record_before_step(self) -> None:
        seen: list[Any] = []
        with _optimizer_steps(lambda: seen.append(read_step_record(self.state_dir("first")))):
            metrics = self.first.train(self.job)
        if not isinstance(metrics, dict):
            raise ConformanceError("step_record_before_step", f"train returned {type(metrics).__name__}, not a dict")
        if not seen:
            raise _Skipped("no torch.optim optimizer stepped during train; the kit cannot observe the order")
        record = seen[0]
        if record is None or (record.job_id, record.phase, record.step) != (self.job["job_id"], "started", 1):
            shown = None if record is None else (record.job_id[:12], record.phase, record.step)
            raise ConformanceError("step_record_before_step", f"when the optimizer first moved the record was "
                                                              f"{shown} (expected (job, 'started', 1))")

    def trains_once(self) -> None:
        before = self.first.health()
        if (before["step"], before["last_job_id"]) != (1, self.job["job_id"]):
            raise ConformanceError("trains_once", f"after one train the trainer reports step {before['step']} "
                                                  f"job {before['last_job_id']!r}")
        # The weights are compared too when the trainer can digest them (the reference one can).
        found = getattr(self.first, "weights_digest", None)
        digest: Callable[[], Any] = found if callable(found) else (lambda: None)
        weights = digest()
        try:
            self.first.train(self.job)
        except Exception:  # noqa: BLE001 - the refusal is the promise kept
            pass
        else:
            raise ConformanceError("trains_once", "the same job was trained a second time without a refusal")
        after = self.first.health()
        if after["step"] != 1 or digest() != weights:
            raise ConformanceError("trains_once", f"the refused second train moved the trainer (step "
                                                  f"{after['step']}, weights digest {weights} -> {digest()})")

    def checkpoint_names_job_and_step(self) -> None:
        self.first.save_checkpoint(self.checkpoint, self.job["job_id"])
        info = self.first.verify_checkpoint(self.checkpoint)
        if (info.get("job_id"), info.get("step")) != (self.job["job_id"], 1):
            raise ConformanceError("checkpoint_names_job_and_step", f"verify_checkpoint says job "
                                                                    f"{info.get('job_id')!r} step {info.get('step')!r}")

    def checkpoint_refuses_other_job(self) -> None:
        other = str(self.workdir / "checkpoints" / "other.ckpt")
        try:
            self.first.save_checkpoint(other, "f" * 64)
        except Exception:  # noqa: BLE001 - refused, as promised
            return
        raise ConformanceError("checkpoint_refuses_other_job", "save_checkpoint wrote a checkpoint naming a job "
                                                               "whose step never ran")

    def truncated_checkpoint_fails(self) -> None:
        # A second checkpoint of the same step, written by the trainer (with whatever it keeps beside
        # it), then cut to half: the file itself, or the largest file of a checkpoint directory.
        damaged = Path(self.workdir / "checkpoints" / "truncated.ckpt")
        self.first.save_checkpoint(str(damaged), self.job["job_id"])
        victim = damaged if damaged.is_file() else max((p for p in damaged.rglob("*") if p.is_file()),
                                                       key=lambda p: p.stat().st_size)
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
        try:
            info = self.first.verify_checkpoint(str(damaged))
        except Exception:  # noqa: BLE001 - refused, as promised
            return
        raise ConformanceError("truncated_checkpoint_fails", f"a checkpoint cut to half its size verifies ({info!r})")

    def load_continues(self) -> None:
        second = self.build("second")
        second.load_checkpoint(self.checkpoint)
        report = second.health()
        record = report.get("step_record") or {}
        if (report["step"], report["last_job_id"]) != (1, self.job["job_id"]) or record.get("phase") != "loaded":
            raise ConformanceError("load_continues", f"after loading: step {report['step']}, job "
                                                     f"{report['last_job_id']!r}, step record {record!r}")
        try:
            second.train(self.job)
        except Exception:  # noqa: BLE001 - refused, as promised
            return
        raise ConformanceError("load_continues", "a trainer that loaded the job's checkpoint trained the job again")

    def weights(self) -> None:
        target = {"version": "conformance:1", "directory": str(self.workdir / "weights" / "v1")}
        reply = self.first.prepare_weights(target)
        directory = Path(target["directory"])
        if reply.get("version") != target["version"] or not directory.is_dir() or not any(directory.iterdir()):
            raise ConformanceError("weights", f"prepare_weights replied {reply!r} and left {directory} "
                                              f"{'empty' if directory.is_dir() else 'missing'}")
        self.first.send_weights(target, [])


    def loads_published_weights(self) -> None:
        if self.first.health().get("writes_checkpoint") is not False:
            raise _Skipped("it writes checkpoints: load_weights is not called")
        load = getattr(self.cls, "load_weights", None)
        if not callable(load):
            raise ConformanceError("loads_published_weights", "no load_weights(directory, job_id, step) method")
        directory = str(self.workdir / "weights" / "v1")  # what the weights promise published
        second = self.build("published")
        second.load_weights(directory, self.job["job_id"], 1)
        report = second.health()
        record = report.get("step_record") or {}
        if (report["step"], report["last_job_id"]) != (1, self.job["job_id"]) or record.get("phase") != "loaded":
            raise ConformanceError("loads_published_weights", f"after loading: step {report['step']}, job "
                                                              f"{report['last_job_id']!r}, step record {record!r}")
        # It holds those weights: published again under the same version, they are the same bytes.
        again = str(self.workdir / "weights" / "v1-again")
        second.prepare_weights({"version": "conformance:1", "directory": again})
        if _files(Path(directory)) != _files(Path(again)):
            raise ConformanceError("loads_published_weights", "the weights it publishes after loading are not the "
                                                              "ones it loaded")
        try:
            second.train(self.job)
        except Exception:  # noqa: BLE001 - refused, as promised
            return
        raise ConformanceError("loads_published_weights", "a trainer that loaded the job's published weights "
                                                          "trained the job again")


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by its relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class _Skipped(Exception):
    """A promise the kit cannot observe for this class (the reason is the message)."""


@contextmanager
def _optimizer_steps(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` before every ``torch.optim`` optimizer step in this process (if torch is here)."""
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
    except ImportError:
        yield
        return
    handle = register_optimizer_step_pre_hook(lambda *_: callback())
    try:
        yield
    finally:
        handle.remove()


def check_trainer(trainer: type | str, kwargs: Mapping[str, Any] | None = None, workdir: str | Path | None = None,
                  jobs: Callable[[int], Mapping[str, Any]] = reference_job) -> Report:
    """Run every check against ``trainer`` (a class or ``package.module:Class``); stop at the first
    failure (later checks build on earlier ones), which the report names."""
    cls = WorkerSpec(trainer).resolve_class()
    with tempfile.TemporaryDirectory(prefix="tidelog-conformance-") as scratch:
        run = _Run(cls, kwargs or {}, Path(workdir) if workdir is not None else Path(scratch), jobs)
        report = Report(WorkerSpec(trainer).name)
        for promise in PROMISES:
            try:
                if promise in CHECKPOINT_PROMISES and run.first is not None \
                        and run.first.health().get("writes_checkpoint") is False:
                    raise _Skipped("its health says writes_checkpoint false")
                getattr(run, promise)()
            except _Skipped as why:
                report.checks.append(Check(promise, "skipped", str(why)))
            except ConformanceError as exc:
                report.checks.append(Check(promise, "failed", exc.detail))
                break
            except Exception as exc:  # noqa: BLE001 - the trainer raised where the contract says it answers
                report.checks.append(Check(promise, "failed", f"raised {type(exc).__name__}: {exc}"))
                break
            else:
                report.checks.append(Check(promise, "passed"))
        return report


def assert_conforms(trainer: type | str, kwargs: Mapping[str, Any] | None = None,
                    workdir: str | Path | None = None,
                    jobs: Callable[[int], Mapping[str, Any]] = reference_job) -> Report:
    """:func:`check_trainer`, raising :class:`ConformanceError` naming the first broken promise."""
    report = check_trainer(trainer, kwargs, workdir, jobs)
    if report.failed:
        first = report.failed[0]
        raise ConformanceError(first.promise, first.detail)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.trainer.conformance",
                                     description="Check a trainer class against the trainer contract.")
    parser.add_argument("trainer", help="the class, as package.module:Class")
    parser.add_argument("--kwargs", default="{}", help="its constructor's keyword arguments, as a JSON object")
    parser.add_argument("--jobs", help="package.module:fn, fn(salt) -> a job payload the class trains on")
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
        jobs = reference_job if args.jobs is None else import_object(args.jobs, field="--jobs")
        report = check_trainer(args.trainer, kwargs, jobs=jobs)
    except (ValueError, TypeError) as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
