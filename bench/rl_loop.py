"""The whole RL loop end to end: rollouts per second through dispatch -> batch -> job -> publication.

Each side has its own four reference participants (the model generating every action on the
side's own reference engine, the resources server scoring ``letter:s``), its own reference engine
serving ``Policy(seed=0)`` and its own reference trainer (``uni``: in this process). One round is
``--batch`` rollouts of ``--turns`` turns, trained as one job whose weights are published before
the next round's rollouts start; rounds of the two sides alternate.

- **Tidelog**: an in-process :class:`~engine.runtime.service.Orchestrator` over a SQLite journal
  (WAL, ``synchronous=FULL``), with rollouts and ``training.batching`` (size ``--batch``,
  ``max_staleness`` 0, ``workers.reference.samples:episode``). A round is timed from just before the
  write that submits its rollouts to the commit of its job's ``COMPLETE`` (a commit listener's
  stamp): dispatch, the episodes, the batch and job write, training, checkpoint, publication.
- **Peer** (no journal, no reconciler): the same episodes as ``POST /run`` to its environment server,
  all at once; the samples by the same function; ``train``, ``save_checkpoint`` and
  ``verify_checkpoint`` on its trainer; then pause the engine, ``prepare_weights``,
  ``update_weights_from_disk``, ``weight_version``, ``continue_generation``.

``rollouts/s = batch / median round time``; the ratio is Tidelog's over the peer's. Both sides' first
round is not timed. Each round is also split in phases (medians printed): ``episodes`` (to the last
episode's end: for Tidelog the commit of its last ``finished``), ``batch`` (to the job: the commit of
its ``RUNNING``, the batch's write; the peer builds its samples), ``train`` (train, checkpoint, verify:
to ``CHECKPOINT``) and ``publish`` (to ``COMPLETE``).

    .venv/bin/python bench/rl_loop.py                 # 10 timed rounds of 8 rollouts, ~1 min
    .venv/bin/python bench/rl_loop.py --quick         # 3 rounds

The run ends with one JSON line holding every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _databases import Database  # noqa: E402  (bench/, the script's folder)
from engine.config import Settings  # noqa: E402
from engine.demos.checkpoint import KINDS, Fleet, until_up  # noqa: E402
from engine.demos.ports import free_port  # noqa: E402
from engine.runtime.service import Orchestrator  # noqa: E402
from engine.workflows.checkpoint.rollout_tasks import check_task, submit_rollouts  # noqa: E402
from journal import Committed, models  # noqa: E402
from workers.executor import Executor, ExecutorConfig, WorkerSpec  # noqa: E402
from workers.inference.sglang import SGLangConfig, SGLangEngine  # noqa: E402
from workers.reference.samples import episode  # noqa: E402


class Side(Fleet):
    """One side's participants and engine (processes on loopback)."""

    def __init__(self, workdir: Path, token: str) -> None:
        super().__init__(workdir, token)
        self.ports["engine"] = free_port()

    async def start(self, http: aiohttp.ClientSession, weights: Path) -> None:
        self._spawn("engine", ["-m", "workers.inference.reference", "--port", str(self.ports["engine"]),
                               "--model-dir", str(weights)])
        await until_up(http, self.url("engine") + "/get_weight_version", 60)
        extra = {"agent": ["--model", self.url("model")],
                 "environment": ["--agent", self.url("agent"), "--resources", self.url("resources")],
                 "model": ["--engine", self.url("engine")], "resources": ["--task", "letter:s"]}
        for kind in KINDS:
            self._spawn(kind, ["-m", f"workers.reference.{kind}", "--port", str(self.ports[kind]),
                               "--state-dir", str(self.workdir / "state" / kind), *extra[kind]])
        for kind in KINDS:
            await until_up(http, self.url(kind) + "/ng-control/v1/checkpoint/status")


def tasks(side: str, r: int, n: int, turns: int) -> dict[str, dict[str, Any]]:
    return {f"{side}-{r}-{k}": {"prompt": f"round {r} task {k}", "turns": turns} for k in range(n)}


