"""Damaged checkpoints for tests: the eight kinds of corrupt manifest a restore must refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.participant.storage import MANIFEST

#: Every kind of corrupt manifest: each must be a typed 422 ``invalid_checkpoint_state``.
CORRUPT_MANIFESTS = ("not json", "not an object", "missing records_file", "missing records_sha256", "outside",
                     "missing file", "count is a string", "missing checkpoint_id")


def corrupt_manifest(directory: Path, manifest: dict[str, Any], how: str) -> None:
    """Replace the manifest in ``directory`` (a participant directory) with one corrupt ``how``."""
    path = directory / MANIFEST
    path.unlink(missing_ok=True)
    if how == "not json":
        path.write_text("{not json")
        return
    if how == "not an object":
        path.write_text("[]")
        return
    m = dict(manifest)
    if how == "missing file":
        m["records_file"] = "records-" + "0" * 64 + ".jsonl"
    elif how.startswith("missing "):
        del m[how.removeprefix("missing ")]
    elif how == "outside":
        m["records_file"] = "../../../outside.jsonl"
    elif how == "count is a string":
        m["record_count"] = str(m["record_count"])
    else:
        raise ValueError(f"unknown corruption {how!r}")
    path.write_text(json.dumps(m))
