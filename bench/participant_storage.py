"""Participant checkpoint storage: commit and restore of many large sessions.

Figures (defaults: 1,000 sessions of ~350 KB each, like the seed's measurement):

- ``commit_s``: ``write_records`` — stream, hash, fsync, rename, fsync parents, publish the manifest;
- ``restore_s``: ``read_records`` of the whole file with every session in scope;
- ``restore_peak_mb`` / ``restore_bound_mb``: peak RSS growth of a restore that keeps 10 sessions
  in scope (measured in a fresh child process) against the target bound
  "2 × one record + the in-scope records", a record counted as what one parsed session
  costs in memory (tracemalloc);
- peer, in the same run: ``naive_commit_s`` / ``naive_restore_s`` — one ``json.dump`` of the whole
  list and one ``json.load`` (no hashing, no fsync, whole file in memory).

Targets on the 2-core machine: commit and restore ≤ 1.5 s each; restore peak below the bound.
The seed reports 3.6 s and 3.4 s for the same sizes on its hardware. Ends with one JSON line.

    .venv/bin/python bench/participant_storage.py [--sessions N] [--kb K]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.participant.storage import read_records, write_records  # noqa: E402

KIND, INSTANCE = "environment", "env-0"


def session(i: int, kb: int) -> dict[str, Any]:
    """A session record of about ``kb`` KB: token ids and a few nested fields."""
    tokens = [(i * 7919 + j) % 151_936 for j in range(kb * 1024 // 7)]
    return {"episode_id": {"rollout_id": f"r{i}", "attempt": 0},
            "state": {"turn": 3, "messages": [{"role": "user", "content": "x" * 64}], "tokens": tokens}}


def rss_hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def child_restore(directory: str, keep: int) -> None:
    """Run in a fresh process: peak RSS growth of a restore keeping ``keep`` sessions."""
    before = rss_hwm_kb()
    wanted = {f"r{i}" for i in range(keep)}
    _, kept = read_records(directory, KIND, INSTANCE,
                           lambda r: r if r["episode_id"]["rollout_id"] in wanted else None)
    assert len(kept) == keep
    print(json.dumps({"peak_growth_kb": rss_hwm_kb() - before}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--kb", type=int, default=350)
    p.add_argument("--child-restore", nargs=2, metavar=("DIR", "KEEP"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_restore:
        child_restore(args.child_restore[0], int(args.child_restore[1]))
        return 0
    with tempfile.TemporaryDirectory(prefix="tidelog-storage-") as raw:
        tmp = Path(raw)
        # The sessions exist before the clock starts: only storage is timed, on both sides.
        sessions = [session(i, args.kb) for i in range(args.sessions)]
        started = time.perf_counter()
        manifest = write_records(tmp / "ck", KIND, INSTANCE, "ck-1",
                                 ((f"r{i}", s) for i, s in enumerate(sessions)))
        commit_s = time.perf_counter() - started
        records_path = tmp / "ck" / "gym" / KIND / INSTANCE / manifest["records_file"]
        size_mb = records_path.stat().st_size / 2**20
        one_record_mb = size_mb / args.sessions

        started = time.perf_counter()
        _, kept = read_records(tmp / "ck", KIND, INSTANCE, lambda r: r)
        restore_s = time.perf_counter() - started
        assert len(kept) == args.sessions
        del kept

        keep = 10
        # "One record" in memory: what one parsed session costs as Python objects.
        tracemalloc.start()
        with open(records_path, "rb") as src:
            parsed = json.loads(src.readline())
        one_record_mem_mb = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        del parsed
        out = subprocess.run([sys.executable, __file__, "--child-restore", str(tmp / "ck"), str(keep)],
                             capture_output=True, text=True, check=True)
        peak_mb = json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_kb"] / 1024
        bound_mb = (2 + keep) * one_record_mem_mb

        naive = tmp / "naive.json"
        started = time.perf_counter()
        with open(naive, "w") as f:
            json.dump(sessions, f)
        naive_commit_s = time.perf_counter() - started
        started = time.perf_counter()
        with open(naive) as f:
            assert len(json.load(f)) == args.sessions
        naive_restore_s = time.perf_counter() - started
        os.remove(naive)
        del sessions

    figures = {"sessions": args.sessions, "record_kb": round(one_record_mb * 1024, 1),
               "file_mb": round(size_mb, 1), "commit_s": round(commit_s, 3), "restore_s": round(restore_s, 3),
               "restore_peak_mb": round(peak_mb, 1), "restore_bound_mb": round(bound_mb, 1),
               "naive_commit_s": round(naive_commit_s, 3), "naive_restore_s": round(naive_restore_s, 3),
               "commit_vs_naive": round(commit_s / naive_commit_s, 2),
               "restore_vs_naive": round(restore_s / naive_restore_s, 2),
               "commit_target_met": commit_s <= 1.5, "restore_target_met": restore_s <= 1.5,
               "memory_target_met": peak_mb < bound_mb}
    print(f"commit  {commit_s:6.2f} s  (naive json.dump {naive_commit_s:.2f} s), target <= 1.5 s")
    print(f"restore {restore_s:6.2f} s  (naive json.load {naive_restore_s:.2f} s), target <= 1.5 s")
    print(f"restore peak {peak_mb:.1f} MB keeping 10 of {args.sessions} ({size_mb:.0f} MB file), "
          f"bound {bound_mb:.1f} MB")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