class Tidelog:
    def __init__(self, side: Side, url: str, token: str, tmp: Path, initial: Path, batch: int) -> None:
        self.settings = Settings.model_validate({
            "journal": {"url": url},
            "orchestrator": {"shutdown_grace_s": 2},
            "control": {"token": token},
            "discovery": {"probe_timeout_s": 2, "interval_s": 5},
            "participants": [{"name": f"{k}-0", "url": side.url(k)} for k in KINDS],
            "logging": {"level": "WARNING"},
            "training": {"enabled": True, "executor": "uni", "deployment": "bench",
                         "trainer": {"seed": 0, "state_dir": str(tmp / "trainer")},
                         "checkpoint_dir": str(tmp / "checkpoints"), "weights_dir": str(tmp / "weights"),
                         "initial_weights": str(initial), "engines": [{"name": "e0", "url": side.url("engine")}],
                         "batching": {"enabled": True, "size": batch, "max_staleness": 0,
                                      "sample": "workers.reference.samples:episode"}}})
        self.orch = Orchestrator(self.settings)
        self.complete: dict[str, float] = {}
        # Commit stamps of the round under way: the last rollout finished, the job's states.
        self.finished = 0.0
        self.job_at: dict[str, dict[str, float]] = {}

    def listen(self, committed: Sequence[Committed]) -> None:
        now = time.perf_counter()
        for c in committed:
            if c.kind == "rollouts" and c.to_state == "finished" and c.from_state == "dispatched":
                self.finished = now
            elif c.kind == "training_jobs":
                self.job_at.setdefault(c.entity_id, {}).setdefault(c.to_state, now)
                if c.to_state == "COMPLETE":
                    self.complete[c.entity_id] = now

    async def start(self) -> None:
        await self.orch.start()
        self.orch.journal.add_commit_listener(self.listen)
        while not (self.orch.is_leader and self.orch.working()):
            await asyncio.sleep(0.02)

    async def round(self, r: int, n: int, turns: int) -> dict[str, float]:
        """The round's phases (s): ``episodes`` (submit to the last rollout's finished commit),
        ``batch`` (to the job's RUNNING commit), ``train`` (to CHECKPOINT), ``publish`` (to COMPLETE),
        and ``total``."""
        batch = tasks("t", r, n, turns)
        checked = [check_task({"rollout_id": rid, "input": t}, i) for i, (rid, t) in enumerate(batch.items())]

        async def write(tx: Any) -> None:
            await submit_rollouts(tx, checked)
        t0 = time.perf_counter()
        await self.orch.committer.run(write)
        first = next(iter(batch))
        t = models.rollouts
        while True:
            async with self.orch.journal.read() as conn:
                held = (await conn.execute(sa.select(t.c.batch_id).where(t.c.id == first))).scalar()
                job = None if held is None else (await conn.execute(sa.select(models.training_batches.c.job_id)
                                                 .where(models.training_batches.c.id == held))).scalar()
            if job is not None and job in self.complete:
                at = self.job_at[job]
                return {"episodes": self.finished - t0, "batch": at["RUNNING"] - self.finished,
                        "train": at["CHECKPOINT"] - at["RUNNING"], "publish": at["COMPLETE"] - at["CHECKPOINT"],
                        "total": at["COMPLETE"] - t0}
            await asyncio.sleep(0.01)


