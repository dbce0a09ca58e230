"""``executor: ray`` services on a real local Ray cluster, both journal backends: the service is placed
on a Ray node through an actor, ``{host}`` in its endpoint is that node's address and reaches its
dependents, its log is read back into ``run_dir/SERVICE.log``, a SIGKILL of it rebuilds the stack, and
when its owner lets go (here: the stack's task ends) the actor goes and the guard takes the group
with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from engine.config import Settings
from engine.runtime.clock import SystemClock
from engine.runtime.service import open_journal
from engine.workflows.deployment.plan import Plan
from engine.config.deployment import DeploymentSettingsModel
from engine.workflows.deployment.stack import Stack

from tests.support.ray_runtime import local_ray
from tests.engine.workflows.deployment.test_recovery import rows, until, writer
from tests.engine.workflows.deployment.test_stack import gone_soon, service

pytestmark = pytest.mark.slow


#: A real local Ray cluster for this module (tests/support/ray_runtime.py).
ray_runtime = pytest.fixture(scope="module")(local_ray)


async def test_a_ray_service_runs_on_its_node_and_is_rebuilt_and_released(ray_runtime: Any, journal_url: str,
                                                                        tmp_path: Path) -> None:
    node = ray_runtime.util.get_node_ip_address()
    a = service(tmp_path, "a", "--child", executor="ray", ray={"num_cpus": 0})
    # The guard on the node serves on every address; the endpoint names the node.
    a["command"] += ["--bind", "0.0.0.0"]
    settings = DeploymentSettingsModel.model_validate({
        "run_dir": str(tmp_path / "run"), "recovery": {"delays_s": [0.1]}, "health": {"interval_s": None},
        "services": {"a": a, "b": service(tmp_path, "b", "${endpoints.a}", depends_on=["a"])}})
    journal = open_journal(Settings.model_validate({"journal": {"url": journal_url}}))
    stack = Stack(Plan.build(settings), "test-owner", SystemClock())
    task = asyncio.create_task(stack.run(writer(journal)))
    try:
        await until(lambda: stack.state == "ready", "ready", timeout=90)
        found = await rows(journal)
        port = a["endpoint"].rsplit(":", 1)[1]
        assert found["a"]["executor"] == "ray" and found["a"]["host"] == node
        assert found["a"]["endpoint"] == f"http://{node}:{port}"
        b = json.loads((tmp_path / "b.json").read_text())
        assert b["argv"][-1] == f"http://{node}:{port}"
        # Every service of a stack that uses Ray is told which cluster (RAY_ADDRESS).
        address = ray_runtime.get_runtime_context().gcs_address
        assert json.loads((tmp_path / "run" / "b.config.json").read_text())["env"]["RAY_ADDRESS"] == address
        first = json.loads((tmp_path / "a.json").read_text())
        worker = json.loads((tmp_path / "run" / "a.worker.json").read_text())
        assert worker["executor"] == "ray" and worker["host"] == node and worker["pids"]["service"] == first["pid"]
        await until(lambda: "service up" in (tmp_path / "run" / "a.log").read_text(), "the node's log read back")
        # Its death rebuilds the stack (a local cluster: the pid is on this machine, for the test only).
        os.kill(first["pid"], signal.SIGKILL)
        await until(lambda: stack.state != "ready", "the failure seen")
        await until(lambda: stack.state == "ready", "ready again", timeout=90)
        second = json.loads((tmp_path / "a.json").read_text())
        assert second["pid"] != first["pid"] and (await rows(journal))["a"]["restarts"] == 1
        assert gone_soon([first["pid"], first["child"]]) == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await journal.dispose()
    # The owner let go without a stop: the actor was killed and its guard took the group.
    assert gone_soon([second["pid"], second["child"]], 20) == [], "a ray service outlived its owner's stack"


def test_a_ray_service_dies_with_the_orchestrator_that_owns_it(ray_runtime: Any, tmp_path: Path) -> None:
    """``tidelog serve``, a driver of the test's Ray cluster, owns a ray service; SIGKILL of serve:
    Ray kills the actor it created, and the guard kills the service's group (the owner's death is
    the journal's business only through the rows: one backend is enough)."""
    from tests.engine.workflows.deployment.test_stack import serve, wait_stack  # noqa: PLC0415
    from tests.support.databases import migrate, sqlite_url  # noqa: PLC0415

    url = sqlite_url(tmp_path / "journal.db")
    migrate(url)
    a = service(tmp_path, "a", "--child", "--bind", "0.0.0.0", executor="ray")
    os.environ["RAY_ADDRESS"] = ray_runtime.get_runtime_context().gcs_address
    try:
        with serve(url, tmp_path, {"a": a}) as info:
            wait_stack(info, "ready", timeout=90)
            record = json.loads((tmp_path / "a.json").read_text())
            info["proc"].send_signal(signal.SIGKILL)
            info["proc"].wait(10)
            assert gone_soon([record["pid"], record["child"]], 30) == [], "a ray service outlived its owner"
    finally:
        os.environ.pop("RAY_ADDRESS", None)
