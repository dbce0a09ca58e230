"""The managed-recovery policy: how many restarts of a component within a window, and the wait before
each — the service stack's rebuilds (``deployment.recovery``) and the trainer's (``training.recovery``).
Time comes from the injectable clock (``monotonic``), so a window of minutes is tested on virtual
time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` restarts (rebuilds) within ``window_s``; the n-th rebuild in the window waits
    ``delays_s[n - 1]`` (the last delay for any later one). ``max_restarts`` 0: fail-stop."""

    max_restarts: int = 3
    window_s: float = 300.0
    delays_s: tuple[float, ...] = (1.0, 2.0, 4.0)
    #: The configuration key that sets these bounds (named in :meth:`refusal`).
    setting: str = "deployment.recovery"
    #: The monotonic times of the rebuilds this policy allowed (the window's evidence).
    history: list[float] = field(default_factory=list)

    def recent(self, now: float) -> list[float]:
        return [t for t in self.history if now - t < self.window_s]

    def allow(self, now: float) -> float | None:
        """The delay before the next rebuild (recording it), or ``None`` when the window is full."""
        self.history = self.recent(now)
        if len(self.history) >= self.max_restarts:
            return None
        delay = self.delays_s[min(len(self.history), len(self.delays_s) - 1)] if self.delays_s else 0.0
        self.history.append(now)
        return delay

    def refusal(self) -> str:
        return (f"exceeded {self.max_restarts} restart{'s' if self.max_restarts != 1 else ''} within "
                f"{self.window_s:g} s ({self.setting})")