class Peer:
    def __init__(self, side: Side, tmp: Path) -> None:
        self.side, self.tmp = side, tmp
        self.ranks = Executor.create(ExecutorConfig(backend="uni", workers=(WorkerSpec(
            "workers.trainer.worker:Trainer", kwargs={"seed": 0, "state_dir": str(tmp / "peer-trainer")}),)))
        self.engine = SGLangEngine(SGLangConfig(url=side.url("engine"), timeout=60))
        self.version = 0

    def call(self, method: str, *args: Any) -> Any:
        return self.ranks.rpc(0, method, args, None, 120.0)

    async def round(self, http: aiohttp.ClientSession, r: int, n: int, turns: int) -> dict[str, float]:
        """The same phases as Tidelog's (``batch``: building the samples)."""
        batch = tasks("p", r, n, turns)
        t0 = time.perf_counter()

        async def run(rid: str, task: dict[str, Any]) -> dict[str, Any]:
            async with http.post(self.side.url("environment") + "/run",
                                 json={"rollout_id": rid, "task": task}) as resp:
                resp.raise_for_status()
                return dict(await resp.json())
        results = await asyncio.gather(*(run(rid, task) for rid, task in batch.items()))
        t1 = time.perf_counter()
        samples = [episode({"id": rid, "task": task, "result": result, "weight_version": None})
                   for (rid, task), result in zip(sorted(batch.items()), results)]
        job_id = f"peer-{r}"
        t2 = time.perf_counter()
        await asyncio.to_thread(self.call, "train", {"job_id": job_id, "rollouts": samples})
        path = str(self.tmp / "peer-ckpt" / f"{job_id}.ckpt")
        await asyncio.to_thread(self.call, "save_checkpoint", path, job_id)
        await asyncio.to_thread(self.call, "verify_checkpoint", path)
        t3 = time.perf_counter()
        self.version += 1
        version, directory = f"peer:{self.version}", str(self.tmp / "peer-weights" / str(self.version))
        await self.engine.pause_generation("retract")
        await asyncio.to_thread(self.call, "prepare_weights", {"version": version, "directory": directory})
        await self.engine.update_weights_from_disk(directory, version)
        if await self.engine.weight_version() != version:
            raise RuntimeError("the peer's engine does not serve its version")
        await self.engine.continue_generation()
        t4 = time.perf_counter()
        return {"episodes": t1 - t0, "batch": t2 - t1, "train": t3 - t2, "publish": t4 - t3, "total": t4 - t0}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.policy import Policy, save_weights
    with tempfile.TemporaryDirectory(prefix="tidelog-rl-loop-") as name:
        tmp = Path(name)
        initial = tmp / "initial"
        save_weights(Policy(seed=0), initial, "initial")
        token = secrets.token_urlsafe(16)
        sides = {"tidelog": Side(tmp / "tidelog", token), "peer": Side(tmp / "peer", token)}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
                for side in sides.values():
                    await side.start(http, initial)
                async with Database("sqlite", tmp, "tidelog_rl_loop") as url:
                    tidelog = Tidelog(sides["tidelog"], url, token, tmp, initial, args.batch)
                    peer = Peer(sides["peer"], tmp)
                    await tidelog.start()
                    times: dict[str, list[dict[str, float]]] = {"tidelog": [], "peer": []}
                    for r in range(args.rounds + 1):
                        t = await tidelog.round(r, args.batch, args.turns)
                        p = await peer.round(http, r, args.batch, args.turns)
                        if r > 0:  # the first round of each side is not timed
                            times["tidelog"].append(t)
                            times["peer"].append(p)
                        print(f"  round {r}: tidelog {t['total'] * 1000:7.1f} ms, peer {p['total'] * 1000:7.1f} ms",
                              flush=True)
                    await tidelog.orch.stop()
                    await peer.engine.close()
                    peer.ranks.shutdown()
        finally:
            for side in sides.values():
                side.stop_all()
    phases = ("episodes", "batch", "train", "publish")
    med = {k: statistics.median(x["total"] for x in v) for k, v in times.items()}
    per_phase = {k: {ph: round(statistics.median(x[ph] for x in v) * 1000, 1) for ph in phases}
                 for k, v in times.items()}
    rate = {k: args.batch / v for k, v in med.items()}
    return {"bench": "rl_loop", "batch": args.batch, "turns": args.turns, "rounds": args.rounds,
            "tidelog_round_ms": round(med["tidelog"] * 1000, 1), "peer_round_ms": round(med["peer"] * 1000, 1),
            "tidelog_phases_ms": per_phase["tidelog"], "peer_phases_ms": per_phase["peer"],
            "tidelog_rollouts_per_s": round(rate["tidelog"], 2), "peer_rollouts_per_s": round(rate["peer"], 2),
            "ratio": round(rate["tidelog"] / rate["peer"], 3),
            "overhead_ms_per_round": round((med["tidelog"] - med["peer"]) * 1000, 1),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per side (default 10)")
    p.add_argument("--batch", type=int, default=8, help="rollouts per round, the batch size (default 8)")
    p.add_argument("--turns", type=int, default=3, help="turns per episode (default 3)")
    p.add_argument("--quick", action="store_true", help="3 timed rounds")
    args = p.parse_args()
    if args.quick:
        args.rounds = 3
    out = asyncio.run(run(args))
    print(f"rollouts/s through dispatch -> batch -> job -> publication ({args.batch} per round, {args.turns} turns): "
          f"tidelog {out['tidelog_rollouts_per_s']}, peer {out['peer_rollouts_per_s']} (ratio {out['ratio']}); "
          f"median round {out['tidelog_round_ms']} ms vs {out['peer_round_ms']} ms")
    print(f"phases (ms, median): tidelog {out['tidelog_phases_ms']}; peer {out['peer_phases_ms']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
