"""DBOS peer for the journal-throughput benchmark.

This module measures how fast DBOS Transact (the ``dbos`` package) journals
workflow steps into its *system database*, so Tidelog's own figures can be set
beside a well-known durable-execution library on the same machine and the same
storage engines (SQLite and PostgreSQL).

Two figures are measured, both with DBOS's default durability settings (no
fsync, ``synchronous`` or ``synchronous_commit`` changes; DBOS's own defaults
for pool size, SQLite pragmas and isolation are left alone):

``sequential_steps_per_s``
    One workflow runs ``seq_steps`` sequential no-op ``@DBOS.step()`` calls.
    DBOS writes one checkpoint row per step before returning from it, so this
    is the rate of durable step commits on a single thread of control:
    ``seq_steps / wall time of that workflow``.  DBOS launch and a small
    warm-up workflow are excluded from the timing.

``concurrent_workflows_per_s`` / ``concurrent_steps_per_s``
    ``n_workflows`` workflows, each of which calls one no-op step, run with at
    most ``concurrency`` in flight.  Timed from the first start to the last
    result retrieved; the figure is ``n_workflows / wall time``.  Each workflow
    has exactly one step, so the step rate equals the workflow rate; both names
    are reported so the figures are explicit.  A workflow costs DBOS more than
    a step (it writes a status row on start, the step row, and the result).

DBOS keeps process-global state (one ``DBOS`` instance per process, a global
registry of decorated functions), and launching it twice in one process is
fragile.  :func:`measure` therefore runs every measurement in a fresh child
interpreter (``python bench/_dbos_peer.py --backend ... --url ...``) and
parses the single JSON line the child prints on stdout.

Importing this module has no side effects and does not import ``dbos``; only
the child code path (:func:`run_child`) does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["BACKENDS", "measure", "run_child", "main"]

#: Storage engines DBOS's system database can use, as accepted by ``--backend``.
BACKENDS: Final[tuple[str, ...]] = ("sqlite", "postgresql")

#: Number of steps in the untimed warm-up workflow.
_WARMUP_STEPS: Final[int] = 20

class DBOSPeerError(RuntimeError):
    """The DBOS child process failed (launch error, crash, bad output, timeout)."""


def _check_args(backend: str, url: str, seq_steps: int, n_workflows: int, concurrency: int) -> None:
    """Reject arguments that would make the measurement meaningless."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    expected_scheme = "sqlite" if backend == "sqlite" else "postgresql"
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme != expected_scheme:
        raise ValueError(f"url {url!r} does not match backend {backend!r}")
    counts = (("seq_steps", seq_steps), ("n_workflows", n_workflows), ("concurrency", concurrency))
    for name, value in counts:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def measure(
    backend: str,
    url: str,
    *,
    seq_steps: int,
    n_workflows: int,
    concurrency: int,
    timeout_s: float = 600.0,
) -> dict[str, float | str]:
    """Measure DBOS's journal throughput in a fresh subprocess.

    ``backend`` is ``"sqlite"`` or ``"postgresql"``; ``url`` is the SQLAlchemy
    URL of DBOS's system database (``sqlite:///<fresh file>`` or
    ``postgresql://postgres@127.0.0.1:5432/<fresh db>``).  The caller owns the
    database: it should be fresh, and the caller drops it afterwards.

    Returns the child's figures:

    * ``sequential_steps_per_s`` -- ``seq_steps`` sequential no-op steps in one
      workflow, divided by that workflow's wall time (launch and warm-up
      excluded).
    * ``concurrent_workflows_per_s`` -- ``n_workflows`` one-step workflows with
      ``concurrency`` in flight, divided by the wall time from the first start
      to the last result.
    * ``concurrent_steps_per_s`` -- the same wall time, counting steps (equal to
      the workflow rate, one step per workflow).
    * ``sequential_wall_s``, ``concurrent_wall_s``, ``launch_s`` -- the raw
      times in seconds; ``seq_steps``, ``n_workflows``, ``concurrency`` -- the
      parameters, echoed as floats.
    * ``dbos_version`` -- the installed ``dbos`` version (a string; the only
      non-float value).

    Raises :class:`DBOSPeerError` with the child's stderr if the child fails
    (for instance when DBOS cannot launch against ``url``) or exceeds
    ``timeout_s``.
    """
    _check_args(backend, url, seq_steps, n_workflows, concurrency)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--backend",
        backend,
        "--url",
        url,
        "--seq-steps",
        str(seq_steps),
        "--workflows",
        str(n_workflows),
        "--concurrency",
        str(concurrency),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr
        stderr = err.decode(errors="replace") if isinstance(err, bytes) else err or ""
        raise DBOSPeerError(
            f"DBOS peer timed out after {timeout_s:.0f}s ({backend}).\n{stderr[-4000:]}"
        ) from exc
    if proc.returncode != 0:
        # Lead with the child's one-line summaries (launch failure, final error),
        # then the tail of its stderr (DBOS's own log and the traceback).
        summary = [
            line
            for line in proc.stderr.splitlines()
            if line.startswith(("DBOS launch failed", "DBOS peer failed"))
        ]
        raise DBOSPeerError(
            f"DBOS peer failed ({backend}, exit code {proc.returncode}).\n"
            + "".join(line + "\n" for line in summary)
            + f"--- child stderr (tail) ---\n{proc.stderr[-4000:]}"
        )
    return _parse_result(proc.stdout, proc.stderr)


