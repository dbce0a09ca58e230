"""The trainer's step record: a small durable file saying which optimizer step ran for which job.

The orchestrator writes ``RUNNING`` before it calls ``train`` and cannot tell, after a crash,
whether the step happened. The trainer therefore keeps ``<state_dir>/step.json``, replaced
atomically at each transition:

- ``started``: written *before* the optimizer step of ``job_id``; ``step`` is the step it
  will become.
- ``applied``: written right after that step; ``step`` is now the trainer's step.
- ``loaded``: written after a checkpoint was loaded; ``job_id`` and ``step`` are the
  checkpoint's — or ``initial`` and 0 when a fresh trainer declared that it holds its initial
  weights (``Trainer.declare_initial``), so no job's step is in them.

Reading it: if the record does not name a job, that job's step never started on this
trainer and training it is safe; if it names the job (``started`` or ``applied``), the step
may have been applied and only a verified checkpoint tagged with the job settles it. The file
holds the latest transition only — one job is in flight at a time.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from workers.files import write_atomically
from workers.trainer.errors import StepRecordError

STEP_FILE = "step.json"
#: The job id a ``loaded`` record names when the trainer holds its initial weights (no job's step).
INITIAL = "initial"
PHASES: tuple[str, ...] = ("started", "applied", "loaded")
StepPhase = Literal["started", "applied", "loaded"]


@dataclass(frozen=True)
class StepRecord:
    """One line of evidence: ``phase`` of ``step`` for ``job_id``, at Unix time ``at``."""

    step: int
    job_id: str
    phase: StepPhase
    at: float

    def names(self, job_id: str) -> bool:
        """Whether this record is about ``job_id`` (so its step may have run; see the module docs)."""
        return self.job_id == job_id

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_step_record(state_dir: str | Path, step: int, job_id: str, phase: StepPhase) -> StepRecord:
    """Durably replace ``<state_dir>/step.json`` with a new record and return it."""
    record = StepRecord(step=step, job_id=job_id, phase=phase, at=time.time())
    data = json.dumps({"format": 1, **record.as_dict()}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()
    write_atomically(Path(state_dir) / STEP_FILE, data)
    return record


def read_step_record(state_dir: str | Path) -> StepRecord | None:
    """The record in ``state_dir``, or ``None`` when there is none; a malformed file raises."""
    path = Path(state_dir) / STEP_FILE
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StepRecordError(str(path), f"unreadable ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != 1:
        raise StepRecordError(str(path), "must be a JSON object with format 1")
    step, job_id, phase, at = raw.get("step"), raw.get("job_id"), raw.get("phase"), raw.get("at")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StepRecordError(str(path), f"step {step!r} must be an int >= 0")
    if not isinstance(job_id, str) or not job_id:
        raise StepRecordError(str(path), f"job_id {job_id!r} must be a non-empty string")
    if phase not in PHASES:
        raise StepRecordError(str(path), f"phase {phase!r} must be one of {', '.join(PHASES)}")
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise StepRecordError(str(path), f"at {at!r} must be a number")
    return StepRecord(step=step, job_id=job_id, phase=phase, at=float(at))


__all__ = ["INITIAL", "PHASES", "STEP_FILE", "StepPhase", "StepRecord", "read_step_record", "write_step_record"]
