"""The demos' command-line options, apart from the demos themselves: building ``tidelog``'s parser
must not import them (the training demo pulls in torch)."""

from __future__ import annotations

import argparse
from pathlib import Path


def checkpoint_demo_arguments(p: argparse.ArgumentParser) -> None:
    """``tidelog demo``'s options."""
    p.add_argument("--workdir", type=Path, default=Path("demo-run"),
                   help="where the demo writes; emptied first (default ./demo-run)")
    p.add_argument("--journal-url", help="journal URL (default: a SQLite file in the workdir)")
    p.add_argument("--episodes", type=int, default=6, help="episodes in flight (default 6)")
    p.add_argument("--turns", type=int, default=4, help="turns per episode (default 4)")
    p.add_argument("--step-delay", type=float, default=0.3, help="seconds each environment step takes (default 0.3)")


def training_demo_arguments(p: argparse.ArgumentParser) -> None:
    """``tidelog demo-train``'s options."""
    p.add_argument("--workdir", type=Path, default=Path("demo-train-run"),
                   help="where the demo writes; emptied first (default ./demo-train-run)")
    p.add_argument("--journal-url", help="journal URL (default: a SQLite file in the workdir)")
    p.add_argument("--rounds", type=int, default=10, help="training rounds, one job each (default 10, at least 5)")
    p.add_argument("--episodes", type=int, default=8, help="episodes per round (default 8)")
    p.add_argument("--turns", type=int, default=3, help="turns (actions) per episode (default 3)")
    p.add_argument("--task", default="letter:s", help="the resources server's check rule (default letter:s)")
    p.add_argument("--temperature", type=float, default=1.0, help="the engine's sampling temperature (default 1)")
    p.add_argument("--no-crashes", action="store_true", help="run without killing the orchestrator and trainer")


__all__ = ["checkpoint_demo_arguments", "training_demo_arguments"]
