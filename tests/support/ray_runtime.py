"""A real local Ray cluster on the CPU for one test module (RAY_AUTH_MODE disabled, a short temp dir,
two CPUs, this checkout on the workers' PYTHONPATH), as ``tests/workers/executor/conftest.py`` starts
one for its session. A runtime someone else already started is borrowed and left running.

A module makes it a fixture: ``ray_runtime = pytest.fixture(scope="module")(local_ray)``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[default]>=2.9,<3')")
    if ray.is_initialized():
        yield ray
        return
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray workers inherit the driver's environment: let them import this checkout.
    paths = [REPO_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Ray's socket paths live under the temp dir and must stay short (AF_UNIX limit).
    temp_dir = tempfile.mkdtemp(prefix="tlray-", dir="/tmp")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
