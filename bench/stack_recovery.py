"""The deployment's service stack: its start-up time, and the time from a component's death to
readiness restored (issue 17).

The stack is the reference fleet as services of :class:`engine.workflows.deployment.stack.Stack`,
run in this process over a SQLite journal: the four reference participants (``model``,
``resources``, ``agent`` after ``model``, ``environment`` after ``agent`` and ``resources``), a
reference inference engine (``engine``) and the reference trainer served over HTTP (``trainer``,
``python -m workers.executor.serve``), each with a readiness check, under the process guard.

- **start-up**: from the stack's first write to every service ``ready`` (the peer figure: what a
  rebuild is compared with).
- **recovery of X**: from the SIGKILL of X's process to the stack ``ready`` again. The rebuild
  stops every other service (SIGTERM, dependents first, each group confirmed gone), then brings the
  whole stack up again. The policy's delay is set to 0 here, so the figure is the mechanism alone;
  the configured delay (default 1, 2, 4 s) adds to it.

The trainer's figure is the stack's: its service serving again. An orchestrator's trainer host
then builds a new ``http`` executor at its next sync point, after its own restart delay
(``training.recovery``, docs/training.md); that part is not in the figure.

    .venv/bin/python bench/stack_recovery.py            # 3 kills of each component, ~2.5 min
    .venv/bin/python bench/stack_recovery.py --quick    # 1 kill of each

The run ends with one JSON line holding every figure (seconds; medians over the kills).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import Settings  # noqa: E402
from engine.demos.ports import free_port  # noqa: E402
from engine.runtime.clock import SystemClock  # noqa: E402
from engine.runtime.service import open_journal  # noqa: E402
from engine.workflows.deployment.plan import Plan  # noqa: E402
from engine.config.deployment import DeploymentSettingsModel  # noqa: E402
from engine.workflows.deployment.stack import Stack  # noqa: E402
from journal import WriteTx, schema  # noqa: E402
from workers.policy import Policy, save_weights  # noqa: E402

TOKEN = "bench-stack-token"
READY = [sys.executable, "-c", "import os, urllib.request as u; u.urlopen(u.Request(os.environ['STATUS'], "
                               "headers={'Authorization': 'Bearer ' + os.environ['TIDELOG_CONTROL_TOKEN']}), timeout=2)"]
VICTIMS = ("engine", "environment", "model", "trainer")


def services(tmp: Path, initial: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ports = {k: free_port() for k in ("engine", "model", "resources", "agent", "environment", "trainer")}
    # The trainer as a service: one rank served over HTTP (the http executor's far side).
    out["trainer"] = {"command": [sys.executable, "-m", "workers.executor.serve", "--port", str(ports["trainer"]),
                                  "--worker", "workers.trainer.worker:Trainer",
                                  "--kwargs", json.dumps({"seed": 0, "state_dir": str(tmp / "state" / "trainer")})],
                      "cwd": str(ROOT), "endpoint": f"http://{{host}}:{ports['trainer']}",
                      "readiness": {"http": "${endpoints.trainer}/health", "interval_s": 0.05}}
    out["engine"] = {"command": [sys.executable, "-m", "workers.inference.reference", "--port", str(ports["engine"]),
                                 "--model-dir", str(initial)],
                     "cwd": str(ROOT), "endpoint": f"http://{{host}}:{ports['engine']}",
                     "readiness": {"http": "${endpoints.engine}/get_weight_version", "interval_s": 0.05}}
    wiring = {"model": ["--engine", "${endpoints.engine}"], "resources": [],
              "agent": ["--model", "${endpoints.model}"],
              "environment": ["--agent", "${endpoints.agent}", "--resources", "${endpoints.resources}"]}
    deps = {"model": ["engine"], "agent": ["model"], "environment": ["agent", "resources"]}
    for kind, extra in wiring.items():
        out[kind] = {"command": [sys.executable, "-m", f"workers.reference.{kind}", "--port", str(ports[kind]),
                                 "--state-dir", str(tmp / "state" / kind), *extra],
                     "cwd": str(ROOT), "depends_on": deps.get(kind, []), "endpoint": f"http://{{host}}:{ports[kind]}",
                     "env": {"TIDELOG_CONTROL_TOKEN": "${env.TIDELOG_CONTROL_TOKEN}",
                             "STATUS": f"${{endpoints.{kind}}}/ng-control/v1/checkpoint/status"},
                     "readiness": {"command": READY, "interval_s": 0.05}}
    return out


async def until(check: Callable[[], bool], timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError("the stack did not get there in time")
        await asyncio.sleep(0.005)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["TIDELOG_CONTROL_TOKEN"] = TOKEN
    with tempfile.TemporaryDirectory(prefix="tidelog-stack-bench-") as d:
        tmp = Path(d)
        initial = tmp / "initial"
        save_weights(Policy(seed=0), initial, "initial")
        url = f"sqlite+aiosqlite:///{tmp / 'journal.db'}"
        await asyncio.to_thread(schema.upgrade, url)
        settings = DeploymentSettingsModel.model_validate({
            "run_dir": str(tmp / "run"), "stop_grace_s": 5,
            "recovery": {"max_restarts": 100, "delays_s": [0]}, "health": {"interval_s": None},
            "services": services(tmp, initial)})
        journal = open_journal(Settings.model_validate({"journal": {"url": url}}))

        async def write(step: Callable[[WriteTx], Awaitable[Any]]) -> Any:
            async with journal.write() as tx:
                return await step(tx)

        stack = Stack(Plan.build(settings), "bench", SystemClock())
        t0 = time.perf_counter()
        task = asyncio.create_task(stack.run(write))
        figures: dict[str, Any] = {}
        try:
            await until(lambda: stack.state == "ready")
            figures["startup_s"] = time.perf_counter() - t0
            print(f"  stack start-up (6 services, 4 levels)     {figures['startup_s']:6.2f} s", flush=True)
            for victim in VICTIMS:
                times = []
                for _ in range(args.kills):
                    await asyncio.sleep(0.5)
                    pid = stack.procs[victim].pid
                    t = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)
                    await until(lambda: stack.state != "ready")
                    await until(lambda: stack.state == "ready")
                    times.append(time.perf_counter() - t)
                figures[f"recovery_{victim}_s"] = statistics.median(times)
                figures[f"recovery_{victim}_runs"] = [round(x, 3) for x in times]
                ratio = figures[f"recovery_{victim}_s"] / figures["startup_s"]
                print(f"  death of {victim:<12} -> ready again     {figures[f'recovery_{victim}_s']:6.2f} s "
                      f"(median of {len(times)}; {ratio:.2f}x start-up)", flush=True)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await journal.dispose()
    figures.update({"kills": args.kills, "python": platform.python_version(), "cpus": os.cpu_count()})
    return figures


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="kills of each component (default 3)")
    p.add_argument("--quick", action="store_true", help="one kill of each")
    a = p.parse_args()
    if a.quick:
        a.kills = 1
    print("tidelog stack recovery (reference fleet as services; SQLite journal)")
    result = asyncio.run(main(a))
    print(json.dumps(result))
