"""Submitting rollouts: a batch of tasks becomes ``rollouts`` rows in ``pending``, all or nothing.

A task is ``{"rollout_id"?, "input", "labels"?}``:

- ``rollout_id`` follows the protocol's id rule (1..255 characters of ``[A-Za-z0-9._-]``, starting
  with a letter or digit) and must not end in the reserved attempt suffix ``-a<N>`` (N ≥ 1): that
  form names attempt N of another rollout on the wire. Left out, the id is derived from the input
  (``r-`` and 32 hex digits of the SHA-256 of its canonical JSON), so the same input submitted
  again is the same rollout.
- ``input`` is any JSON value (an object for the reference environment: ``{"prompt", "turns"}``);
  it is what every attempt's ``/run`` carries as ``task``. At most :data:`MAX_INPUT_BYTES` encoded.
- ``labels`` is an optional JSON object of at most :data:`MAX_LABELS_BYTES` encoded, kept as given.

Invariants :func:`submit_rollouts` keeps: the same id with the same input is a no-op (``existing``);
the same id with another input is a :class:`RolloutConflict` and nothing of the batch is written;
a batch naming one id twice with different inputs is refused the same way; a bad task raises
:class:`InvalidTask` naming its position, field, value and rule, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from journal import Create, WriteTx, models
from workers.protocol import ATTEMPT_SUFFIX, ID_PATTERN

KIND = "rollouts"
#: Tasks one submission may carry (the CLI sends a dataset in batches of at most this many).
MAX_BATCH = 10_000
MAX_ID_LENGTH = 255
MAX_INPUT_BYTES = 64 << 10
MAX_LABELS_BYTES = 4 << 10
#: Ids looked up per query when checking a batch against what is recorded.
_LOOKUP_CHUNK = 500
_ID_RE = re.compile(ID_PATTERN)

Disposition = Literal["new", "existing"]


class InvalidTask(ValueError):
    """A task the journal will not record: ``index`` (its position, 0-based), ``field``, ``value``, ``rule``."""

    def __init__(self, index: int | None, field: str, value: Any, rule: str) -> None:
        self.index, self.field, self.value, self.rule = index, field, value, rule
        where = f"task {index}: " if index is not None else ""
        text = repr(value)
        super().__init__(f"{where}{field}={text if len(text) <= 80 else text[:77] + '...'}: {rule}")


class ReservedSuffix(InvalidTask):
    """A rollout id ending in ``-a<N>``: on the wire it names attempt ``attempt`` of ``rollout``."""

    def __init__(self, index: int | None, rollout_id: str, suffix: str, attempt: int, rollout: str) -> None:
        self.rollout_id, self.suffix, self.attempt, self.rollout = rollout_id, suffix, attempt, rollout
        super().__init__(index, "rollout_id", rollout_id,
                         f"ends with the reserved attempt suffix {suffix} (it would name attempt {attempt} "
                         f"of rollout {rollout!r})")


class RolloutConflict(Exception):
    """``rollout_id`` is recorded (or named earlier in the batch) with another input."""

    def __init__(self, rollout_id: str, index: int, *, in_batch: bool = False) -> None:
        self.rollout_id, self.index, self.in_batch = rollout_id, index, in_batch
        where = "named earlier in this batch" if in_batch else "already submitted"
        super().__init__(f"task {index}: rollout {rollout_id!r} is {where} with another input; "
                         "nothing of this batch was written")


@dataclass(frozen=True)
class Task:
    """One checked task: its id (given or derived), input and labels."""

    rollout_id: str
    input: Any
    labels: Mapping[str, Any] | None
    #: The canonical JSON of ``input``: what "the same input" means.
    digest: str


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON (sorted keys, no spaces); raises ``ValueError`` for what JSON
    cannot hold exactly (NaN, infinities, non-string keys, other types)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _finite(value: Any) -> bool:
    """Whether ``value`` is plain JSON: finite numbers, string keys, no other types."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


def _has_nul(value: Any) -> bool:
    """Whether a string of ``value`` (a key or a value, at any depth) holds a NUL, which
    PostgreSQL's text cannot store."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_nul(v) for v in value)
    return False


def reserved_suffix(index: int | None, rollout_id: str) -> ReservedSuffix | None:
    """The refusal for an id ending in ``-a<N>``, or ``None``."""
    match = ATTEMPT_SUFFIX.search(rollout_id)
    if match is None:
        return None
    return ReservedSuffix(index, rollout_id, match.group(0), int(match.group(1)), rollout_id[:match.start()])


def check_rollout_id(rollout_id: Any, index: int | None = None) -> str:
    """``rollout_id`` if the protocol accepts it as a rollout's id; else :class:`InvalidTask`."""
    if not isinstance(rollout_id, str):
        raise InvalidTask(index, "rollout_id", rollout_id, "must be a string")
    if "\x00" in rollout_id:
        raise InvalidTask(index, "rollout_id", rollout_id, "must not contain a NUL character")
    if not 1 <= len(rollout_id) <= MAX_ID_LENGTH:
        raise InvalidTask(index, "rollout_id", rollout_id,
                          f"must be 1..{MAX_ID_LENGTH} characters (got {len(rollout_id)})")
    if not _ID_RE.match(rollout_id):
        raise InvalidTask(index, "rollout_id", rollout_id,
                          "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'")
    reserved = reserved_suffix(index, rollout_id)
    if reserved is not None:
        raise reserved
    return rollout_id


