"""Who a training job is, and what a published version is called.

**Job identity.** A job is its batch: its id is the SHA-256 of its payload in canonical JSON
(keys sorted, no spaces, no NaN or infinity) without the keys in :data:`IDENTITY_EXCLUDED`:

- ``scenario_step`` — other components advance it while the job is out;
- ``batch_number`` — the batch processor numbers batches again after a reload;
- ``base_version`` — a newer publication may change it before a retry.

So a job retried after any of those moved is still the same job, and is never trained twice.

**Runtime load ids.** A published version is ``<incarnation>:<sequence>``: the incarnation is
a UUID4 hex chosen when a deployment's weights are first registered, the sequence counts
publications from 0. Each publication takes the next sequence of the current id. It is the
``weight_version`` an engine reports on the wire.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Payload keys that are not part of a job's identity.
IDENTITY_EXCLUDED: tuple[str, ...] = ("scenario_step", "batch_number", "base_version")


class TrainingPayloadError(ValueError):
    """A payload that cannot be a training job: ``field`` holds ``value``, which breaks ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field}: {_short(value)} {rule}")
        self.field, self.value, self.rule = field, value, rule


class LoadIdError(ValueError):
    """Text that is not a runtime load id ``<incarnation>:<sequence>``."""

    def __init__(self, text: object, rule: str) -> None:
        super().__init__(f"runtime load id {_short(text)}: {rule}")
        self.text, self.rule = text, rule


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(value: Any, path: str) -> None:
    """Refuse what canonical JSON cannot hold exactly, naming where it is."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TrainingPayloadError(path, value, "must be a finite number")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TrainingPayloadError(f"{path}.{key!r}", key, "must be a string key")
            _check(item, f"{path}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")
        return
    raise TrainingPayloadError(path, value, f"is a {type(value).__name__}, which JSON cannot hold")


def canonical(payload: Mapping[str, Any]) -> bytes:
    """The payload as canonical JSON bytes (raises :class:`TrainingPayloadError` naming the field)."""
    if not isinstance(payload, Mapping):
        raise TrainingPayloadError("payload", payload, "must be a JSON object")
    _check(payload, "payload")
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def job_identity(payload: Mapping[str, Any]) -> str:
    """The job's id: SHA-256 (hex) of the canonical payload without :data:`IDENTITY_EXCLUDED`."""
    if not isinstance(payload, Mapping):
        raise TrainingPayloadError("payload", payload, "must be a JSON object")
    kept = {k: v for k, v in payload.items() if k not in IDENTITY_EXCLUDED}
    return hashlib.sha256(canonical(kept)).hexdigest()


@dataclass(frozen=True, order=True)
class LoadId:
    """A runtime load id: ``incarnation`` (no ``:``) and ``sequence`` (an int >= 0)."""

    incarnation: str
    sequence: int

    def __post_init__(self) -> None:
        if not self.incarnation or ":" in self.incarnation:
            raise LoadIdError(f"{self.incarnation}:{self.sequence}", "the incarnation must be non-empty, without ':'")
        if isinstance(self.sequence, bool) or not isinstance(self.sequence, int) or self.sequence < 0:
            raise LoadIdError(f"{self.incarnation}:{self.sequence}", "the sequence must be an integer >= 0")

    @classmethod
    def first(cls) -> LoadId:
        """A new incarnation's first id (``<uuid4 hex>:0``)."""
        return cls(uuid.uuid4().hex, 0)

    @classmethod
    def parse(cls, text: str) -> LoadId:
        if not isinstance(text, str):
            raise LoadIdError(text, "must be a string")
        incarnation, sep, sequence = text.rpartition(":")
        if not sep:
            raise LoadIdError(text, "must be <incarnation>:<sequence>")
        if not sequence.isascii() or not sequence.isdigit():
            raise LoadIdError(text, "the sequence must be an integer >= 0")
        return cls(incarnation, int(sequence))

    def next(self) -> LoadId:
        """The id the next publication of this incarnation takes."""
        return LoadId(self.incarnation, self.sequence + 1)

    def __str__(self) -> str:
        return f"{self.incarnation}:{self.sequence}"


__all__ = ["IDENTITY_EXCLUDED", "LoadId", "LoadIdError", "TrainingPayloadError", "canonical", "job_identity"]