def _parse_result(stdout: str, stderr: str) -> dict[str, float | str]:
    """Extract the child's result dict from its stdout."""
    # The result is the last stdout line that is a JSON object (DBOS logs to
    # stderr, but be robust to anything else a library might print).
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            raw: Any = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(raw, dict) and "sequential_steps_per_s" in raw:
            out: dict[str, float | str] = {}
            for key, value in raw.items():
                out[str(key)] = value if isinstance(value, str) else float(value)
            return out
    raise DBOSPeerError(
        "DBOS peer printed no result line.\n"
        f"--- child stdout (tail) ---\n{stdout[-2000:]}\n"
        f"--- child stderr (tail) ---\n{stderr[-2000:]}"
    )


def run_child(
    backend: str, url: str, *, seq_steps: int, n_workflows: int, concurrency: int
) -> dict[str, float | str]:
    """Run the measurement in *this* process (call it only in a fresh interpreter).

    Launches DBOS against ``url`` with its default durability settings, runs
    an untimed warm-up, then the sequential and concurrent measurements, checks
    that every timed workflow and step was journalled, destroys DBOS and
    returns the figures.  DBOS's console log level is raised to WARNING so its
    INFO start-up chatter does not drown the output; this changes nothing about
    what it writes to the database.
    """
    _check_args(backend, url, seq_steps, n_workflows, concurrency)

    from concurrent.futures import ThreadPoolExecutor
    from importlib.metadata import version

    from dbos import DBOS, DBOSConfig, SetWorkflowID

    dbos_version = version("dbos")
    config: DBOSConfig = {
        "name": "tidelog-bench-dbos-peer",
        "system_database_url": url,
        "log_level": "WARNING",
    }

    DBOS(config=config)

    @DBOS.step()
    def noop_step() -> None:
        """A step that does nothing: all its cost is DBOS's checkpoint."""
        return None

    @DBOS.workflow()
    def sequential_workflow(n_steps: int) -> int:
        """Run ``n_steps`` no-op steps one after another."""
        for _ in range(n_steps):
            noop_step()
        return n_steps

    @DBOS.workflow()
    def one_step_workflow() -> int:
        """Run a single no-op step."""
        noop_step()
        return 1

    t0 = time.perf_counter()
    try:
        DBOS.launch()
    except BaseException as exc:
        print(
            f"DBOS launch failed for backend={backend} url={url}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        raise
    launch_s = time.perf_counter() - t0

    try:
        # Warm-up (untimed): first connections, prepared statements, imports.
        sequential_workflow(_WARMUP_STEPS)
        for _ in range(min(concurrency, 8)):
            DBOS.start_workflow(one_step_workflow).get_result()

        # Sequential: one workflow, seq_steps durable steps.
        seq_id = "bench-seq-main"
        t0 = time.perf_counter()
        with SetWorkflowID(seq_id):
            got = sequential_workflow(seq_steps)
        sequential_wall_s = time.perf_counter() - t0
        if got != seq_steps:
            raise RuntimeError(f"sequential workflow returned {got}, expected {seq_steps}")

        # Concurrent: n_workflows one-step workflows, at most `concurrency` in flight.
        #
        # Strategy: a ThreadPoolExecutor of `concurrency` threads, each calling
        # DBOS.start_workflow(...).get_result().  This keeps exactly
        # `concurrency` workflows in flight.  Alternatives measured on the
        # 2-core bench machine (500-1000 workflows, concurrency 32) were no
        # better:
        # * starting all n workflows from the pool and collecting the handles
        #   afterwards hands every workflow to DBOS's executor, which has no
        #   thread limit by default, so up to n threads contend for 2 cores
        #   and the DB pool (20 connections): same or lower rate;
        # * calling the workflow function directly from the pool threads:
        #   about the same rate as this strategy;
        # * a DBOS queue (register_queue with worker_concurrency=concurrency)
        #   adds enqueue/dequeue transactions and polling: roughly 20% slower
        #   even with a 50 ms polling interval.
        def run_one(i: int) -> int:
            with SetWorkflowID(f"bench-conc-{i:07d}"):
                handle = DBOS.start_workflow(one_step_workflow)
            return handle.get_result()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-") as pool:
            total = sum(pool.map(run_one, range(n_workflows)))
        concurrent_wall_s = time.perf_counter() - t0
        if total != n_workflows:
            raise RuntimeError(f"concurrent workflows returned {total}, expected {n_workflows}")

        # Untimed check that the work really was journalled.
        seq_recorded = len(DBOS.list_workflow_steps(seq_id, load_output=False))
        if seq_recorded != seq_steps:
            raise RuntimeError(
                f"DBOS recorded {seq_recorded} steps for the sequential workflow, "
                f"expected {seq_steps}"
            )
        done = DBOS.list_workflows(
            workflow_id_prefix="bench-conc-", status="SUCCESS", load_input=False, load_output=False
        )
        if len(done) != n_workflows:
            raise RuntimeError(
                f"DBOS recorded {len(done)} successful concurrent workflows, "
                f"expected {n_workflows}"
            )
    finally:
        DBOS.destroy(destroy_registry=True)

    return {
        "sequential_steps_per_s": seq_steps / sequential_wall_s,
        "concurrent_workflows_per_s": n_workflows / concurrent_wall_s,
        "concurrent_steps_per_s": n_workflows / concurrent_wall_s,
        "sequential_wall_s": sequential_wall_s,
        "concurrent_wall_s": concurrent_wall_s,
        "launch_s": launch_s,
        "seq_steps": float(seq_steps),
        "n_workflows": float(n_workflows),
        "concurrency": float(concurrency),
        "dbos_version": dbos_version,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: run the child measurement and print one JSON result line."""
    parser = argparse.ArgumentParser(
        description="DBOS peer of the Tidelog journal-throughput benchmark"
    )
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of DBOS's system database")
    parser.add_argument("--seq-steps", type=int, default=2000)
    parser.add_argument("--workflows", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        result = run_child(
            args.backend,
            args.url,
            seq_steps=args.seq_steps,
            n_workflows=args.workflows,
            concurrency=args.concurrency,
        )
    except Exception as exc:  # report clearly, then fail
        import traceback

        traceback.print_exc(file=sys.stderr)
        print(f"DBOS peer failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
