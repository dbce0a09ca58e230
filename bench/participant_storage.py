"""Participant checkpoint storage: commit and restore of many large sessions.

Two session shapes, each 1,000 sessions of ~350 KB by default (the seed's measurement):

- ``conversation`` — an agent or resources session as the protocol stores it: messages with text
  content, tool calls and results, a few numbers. Checkpoint records are token-free by design (the
  model's ledger rows carry no token arrays; "no token arrays in Gym manifests" is a stated
  non-goal), so this is the shape the targets are judged on;
- ``tokens`` — a worst case for a Python restore: the same size as one flat list of ~50,000 small
  integers (token ids), which materializes ~50 million int objects when every session is kept.

Figures per shape (prefixed ``conversation_`` / ``tokens_`` in the JSON line):

- ``commit_s``: ``write_records`` — stream, hash, fsync, rename, fsync parents, publish the manifest;
- ``restore_s``: ``read_records`` of the whole file with every session in scope (as a participant
  restore calls it: ``keys`` = the scope), and
  ``restore_page_faults``, the minor page faults it took (each one a fresh page of memory for the
  restored objects; on a VM whose host takes freed pages back, a costly one);
- ``restore_scan_s``: the same restore keeping 10 sessions: reading, hashing and verifying the
  whole file, parsing only the lines in scope;
- ``restore_peak_mb`` / ``restore_bound_mb``: peak RSS growth of a restore that keeps 10 sessions
  in scope (measured in a fresh child process, from its RSS once its peak is reset) against the
  target bound "2 × one record + the in-scope records", both terms measured the same way: the RSS
  growth of fresh children that only parse and keep one session (``one_record_rss_mb``) and the 10
  in-scope sessions (``restore_kept_rss_mb``). ``restore_bound_traced_mb`` is the same bound with
  tracemalloc's bytes (allocator overhead left out), for comparison;
- peer, in the same run: ``naive_commit_s`` / ``naive_restore_s`` — one ``json.dump`` of the whole
  list and one ``json.load`` (no hashing, no fsync, whole file in memory).

Targets on the 2-core machine: commit and restore ≤ 1.5 s each; restore peak below the bound.
The seed reports 3.6 s and 3.4 s for the same sizes on its hardware. Ends with one JSON line.

    .venv/bin/python bench/participant_storage.py [--sessions N] [--kb K] [--shape conversation|tokens|both]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.participant.storage import read_records, write_records  # noqa: E402

KIND, INSTANCE = "environment", "env-0"


WORDS = ("the", "agent", "calls", "a", "tool", "with", "arguments", "and", "reads", "its", "result", "then",
         "answers", "step", "file", "test", "passes", "fails", "patch", "diff", "error", "line", "value", "check")


def text(seed: int, size: int) -> str:
    words: list[str] = []
    length = 0
    n = seed
    while length < size:
        n = (n * 1103515245 + 12345) & 0x7FFFFFFF
        word = WORDS[n % len(WORDS)]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def conversation_session(i: int, kb: int) -> dict[str, Any]:
    """An agent session of about ``kb`` KB: turns of text, tool calls and tool results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(i, 2048)},
                                      {"role": "user", "content": text(i + 1, 4096)}]
    turn = 0
    while sum(len(m.get("content", "")) for m in messages) < kb * 1024:
        turn += 1
        messages.append({"role": "assistant", "content": text(i * 31 + turn, 1024), "tool_calls": [
            {"id": f"call-{i}-{turn}", "type": "function",
             "function": {"name": "run_tests", "arguments": json.dumps({"path": f"tests/t{turn}.py", "k": turn})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call-{i}-{turn}", "content": text(i * 17 + turn, 8192)})
    return {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "session_key": f"r{i}",
            "session": {"messages": messages, "turn": turn, "reward_so_far": 0.25 * (turn % 4), "done": False},
            "boundary": {"turns": turn}}


def tokens_session(i: int, kb: int) -> dict[str, Any]:
    """A session of about ``kb`` KB of token ids (the worst case for a Python restore)."""
    tokens = [(i * 7919 + j) % 151_936 for j in range(kb * 1024 // 7)]
    return {"episode_id": {"rollout_id": f"r{i}", "attempt": 0},
            "state": {"turn": 3, "messages": [{"role": "user", "content": "x" * 64}], "tokens": tokens}}


SHAPES = {"conversation": conversation_session, "tokens": tokens_session}


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> int:
    """Reset the peak RSS to the current RSS where Linux allows it; return the baseline to measure
    peak growth from: the current RSS, or (no reset) the peak so far, which hides any part of the
    growth below an earlier, higher peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return status_kb("VmHWM")
    return status_kb("VmRSS")


def child_restore(directory: str, keep: int, only_keep: bool) -> None:
    """Run in a fresh process: peak RSS growth of a restore keeping ``keep`` sessions, or
    (``only_keep``) the RSS growth of parsing and keeping just those sessions."""
    wanted = frozenset(f"r{i}" for i in range(keep))
    before = reset_peak_rss()
    if only_keep:
        records = Path(directory, "gym", KIND, INSTANCE)
        with open(next(records.glob("records-*.jsonl")), "rb") as src:
            kept = [orjson.loads(src.readline()) for _ in range(keep)]
        assert [r["episode_id"]["rollout_id"] for r in kept] == sorted(wanted, key=lambda k: int(k[1:]))
        print(json.dumps({"kept_kb": status_kb("VmRSS") - before}))
        return
    _, kept = read_records(directory, KIND, INSTANCE,
                           lambda r: r if r["episode_id"]["rollout_id"] in wanted else None, keys=wanted)
    assert len(kept) == keep
    print(json.dumps({"peak_growth_kb": status_kb("VmHWM") - before}))


def child(directory: Path, keep: int, *flags: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, __file__, "--child-restore", str(directory), str(keep), *flags],
                         capture_output=True, text=True, check=True)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def measure(shape: str, sessions_n: int, kb: int, tmp: Path) -> dict[str, Any]:
    make = SHAPES[shape]
    # The sessions exist before the clock starts: only storage is timed, on both sides.
    sessions = [make(i, kb) for i in range(sessions_n)]
    started = time.perf_counter()
    manifest = write_records(tmp / "ck", KIND, INSTANCE, "ck-1", ((f"r{i}", s) for i, s in enumerate(sessions)))
    commit_s = time.perf_counter() - started
    records_path = tmp / "ck" / "gym" / KIND / INSTANCE / manifest["records_file"]
    size_mb = records_path.stat().st_size / 2**20

    everything = frozenset(f"r{i}" for i in range(sessions_n))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    _, kept = read_records(tmp / "ck", KIND, INSTANCE, lambda r: r, keys=everything)
    restore_s = time.perf_counter() - started
    restore_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert len(kept) == sessions_n
    del kept

    keep = 10
    wanted = frozenset(f"r{i}" for i in range(keep))
    started = time.perf_counter()
    _, kept = read_records(tmp / "ck", KIND, INSTANCE,
                           lambda r: r if r["episode_id"]["rollout_id"] in wanted else None, keys=wanted)
    restore_scan_s = time.perf_counter() - started
    assert len(kept) == keep
    del kept

    tracemalloc.start()
    with open(records_path, "rb") as src:
        parsed = json.loads(src.readline())
    one_record_traced_mb = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    del parsed
    peak_mb = child(tmp / "ck", keep)["peak_growth_kb"] / 1024
    kept_rss_mb = child(tmp / "ck", keep, "--only-keep")["kept_kb"] / 1024
    one_rss_mb = child(tmp / "ck", 1, "--only-keep")["kept_kb"] / 1024
    bound_mb = 2 * one_rss_mb + kept_rss_mb
    bound_traced_mb = (2 + keep) * one_record_traced_mb

    naive = tmp / "naive.json"
    started = time.perf_counter()
    with open(naive, "w") as f:
        json.dump(sessions, f)
    naive_commit_s = time.perf_counter() - started
    del sessions
    started = time.perf_counter()
    with open(naive) as f:
        assert len(json.load(f)) == sessions_n
    naive_restore_s = time.perf_counter() - started
    os.remove(naive)
    for path in (tmp / "ck").rglob("*"):
        if path.is_file():
            path.unlink()

    print(f"[{shape}] commit  {commit_s:6.2f} s  (naive json.dump {naive_commit_s:.2f} s), target <= 1.5 s")
    print(f"[{shape}] restore {restore_s:6.2f} s  (naive json.load {naive_restore_s:.2f} s), target <= 1.5 s; "
          f"keeping {keep}: {restore_scan_s:.2f} s")
    print(f"[{shape}] restore peak {peak_mb:.1f} MB keeping {keep} of {sessions_n} ({size_mb:.0f} MB file), "
          f"bound {bound_mb:.1f} MB (2 x {one_rss_mb:.1f} + {kept_rss_mb:.1f}); tracemalloc bound "
          f"{bound_traced_mb:.1f} MB")
    return {"record_kb": round(size_mb * 1024 / sessions_n, 1), "file_mb": round(size_mb, 1),
            "commit_s": round(commit_s, 3), "restore_s": round(restore_s, 3),
            "restore_page_faults": restore_faults, "restore_scan_s": round(restore_scan_s, 3),
            "restore_peak_mb": round(peak_mb, 1), "restore_bound_mb": round(bound_mb, 1),
            "one_record_rss_mb": round(one_rss_mb, 2), "restore_kept_rss_mb": round(kept_rss_mb, 1),
            "restore_bound_traced_mb": round(bound_traced_mb, 1),
            "naive_commit_s": round(naive_commit_s, 3), "naive_restore_s": round(naive_restore_s, 3),
            "commit_vs_naive": round(commit_s / naive_commit_s, 2),
            "restore_vs_naive": round(restore_s / naive_restore_s, 2),
            "commit_target_met": commit_s <= 1.5, "restore_target_met": restore_s <= 1.5,
            "memory_target_met": peak_mb < bound_mb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--kb", type=int, default=350)
    p.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    p.add_argument("--child-restore", nargs=2, metavar=("DIR", "KEEP"), help=argparse.SUPPRESS)
    p.add_argument("--only-keep", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_restore:
        child_restore(args.child_restore[0], int(args.child_restore[1]), args.only_keep)
        return 0
    figures: dict[str, Any] = {"sessions": args.sessions}
    for shape in SHAPES if args.shape == "both" else [args.shape]:
        with tempfile.TemporaryDirectory(prefix="tidelog-storage-") as raw:
            for name, value in measure(shape, args.sessions, args.kb, Path(raw)).items():
                figures[f"{shape}_{name}"] = value
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
