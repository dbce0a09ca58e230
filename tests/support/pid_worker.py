"""A worker with nothing but a health call that names its process: what the trainer host's restart
tests start and SIGKILL many times (a real spawned process, without the seconds torch takes to import)."""

from __future__ import annotations

import os
from typing import Any


class PidWorker:
    def health(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "step": 0}
