"""A trainer rank that SIGKILLs its own process at one named point, once: for the crash harness.

A real trainer process cannot be made to die on demand at a chosen line, so this test-only
subclass of :class:`workers.trainer.worker.Trainer` does it. The training crash worker
(``tests/support/training_worker.py``) selects it by ``training.trainer.class`` = :data:`IMPORT_PATH` when ``TIDELOG_TEST_TRAINER_DIE`` is set; the spawned ``mp`` child inherits
the variable.

``TIDELOG_TEST_TRAINER_DIE=<method>:<before|after>[@N]`` — the N-th (default first) call of
``train``, ``save_checkpoint`` or ``prepare_weights`` in this process kills it with SIGKILL just
before the real method runs (nothing of it happened) or just after it returned (all of it
happened, the answer never sent). ``train:before`` dies before the step record's ``started``;
``train:after`` after its ``applied``. It dies once per working directory: a marker file
``trainer-died`` next to the trainer's ``state_dir`` is written (durably) before the kill, and a
trainer that finds it — the executor's fresh process after the death — runs normally.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workers.trainer.transfer import WeightsTarget
from workers.trainer.worker import Trainer

ENV = "TIDELOG_TEST_TRAINER_DIE"
IMPORT_PATH = "tests.support.faulty_trainer:FaultyTrainer"
MARKER = "trainer-died"
POINTS = ("train:before", "train:after", "save_checkpoint:before", "save_checkpoint:after",
          "prepare_weights:before", "prepare_weights:after")


def parse(spec: str) -> tuple[str, str, int]:
    """``method:when[@N]`` as (method, when, N); raises ValueError for anything else."""
    point, _, nth = spec.partition("@")
    if point not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: the point must be one of {', '.join(POINTS)}")
    method, when = point.split(":")
    return method, when, int(nth) if nth else 1


class FaultyTrainer(Trainer):
    """:class:`Trainer` that dies at ``TIDELOG_TEST_TRAINER_DIE`` once (see the module docs)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        spec = os.environ.get(ENV, "")
        state_dir = kwargs.get("state_dir")
        self._die = parse(spec) if spec and state_dir is not None else None
        self._marker = Path(state_dir).parent / MARKER if state_dir is not None else None
        self._calls: dict[str, int] = {}

    def _maybe_die(self, method: str, when: str) -> None:
        if self._die is None or self._marker is None or self._die != (method, when, self._calls[method]):
            return
        if self._marker.exists():
            return  # this working directory's trainer already died once
        with open(self._marker, "w") as f:
            f.write(f"{method}:{when}@{self._die[2]} pid {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        sys.stderr.write(f"faulty trainer: dying (SIGKILL) at {method}:{when}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _around(self, method: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self._calls[method] = self._calls.get(method, 0) + 1
        self._maybe_die(method, "before")
        result = call()
        self._maybe_die(method, "after")
        return result

    def train(self, job: Any) -> dict[str, Any]:
        return self._around("train", lambda: super(FaultyTrainer, self).train(job))

    def save_checkpoint(self, path: str, job_id: str) -> dict[str, Any]:
        return self._around("save_checkpoint", lambda: super(FaultyTrainer, self).save_checkpoint(path, job_id))

    def prepare_weights(self, target: WeightsTarget | Mapping[str, Any]) -> dict[str, Any]:
        return self._around("prepare_weights", lambda: super(FaultyTrainer, self).prepare_weights(target))


__all__ = ["ENV", "IMPORT_PATH", "MARKER", "POINTS", "FaultyTrainer", "parse"]