def check_task(raw: Any, index: int | None = None) -> Task:
    """One task checked (see the module docstring); :class:`InvalidTask` names what is wrong."""
    if not isinstance(raw, Mapping):
        raise InvalidTask(index, "task", raw, f"must be a JSON object, not {type(raw).__name__}")
    unknown = sorted(set(raw) - {"rollout_id", "input", "labels"})
    if unknown:
        raise InvalidTask(index, unknown[0], raw[unknown[0]], "unknown field (a task has rollout_id, input, labels)")
    if "input" not in raw:
        raise InvalidTask(index, "input", None, "is required")
    value = raw["input"]
    if not _finite(value):
        raise InvalidTask(index, "input", value, "must be JSON (no NaN or infinities, string keys only)")
    encoded = canonical(value)
    if len(encoded) > MAX_INPUT_BYTES:
        raise InvalidTask(index, "input", f"<{len(encoded)} bytes>", f"must be at most {MAX_INPUT_BYTES} bytes encoded")
    if _has_nul(value):
        raise InvalidTask(index, "input", value, "must not contain a NUL character")
    labels = raw.get("labels")
    if labels is not None:
        if not isinstance(labels, Mapping) or not _finite(labels):
            raise InvalidTask(index, "labels", labels, "must be a JSON object")
        if _has_nul(labels):
            raise InvalidTask(index, "labels", labels, "must not contain a NUL character")
        size = len(canonical(labels))
        if size > MAX_LABELS_BYTES:
            raise InvalidTask(index, "labels", f"<{size} bytes>", f"must be at most {MAX_LABELS_BYTES} bytes encoded")
    digest = hashlib.sha256(encoded).hexdigest()
    given = raw.get("rollout_id")
    rollout_id = check_rollout_id(given, index) if given is not None else f"r-{digest[:32]}"
    return Task(rollout_id, value, dict(labels) if labels is not None else None, digest)


@dataclass(frozen=True)
class Submitted:
    rollout_id: str
    disposition: Disposition


async def submit_rollouts(tx: WriteTx, tasks: Sequence[Task]) -> list[Submitted]:
    """Record ``tasks`` as ``pending`` rollouts in ``tx`` (see the module docstring); one
    :class:`Submitted` per task, in order. Raises :class:`RolloutConflict` (the caller's
    transaction must then be rolled back: the committer does) or ``ValueError`` for too many."""
    if len(tasks) > MAX_BATCH:
        raise InvalidTask(None, "tasks", f"<{len(tasks)} tasks>", f"at most {MAX_BATCH} tasks per submission")
    first: dict[str, tuple[int, str]] = {}
    for i, task in enumerate(tasks):
        seen = first.setdefault(task.rollout_id, (i, task.digest))
        if seen[1] != task.digest:
            raise RolloutConflict(task.rollout_id, i, in_batch=True)
    t = models.rollouts
    recorded: dict[str, str] = {}
    ids = list(first)
    for start in range(0, len(ids), _LOOKUP_CHUNK):
        rows = (await tx.execute(sa.select(t.c.id, t.c.task).where(t.c.id.in_(ids[start:start + _LOOKUP_CHUNK])))).all()
        recorded.update({r.id: hashlib.sha256(canonical(r.task)).hexdigest() for r in rows})
    out: list[Submitted] = []
    creates: list[Create] = []
    for i, task in enumerate(tasks):
        if task.rollout_id in recorded:
            if recorded[task.rollout_id] != task.digest:
                raise RolloutConflict(task.rollout_id, i)
            out.append(Submitted(task.rollout_id, "existing"))
            continue
        if first[task.rollout_id][0] != i:
            out.append(Submitted(task.rollout_id, "existing"))  # named twice in the batch: the first counts
            continue
        creates.append(Create(KIND, task.rollout_id, "submitted", state="pending",
                              values={"attempt": 0, "task": task.input, "labels": task.labels, "failures": 0}))
        out.append(Submitted(task.rollout_id, "new"))
    if creates:
        await tx.apply(creates)
    return out


__all__ = ["MAX_BATCH", "MAX_ID_LENGTH", "MAX_INPUT_BYTES", "MAX_LABELS_BYTES", "InvalidTask", "ReservedSuffix",
           "RolloutConflict", "Submitted", "Task", "canonical", "check_rollout_id", "check_task", "reserved_suffix",
           "submit_rollouts"]
