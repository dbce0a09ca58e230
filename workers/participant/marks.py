"""Retire marks: which attempts of which rollouts a participant refuses, kept on local disk.

A mark says "rollout ``r`` is retired up to attempt ``n``": every attempt
``<= n`` is refused with ``stale_attempt``. Marks only ever go up, and only
``forget`` removes one. The seed keeps marks in memory, so a participant that
crashed and restarted would serve an attempt it had retired; here every mark is
committed to a small SQLite file beside the participant's state before the
call that set it returns, and loaded again on start.

The file holds one row per rollout retired and not yet forgotten, so the
controller's ``forget`` calls bound it. It also holds the fence: per lineage (one journal's line of
leaders), the highest orchestrator epoch this participant has seen
(:meth:`RetiredMarks.observe_epoch`), kept as durably as the marks so that a restarted participant
still refuses a deposed leader. Writes are synchronous (a handful of
rows per retire, WAL, ``synchronous=FULL``): they happen before any work a
deadline limits, which is the point — even a retire that arrives too late
leaves its mark.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from ..protocol import EpisodeId, ErrorCode, ProtocolError

FILE_NAME = "retired-marks.sqlite3"


class RetiredMarks:
    """Durable, monotone retire marks for one participant (one event loop, one writer)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / FILE_NAME
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS marks (rollout_id TEXT PRIMARY KEY, "
                         "attempt INTEGER NOT NULL CHECK (attempt >= 0))")
        self._db.execute("CREATE TABLE IF NOT EXISTS fence (lineage TEXT PRIMARY KEY, "
                         "epoch INTEGER NOT NULL CHECK (epoch >= 0))")
        self._marks: dict[str, int] = dict(self._db.execute("SELECT rollout_id, attempt FROM marks"))
        self._epochs: dict[str, int] = dict(self._db.execute("SELECT lineage, epoch FROM fence"))
        #: Requests refused for an older epoch since this process started (not durable: a count to watch).
        self.stale_epochs_refused = 0

    def close(self) -> None:
        self._db.close()

    def __len__(self) -> int:
        """How many rollouts are retired and not yet forgotten (``retired_rollouts`` in status)."""
        return len(self._marks)

    def marks(self) -> dict[str, int]:
        """A copy of every mark: rollout id -> highest retired attempt."""
        return dict(self._marks)

    def mark(self, episodes: Iterable[EpisodeId]) -> None:
        """Raise each rollout's mark to at least the episode's attempt; durable when this returns.

        A mark never goes down: an older attempt than the one already marked changes nothing.
        """
        raised: dict[str, int] = {}
        for episode in episodes:
            current = max(self._marks.get(episode.rollout_id, -1), raised.get(episode.rollout_id, -1))
            if episode.attempt > current:
                raised[episode.rollout_id] = episode.attempt
        self.update(raised)

    def update(self, marks: dict[str, int]) -> None:
        """Merge marks from elsewhere (a coordinator, a joining worker); never lowers one."""
        rows = [(r, a) for r, a in marks.items() if a > self._marks.get(r, -1)]
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO marks (rollout_id, attempt) VALUES (?, ?) ON CONFLICT (rollout_id) "
                "DO UPDATE SET attempt = max(attempt, excluded.attempt)", rows)
        for rollout_id, attempt in rows:
            self._marks[rollout_id] = attempt

    def forget(self, rollout_ids: Iterable[str]) -> int:
        """Remove the marks of these rollouts; return how many existed."""
        present = sorted({r for r in rollout_ids if r in self._marks})
        if present:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("DELETE FROM marks WHERE rollout_id = ?", [(r,) for r in present])
            for rollout_id in present:
                del self._marks[rollout_id]
        return len(present)

    def epochs(self) -> dict[str, int]:
        """A copy of the fence: lineage -> the highest epoch seen in it."""
        return dict(self._epochs)

    def observe_epoch(self, lineage: str, epoch: int, *, record: bool) -> None:
        """Refuse ``epoch`` with ``stale_epoch`` (409) if it is lower than the highest seen in
        ``lineage``; with ``record`` (an authenticated caller) a higher one becomes the highest,
        durably, before this returns. An unauthenticated caller is only checked: it can never
        raise the fence."""
        highest = self._epochs.get(lineage)
        if highest is not None and epoch < highest:
            self.stale_epochs_refused += 1
            raise ProtocolError(ErrorCode.STALE_EPOCH,
                                f"epoch {epoch} is older than epoch {highest}, the highest this participant has "
                                f"seen from this journal: a newer orchestrator leads")
        if record and (highest is None or epoch > highest):
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO fence (lineage, epoch) VALUES (?, ?) ON CONFLICT (lineage) "
                                 "DO UPDATE SET epoch = max(epoch, excluded.epoch)", (lineage, epoch))
            self._epochs[lineage] = epoch

    def is_retired(self, episode: EpisodeId) -> bool:
        return episode.attempt <= self._marks.get(episode.rollout_id, -1)

    def check(self, episode: EpisodeId) -> None:
        """Refuse a retired attempt with ``stale_attempt`` (409)."""
        mark = self._marks.get(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT,
                                f"attempt {episode.attempt} of rollout {episode.rollout_id!r} is retired "
                                f"(attempts up to {mark} are refused until forget)")
