"""The engine health monitor: periodic probes that retire a failed engine, fenced by epochs.

Targets. The monitor probes whatever its source's ``targets()`` returns at the start of each
round — one :class:`HealthTarget` per logical engine, covering every node that retires with
it. A target's ``check(timeout)`` is healthy when it returns anything but ``False``; raising,
returning ``False`` or running past ``timeout`` is a failure. ``retire(timeout)`` takes the
failed engine out of service. Both are coroutine methods: the monitor is an asyncio task,
like the engine adapters it probes. :class:`EngineSlots` is a ready source over a list of
engine slots whose targets capture the engine they were made for.

Lifecycle (call every method from the event loop's thread):

- :meth:`EngineHealthMonitor.start` launches the task *paused*: nothing is probed yet.
- :meth:`~EngineHealthMonitor.resume` bumps the epoch, enables checks and schedules the first
  round at ``now + first_wait``; later rounds follow ``interval`` after the previous one ends.
- :meth:`~EngineHealthMonitor.pause` and :meth:`~EngineHealthMonitor.stop` disable checks,
  bump the epoch and wait until no probe or retirement is active, within ``timeout`` (default
  ``2 * config.timeout + 1``: one check plus one retirement plus a second of slack). If the
  drain times out they raise :class:`TimeoutError` with checks left disabled; the caller must
  then not replace, offload or terminate engines. ``stop`` keeps its task on a timeout so it
  can be called again.

Fencing. A round remembers the epoch it started in. A failed check retires its target only if
that epoch is still current; a result from an older epoch (a pause or resume happened while the
probe ran) is discarded. Retirement acts on the target captured at the start of the round, and
:class:`EngineSlots` clears a slot only if it still holds that engine, so even a probe that
outlives a pause can never retire a replacement. A retirement that fails is logged and
counted; it does not stop the monitor. A check or retirement that raises ``CancelledError``
while the monitor itself is not being cancelled counts as failed too.

Internal failure. An error in the monitor itself (``targets()`` raising, a bug) is recorded:
the task ends, :meth:`~EngineHealthMonitor.check_health` raises :class:`HealthMonitorFailed`
from then on and monitoring cannot be resumed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

logger = logging.getLogger("tidelog.health")

E = TypeVar("E")


class HealthConfigError(ValueError):
    """A monitor setting out of range: ``field`` held ``value``, breaking ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"health monitor {field}: {value!r} — {rule}")
        self.field = field
        self.value = value
        self.rule = rule


class HealthMonitorFailed(RuntimeError):
    """The monitor itself failed; it no longer probes and cannot be resumed."""


class HealthMonitorStateError(RuntimeError):
    """A lifecycle call in the wrong state (resume before start, start twice, use after stop)."""


def _number(field: str, value: object, *, allow_zero: bool) -> float:
    rule = "must be a finite number >= 0" if allow_zero else "must be a finite number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HealthConfigError(field, value, rule)
    if value < 0 or (value == 0 and not allow_zero):
        raise HealthConfigError(field, value, rule)
    return float(value)


@dataclass(frozen=True)
class HealthMonitorConfig:
    """Seconds between rounds (``interval`` > 0), per check and per retirement (``timeout`` > 0),
    and before the first round after a resume (``first_wait`` >= 0)."""

    interval: float
    timeout: float
    first_wait: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "interval", _number("interval", self.interval, allow_zero=False))
        object.__setattr__(self, "timeout", _number("timeout", self.timeout, allow_zero=False))
        object.__setattr__(self, "first_wait", _number("first_wait", self.first_wait, allow_zero=True))

    @property
    def drain_timeout(self) -> float:
        """The default deadline of pause and stop: one check, one retirement, one second."""
        return 2 * self.timeout + 1


class HealthTarget(Protocol):
    """One logical engine as the monitor sees it (see the module docs)."""

    @property
    def name(self) -> str: ...

    async def check(self, timeout: float) -> object: ...

    async def retire(self, timeout: float) -> object: ...


class HealthTargets(Protocol):
    """The monitor's source: a snapshot of the engines to probe this round."""

    def targets(self) -> Sequence[HealthTarget]: ...


