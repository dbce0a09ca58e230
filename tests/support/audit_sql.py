"""The named SQL queries of docs/audit.md, for tests that run them against a real journal."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit.md"
_BLOCK = re.compile(r"```sql\n-- name: ([a-z-]+)(?: \((sqlite|postgresql)\))?\n(.*?)\n```", re.S)


def queries(backend: str) -> dict[str, str]:
    """Name -> SQL for ``backend`` (``sqlite`` or ``postgresql``): shared queries plus its own form."""
    out: dict[str, str] = {}
    for name, dialect, sql in _BLOCK.findall(DOC.read_text()):
        if not dialect or dialect == backend:
            out[name] = sql
    return out
