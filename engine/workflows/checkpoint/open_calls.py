"""Which calls of a workflow's current step are still open, as seen from this process's commits.

A fan-out step sends one call per participant, and every reply wakes the owner. Reading
where all of the step's calls stand on each wake-up costs a read per reply; instead the owner
notes the step's calls here (before the commit that creates them), and a journal commit
listener strikes off each call as its outcome commits. Until none is open the owner has
nothing to decide, so a reply need not wake it at all.

This is a shortcut, never a source of truth: an owner decides on calls it reads from the
journal, and it stops trusting the shortcut past the step's deadline (a call settled by
another process, which this one never hears about, is then found by reading). An entry is
per owner version, so a write to the owner by anyone else makes it stale.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from journal import Committed, outbox

#: Outbox states of a settled call (defined here only: fan-out, checkpoint and scope import it).
SETTLED = ("succeeded", "failed", "ambiguous")


@dataclass
class _Step:
    version: int
    deadline: float
    open: set[str]


class OpenCalls:
    """Per owner id: the owner's version that wrote its current step, the step's deadline
    (Unix seconds, as ``Clock.time()`` reads them) and the ids of the step's calls not yet seen settled."""

    def __init__(self) -> None:
        self._steps: dict[str, _Step] = {}
        self._owner_of: dict[str, str] = {}  # call id -> owner id

    def on_commit(self, committed: Sequence[Committed]) -> None:
        """Journal commit listener: strike settled calls off their owner's open set."""
        for c in committed:
            if c.kind == outbox.KIND and c.to_state in SETTLED:
                owner = self._owner_of.pop(c.entity_id, None)
                step = None if owner is None else self._steps.get(owner)
                if step is not None:
                    step.open.discard(c.entity_id)

    def track(self, owner: str, version: int, deadline: float, calls: Collection[str],
              settled: Collection[str] = ()) -> None:
        """Note the owner's step at ``version``: its ``calls``, less those known ``settled``.

        Call it before the commit that creates the calls, so that every outcome is heard. An
        entry for the same version is kept and only narrowed: the same version means the same
        calls, and on_commit has kept it current, while ``settled`` may be an older read.
        """
        old = self._steps.get(owner)
        if old is not None and old.version == version:
            self._settle(old, settled)
            return
        self.forget(owner)
        step = self._steps[owner] = _Step(version, deadline, set(calls))
        self._owner_of.update(dict.fromkeys(step.open, owner))
        self._settle(step, settled)

    def forget(self, owner: str) -> None:
        """Drop the owner's entry (its step ended, or a write of it failed)."""
        old = self._steps.pop(owner, None)
        if old is not None:
            self._settle(old, list(old.open))

    def waiting_until(self, owner: str, version: int | None, now: float, margin: float) -> float | None:
        """The deadline of the owner's step (at ``version``; ``None``: whatever version) while it
        still has a call open and ``now`` is before that deadline plus ``margin``; else ``None``."""
        step = self._steps.get(owner)
        if (step is not None and step.open and (version is None or step.version == version)
                and now < step.deadline + margin):
            return step.deadline
        return None

    def _settle(self, step: _Step, calls: Collection[str]) -> None:
        for call_id in calls:
            if call_id in step.open:
                step.open.discard(call_id)
                self._owner_of.pop(call_id, None)