class SlotTarget(Generic[E]):
    """The engine that occupied slot ``index`` when this target was made, and only that one."""

    def __init__(self, slots: EngineSlots[E], index: int, engine: E) -> None:
        self.slots = slots
        self.index = index
        self.engine = engine

    @property
    def name(self) -> str:
        return f"slot {self.index}"

    async def check(self, timeout: float) -> object:
        return await self.slots.check_fn(self.engine, timeout)

    async def retire(self, timeout: float) -> object:
        """Retire the captured engine, then clear the slot if it still holds that engine."""
        try:
            return await self.slots.retire_fn(self.engine, timeout)
        finally:
            # Cleared even when retiring raised: an engine that failed its check must not be
            # probed as healthy again; recovery replaces the slot.
            self.slots.clear_if(self.index, self.engine)


class EngineSlots(Generic[E]):
    """A list of engine slots (``None`` when empty) that a monitor can probe.

    ``check_fn(engine, timeout)`` and ``retire_fn(engine, timeout)`` are coroutine functions
    applied to the engine a target captured. Slots compare engines by identity.
    """

    def __init__(self, check_fn: Callable[[E, float], Awaitable[object]],
                 retire_fn: Callable[[E, float], Awaitable[object]],
                 engines: Iterable[E | None] = ()) -> None:
        self.check_fn = check_fn
        self.retire_fn = retire_fn
        self._slots: list[E | None] = list(engines)

    def __len__(self) -> int:
        return len(self._slots)

    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._slots):
            raise IndexError(f"slot index {index!r} is outside [0, {len(self._slots)})")
        return index

    def get(self, index: int) -> E | None:
        return self._slots[self._index(index)]

    def add(self, engine: E | None) -> int:
        """Append a slot; returns its index."""
        self._slots.append(engine)
        return len(self._slots) - 1

    def replace(self, index: int, engine: E | None) -> E | None:
        """Put ``engine`` in slot ``index``; returns the engine it held."""
        previous = self._slots[self._index(index)]
        self._slots[index] = engine
        return previous

    def clear_if(self, index: int, engine: E) -> bool:
        """Empty slot ``index`` only if it still holds ``engine``; returns whether it did."""
        if self._slots[self._index(index)] is engine:
            self._slots[index] = None
            return True
        return False

    def targets(self) -> list[SlotTarget[E]]:
        """One target per occupied slot, each capturing the engine in it now."""
        return [SlotTarget(self, i, engine) for i, engine in enumerate(self._slots) if engine is not None]


