"""Named crash hooks: kill this process right after a named commit, for recovery tests.

Every commit the journal makes is announced to a :class:`CrashHooks` commit listener
(the Orchestrator installs one first), which names each entity write
``<kind>:<from>-><to>`` (``<kind>:created:<state>`` for a create, :func:`hook_name`;
:func:`hook_names` lists every name a set of machines can reach, by default every registered
workflow's). When ``TIDELOG_CRASH_AT`` names one of them (optionally
``NAME@N`` for its N-th occurrence), the process sends itself SIGKILL at that
point — after the commit is durable, before anything else happens. Unarmed,
the hook costs one dictionary lookup per commit.

:func:`pause_point` is the same for a pause instead of a crash: ``TIDELOG_PAUSE_AT=send:<path>``
stops the process (SIGSTOP) right before the dispatcher sends its first call to ``<path>``, after
it checked its lease, as a GC pause or a SIGSTOP at that moment would: a test then lets another
orchestrator take over and sends SIGCONT, and the old leader's call reaches the participants with
its old epoch.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Sequence

from journal import Committed, StateMachine

from engine.runtime import workflow

ENV = "TIDELOG_CRASH_AT"
#: ``send:<path>``: the dispatcher stops this process (SIGSTOP) right before it sends the first call
#: to ``<path>``, after its own lease check: a leader paused mid-send, for the participants' fence.
PAUSE_ENV = "TIDELOG_PAUSE_AT"
_paused: set[str] = set()


def pause_point(name: str) -> None:
    """SIGSTOP this process the first time it reaches ``name`` if ``TIDELOG_PAUSE_AT`` names it
    (unset: one environment lookup). Whoever sent the SIGCONT sees it go on from here."""
    if os.environ.get(PAUSE_ENV) == name and name not in _paused:
        _paused.add(name)
        sys.stderr.write(f"tidelog: pause point {name} reached\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


def hook_name(c: Committed) -> str:
    if c.from_state is None:
        return f"{c.kind}:created:{c.to_state}"
    return f"{c.kind}:{c.from_state}->{c.to_state}"


def hook_names(machines: Iterable[StateMachine] | None = None) -> list[str]:
    """Every crash point the given machines can reach (default: every registered kind's machine,
    :func:`engine.runtime.workflow.machines`), for tests that enumerate them."""
    names: list[str] = []
    for m in workflow.machines() if machines is None else machines:
        names += [f"{m.kind}:created:{s}" for s in sorted(m.initial)]
        names += [f"{m.kind}:{a}->{b}" for a, b in m.edge_list()]
    return names


class CrashHooks:
    """Parses ``TIDELOG_CRASH_AT`` once and kills the process at the armed point."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.target: str | None = None
        self.occurrence = 1
        self._seen = 0
        if spec:
            name, _, nth = spec.partition("@")
            self.target = name
            self.occurrence = int(nth) if nth else 1

    @property
    def armed(self) -> bool:
        return self.target is not None

    def __call__(self, committed: Sequence[Committed]) -> None:
        if self.target is None:
            return
        for c in committed:
            if hook_name(c) == self.target:
                self._seen += 1
                if self._seen >= self.occurrence:
                    sys.stderr.write(f"tidelog: crash hook {self.target} fired\n")
                    sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
