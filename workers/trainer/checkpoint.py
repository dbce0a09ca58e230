"""Trainer checkpoints: one file holding model and optimizer state, the job id and the step.

File layout (format 1)::

    {"format": 1, "job_id": ..., "magic": "tidelog-trainer-checkpoint", "metrics": {...},
     "sha256": <hex of payload>, "size": <payload bytes>, "step": ...}\\n
    <payload: torch.save of {"job_id", "step", "metrics", "model", "optimizer", "config"}>

The header is one line of JSON, so the job id, the step and the step's training metrics can be
read without torch; the payload repeats them, and the digest covers the payload, so neither half
can be altered without :func:`verify_checkpoint` noticing. The metrics are what ``train`` returned
for the step: an orchestrator that settles a job from its checkpoint after a crash records them
(a file written before metrics were kept has none: ``{}``). A checkpoint is written with
:func:`~workers.files.write_atomically` (temporary file, fsync, rename, fsync of
the directory): a reader sees the previous file or the whole new one.

:func:`verify_checkpoint` refuses, with :class:`~workers.trainer.errors.CheckpointError`
naming the file and the rule, a missing or unreadable file, a bad header, a truncated or
over-long payload, a digest mismatch, a payload torch cannot load, and a payload whose job
id or step disagrees with the header. A verified checkpoint tagged with a job id is the
durable evidence that the job's optimizer step ran.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.files import write_atomically
from workers.trainer.errors import CheckpointError

MAGIC = "tidelog-trainer-checkpoint"
FORMAT = 1
#: A header longer than this is not a header (guards against reading a whole foreign file as one).
MAX_HEADER_BYTES = 4096


@dataclass(frozen=True)
class CheckpointInfo:
    """What a verified checkpoint says about itself."""

    path: str
    job_id: str
    step: int
    sha256: str
    size: int
    #: The training metrics of the step (``train``'s reply), empty for a file that kept none.
    metrics: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_checkpoint(path: str | Path, *, job_id: str, step: int, model: dict[str, torch.Tensor],
                     optimizer: dict[str, Any], config: dict[str, Any],
                     metrics: dict[str, Any] | None = None) -> CheckpointInfo:
    """Write a checkpoint atomically; tensors are moved to the CPU first. Returns its info.

    ``metrics`` (plain JSON, finite numbers) go into the header and the payload."""
    if not isinstance(job_id, str) or not job_id:
        raise CheckpointError(str(path), f"job_id {job_id!r} must be a non-empty string")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(str(path), f"step {step!r} must be an int >= 0")
    kept = dict(metrics or {})
    try:
        json.dumps(kept, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(str(path), f"metrics must be plain JSON with finite numbers ({exc})") from None
    buf = io.BytesIO()
    torch.save({"job_id": job_id, "step": step, "metrics": kept, "model": _to_cpu(model),
                "optimizer": _to_cpu(optimizer), "config": dict(config)}, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = {"format": FORMAT, "job_id": job_id, "magic": MAGIC, "metrics": kept, "sha256": digest,
              "size": len(payload), "step": step}
    line = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    if len(line) >= MAX_HEADER_BYTES:
        raise CheckpointError(str(path), f"the header with its metrics is {len(line)} bytes, over "
                                         f"{MAX_HEADER_BYTES}: keep the step's metrics small")
    target = Path(path)
    write_atomically(target, line + b"\n" + payload)
    return CheckpointInfo(str(target), job_id, step, digest, len(payload), kept)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _read_header(name: str, data: bytes) -> tuple[dict[str, Any], bytes]:
    end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise CheckpointError(name, "no header line (not a checkpoint, or truncated inside the header)")
    try:
        header = json.loads(data[:end])
    except ValueError:
        raise CheckpointError(name, "header is not JSON") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise CheckpointError(name, f"header magic must be {MAGIC!r}")
    if header.get("format") != FORMAT:
        raise CheckpointError(name, f"format {header.get('format')!r} is not supported (want {FORMAT})")
    for key, kind in (("job_id", str), ("sha256", str), ("size", int), ("step", int)):
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise CheckpointError(name, f"header field {key!r} must be a {kind.__name__}")
    return header, data[end + 1:]


def read_checkpoint(path: str | Path) -> tuple[CheckpointInfo, dict[str, Any]]:
    """Verify ``path`` (see the module docs) and return its info and its loaded payload."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(name, "missing") from None
    except OSError as exc:
        raise CheckpointError(name, f"unreadable ({exc.strerror or exc})") from None
    header, payload = _read_header(name, data)
    if len(payload) < header["size"]:
        raise CheckpointError(name, f"truncated: payload has {len(payload)} of {header['size']} bytes")
    if len(payload) > header["size"]:
        raise CheckpointError(name, f"payload has {len(payload)} bytes, header says {header['size']}")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header["sha256"]:
        raise CheckpointError(name, f"sha256 {digest[:12]}… of the payload does not match "
                                    f"{header['sha256'][:12]}… in the header")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a payload it cannot unpickle
        raise CheckpointError(name, f"payload does not load ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not {"job_id", "step", "model", "optimizer"} <= set(state):
        raise CheckpointError(name, "payload lacks job_id, step, model or optimizer")
    # The digest binds the payload; this binds the header to it, so an edited header fails too.
    if state["job_id"] != header["job_id"] or state["step"] != header["step"]:
        raise CheckpointError(name, f"header names job {header['job_id']!r} step {header['step']}, "
                                    f"payload job {state['job_id']!r} step {state['step']}")
    metrics = header.get("metrics", {})
    if state.get("metrics", {}) != metrics or not isinstance(metrics, dict):
        raise CheckpointError(name, "the header's metrics are not the payload's")
    return CheckpointInfo(name, header["job_id"], header["step"], digest, header["size"], metrics), state


def verify_checkpoint(path: str | Path) -> CheckpointInfo:
    """The info of a checkpoint that passes every check in the module docs, else CheckpointError."""
    info, _ = read_checkpoint(path)
    return info


__all__ = ["FORMAT", "MAGIC", "CheckpointInfo", "read_checkpoint", "verify_checkpoint",
           "write_checkpoint"]