def _cancelling() -> bool:
    """Whether the running task has been asked to cancel (not merely seen a CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class EngineHealthMonitor:
    """Probes ``source``'s targets on ``config``'s schedule (see the module docs)."""

    def __init__(self, source: HealthTargets, config: HealthMonitorConfig) -> None:
        if not isinstance(config, HealthMonitorConfig):
            raise HealthConfigError("config", config, "must be a HealthMonitorConfig")
        self.source = source
        self.config = config
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._enabled = False
        self._epoch = 0
        self._next_due: float | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._failure: Exception | None = None
        self._counts = {"rounds": 0, "probes": 0, "failed_checks": 0, "retired": 0,
                        "retire_errors": 0, "discarded": 0}
        self.retired: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def active(self) -> bool:
        """Whether a probe round (a check or a retirement) is running now."""
        return self._active > 0

    def start(self) -> None:
        """Launch the monitor task, paused. Needs a running event loop."""
        if self._stopped:
            raise HealthMonitorStateError("health monitor: start after stop; make a new monitor")
        if self._task is not None:
            raise HealthMonitorStateError("health monitor: already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-health-monitor")

    def resume(self) -> None:
        """Enable checks in a new epoch; the first round runs ``first_wait`` seconds from now."""
        self.check_health()
        if self._task is None or self._stopped:
            raise HealthMonitorStateError("health monitor: resume needs a started, unstopped monitor")
        self._epoch += 1
        self._enabled = True
        self._next_due = asyncio.get_running_loop().time() + self.config.first_wait
        self._wake.set()

    async def pause(self, timeout: float | None = None) -> None:
        """Disable checks, bump the epoch and wait for any active probe or retirement to end."""
        self._enabled = False
        self._epoch += 1
        self._next_due = None
        self._wake.set()
        await self._drain("pause", timeout)

    async def stop(self, timeout: float | None = None) -> None:
        """Pause (same drain and deadline), then end the task. Call again after a TimeoutError."""
        self._enabled = False
        self._epoch += 1
        self._next_due = None
        self._stopped = True
        self._wake.set()
        await self._drain("stop", timeout)
        task = self._task
        if task is not None:
            await task  # idle now, so it sees _stopped and returns at once
            self._task = None

    async def _drain(self, what: str, timeout: float | None) -> None:
        deadline = self.config.drain_timeout if timeout is None else _number(
            "timeout", timeout, allow_zero=True)
        if self._idle.is_set():
            return
        try:
            await asyncio.wait_for(self._idle.wait(), deadline)
        except TimeoutError:
            raise TimeoutError(
                f"health monitor {what}: a probe or retirement is still active after {deadline:g} s; "
                f"checks stay disabled, and engines must not be replaced, offloaded or terminated "
                f"until it ends") from None

    def check_health(self) -> None:
        """Raise :class:`HealthMonitorFailed` if the monitor itself has failed."""
        if self._failure is not None:
            raise HealthMonitorFailed(f"health monitor failed: {self._failure!r}") from self._failure

    def status(self) -> dict[str, Any]:
        """Counters and state, for health endpoints and tests."""
        return {"enabled": self._enabled, "epoch": self._epoch, "active": self.active,
                "stopped": self._stopped,
                "failure": repr(self._failure) if self._failure is not None else None,
                **self._counts}

    # -- the task -----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopped:
                due = self._next_due
                if not self._enabled or due is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                delay = due - loop.time()
                if delay > 0:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), delay)
                    except TimeoutError:
                        pass
                    continue  # re-read the schedule: a pause or resume may have changed it
                epoch = self._epoch
                await self._round(epoch)
                if self._epoch == epoch:  # a resume during the round has set its own schedule
                    self._next_due = loop.time() + self.config.interval
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything else is a monitor bug: record it, stop probing
            self._failure = exc
            self._enabled = False
            logger.exception("health monitor failed; monitoring stops")

    async def _round(self, epoch: int) -> None:
        self._active += 1
        self._idle.clear()
        try:
            targets = list(self.source.targets())
            self._counts["rounds"] += 1
            results = await asyncio.gather(*(self._probe(t, epoch) for t in targets),
                                           return_exceptions=True)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _probe(self, target: HealthTarget, epoch: int) -> None:
        timeout = self.config.timeout
        try:
            healthy = await asyncio.wait_for(target.check(timeout), timeout) is not False
            reason = "check returned False"
        except asyncio.CancelledError as exc:
            if _cancelling():
                raise  # the monitor itself is being cancelled
            # A check whose own work was cancelled (not this task) failed like any other;
            # letting it through would end the monitor silently, with no failure recorded.
            healthy, reason = False, f"check was cancelled ({exc!r})"
        except Exception as exc:  # a failed check of any kind, a timeout included
            healthy, reason = False, repr(exc)
        self._counts["probes"] += 1
        if healthy:
            return
        if epoch != self._epoch:
            # Paused or resumed while the check ran: the result may describe an engine that
            # has since been replaced, so it must not retire anything.
            self._counts["discarded"] += 1
            logger.info("health check of %s failed in stale epoch %d (now %d); discarded",
                        target.name, epoch, self._epoch)
            return
        self._counts["failed_checks"] += 1
        logger.warning("health check of %s failed (%s); retiring it", target.name, reason)
        try:
            await asyncio.wait_for(target.retire(timeout), timeout)
        except asyncio.CancelledError:
            if _cancelling():
                raise
            self._counts["retire_errors"] += 1
            logger.exception("retiring %s was cancelled", target.name)
            return
        except Exception:
            self._counts["retire_errors"] += 1
            logger.exception("retiring %s failed", target.name)
            return
        self._counts["retired"] += 1
        self.retired.append(target.name)


__all__ = ["EngineHealthMonitor", "EngineSlots", "HealthConfigError", "HealthMonitorConfig",
           "HealthMonitorFailed", "HealthMonitorStateError", "HealthTarget", "HealthTargets",
           "SlotTarget"]
