"""The engine health monitor: schedule, retirement of the captured engine, epoch fencing, drain.

The engines here are stand-ins (:class:`ProbeEngine`): each test must make a check fail, hang
or return at an exact moment, which no real engine does on demand. Everything else — the
monitor task, its timers and the slot registry — is the real code under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from workers.health import (
    EngineHealthMonitor,
    EngineSlots,
    HealthConfigError,
    HealthMonitorConfig,
    HealthMonitorFailed,
    HealthMonitorStateError,
    HealthTarget,
)

SAFETY = 10.0  # a generous ceiling on every wait; never what a test asserts


class ProbeEngine:
    """A stand-in engine whose check can pass, fail, hang on a gate, and whose retirement can hang."""

    def __init__(self, name: str, *, healthy: bool = True) -> None:
        self.name = name
        self.healthy = healthy
        self.check_gate: asyncio.Event | None = None
        self.retire_gate: asyncio.Event | None = None
        self.checks_started = 0
        self.retire_started = False
        self.retired = False

    async def check(self, timeout: float) -> bool:
        self.checks_started += 1
        if self.check_gate is not None:
            await self.check_gate.wait()
        return self.healthy

    async def retire(self, timeout: float) -> None:
        self.retire_started = True
        if self.retire_gate is not None:
            await self.retire_gate.wait()
        self.retired = True


def slots(*engines: ProbeEngine | None) -> EngineSlots[ProbeEngine]:
    async def check(engine: ProbeEngine, timeout: float) -> object:
        return await engine.check(timeout)

    async def retire(engine: ProbeEngine, timeout: float) -> object:
        await engine.retire(timeout)
        return None

    return EngineSlots(check, retire, engines)


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(SAFETY):
        while not condition():
            await asyncio.sleep(0.002)


def monitor_for(source: EngineSlots[ProbeEngine], *, interval: float = 0.01, timeout: float = 5.0,
                first_wait: float = 0.0) -> EngineHealthMonitor:
    monitor = EngineHealthMonitor(source, HealthMonitorConfig(interval, timeout, first_wait))
    monitor.start()
    return monitor


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"interval": 0, "timeout": 1}, "interval"),
    ({"interval": 1, "timeout": -1}, "timeout"),
    ({"interval": 1, "timeout": float("nan")}, "timeout"),
    ({"interval": 1, "timeout": 1, "first_wait": -0.5}, "first_wait"),
    ({"interval": True, "timeout": 1}, "interval"),
])
def test_config_is_validated_by_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(HealthConfigError) as caught:
        HealthMonitorConfig(**kwargs)
    assert caught.value.field == field


def test_the_default_drain_covers_a_check_and_a_retirement() -> None:
    assert HealthMonitorConfig(interval=1, timeout=3).drain_timeout == 7.0
    assert HealthMonitorConfig(interval=1, timeout=3).first_wait == 0.0


async def test_start_is_paused_until_resume() -> None:
    engine = ProbeEngine("a")
    monitor = monitor_for(slots(engine))
    await asyncio.sleep(0.05)
    assert engine.checks_started == 0 and not monitor.enabled
    epoch = monitor.epoch
    monitor.resume()
    assert monitor.epoch == epoch + 1
    await until(lambda: engine.checks_started >= 3)  # rounds repeat every interval
    assert not engine.retired and monitor.status()["retired"] == 0
    await monitor.stop()


async def test_the_first_round_waits_for_first_wait() -> None:
    engine = ProbeEngine("a")
    monitor = monitor_for(slots(engine), first_wait=600)
    monitor.resume()
    await asyncio.sleep(0.05)
    assert engine.checks_started == 0
    await monitor.stop()


async def test_a_failed_probe_retires_the_engine_it_captured_and_only_that_one() -> None:
    good, bad = ProbeEngine("good"), ProbeEngine("bad", healthy=False)
    source = slots(good, bad)
    monitor = monitor_for(source)
    monitor.resume()
    await until(lambda: monitor.status()["retired"] == 1)  # counted after the retirement returns
    assert bad.retired and source.get(1) is None and source.get(0) is good and not good.retired
    assert monitor.retired == ["slot 1"]
    checks = good.checks_started
    await until(lambda: good.checks_started > checks)  # the monitor keeps probing the healthy one
    await monitor.stop()


async def test_a_check_that_raises_or_runs_past_its_timeout_is_a_failure() -> None:
    raising, hanging = ProbeEngine("raising"), ProbeEngine("hanging")
    hanging.check_gate = asyncio.Event()  # never set: the check outlives its timeout

    async def check(engine: ProbeEngine, timeout: float) -> object:
        if engine is raising:
            raise ConnectionError("refused")
        return await engine.check(timeout)

    async def retire(engine: ProbeEngine, timeout: float) -> object:
        await engine.retire(timeout)
        return None

    source = EngineSlots(check, retire, [raising, hanging])
    monitor = EngineHealthMonitor(source, HealthMonitorConfig(interval=0.01, timeout=0.05))
    monitor.start()
    monitor.resume()
    await until(lambda: monitor.status()["retired"] == 2)
    assert raising.retired and hanging.retired and len(source.targets()) == 0
    await monitor.stop()


async def test_pause_waits_for_an_active_probe_and_discards_its_result() -> None:
    engine = ProbeEngine("a", healthy=False)
    engine.check_gate = asyncio.Event()
    source = slots(engine)
    monitor = monitor_for(source)
    monitor.resume()
    await until(lambda: engine.checks_started == 1)
    pausing = asyncio.create_task(monitor.pause(timeout=SAFETY))
    await asyncio.sleep(0.05)
    assert not pausing.done() and monitor.active and not monitor.enabled
    engine.check_gate.set()  # the probe ends, failed, after the pause bumped the epoch
    await pausing
    assert not monitor.active and not engine.retired and source.get(0) is engine
    assert monitor.status()["discarded"] == 1
    await monitor.stop()


async def test_pause_waits_for_an_active_retirement() -> None:
    engine = ProbeEngine("a", healthy=False)
    engine.retire_gate = asyncio.Event()
    source = slots(engine)
    monitor = monitor_for(source)
    monitor.resume()
    await until(lambda: engine.retire_started)
    pausing = asyncio.create_task(monitor.pause(timeout=SAFETY))
    await asyncio.sleep(0.05)
    assert not pausing.done() and monitor.active
    engine.retire_gate.set()
    await pausing
    assert engine.retired and source.get(0) is None
    await monitor.stop()


async def test_a_drain_timeout_raises_and_leaves_checks_disabled() -> None:
    engine = ProbeEngine("a", healthy=False)
    engine.check_gate = asyncio.Event()
    monitor = monitor_for(slots(engine))
    monitor.resume()
    await until(lambda: engine.checks_started == 1)
    with pytest.raises(TimeoutError, match="still active .* must not be replaced"):
        await monitor.pause(timeout=0.02)
    assert not monitor.enabled and monitor.active
    engine.check_gate.set()
    await until(lambda: not monitor.active)
    assert not engine.retired and engine.checks_started == 1  # disabled: no new round either
    await monitor.stop()


async def test_a_stale_probe_cannot_retire_a_replacement() -> None:
    old, replacement = ProbeEngine("old", healthy=False), ProbeEngine("new")
    old.check_gate = asyncio.Event()
    source = slots(old)
    monitor = monitor_for(source, first_wait=0.0)
    monitor.resume()
    await until(lambda: old.checks_started == 1)
    # Recovery pauses the monitor; the hung probe outlives the drain deadline ...
    with pytest.raises(TimeoutError):
        await monitor.pause(timeout=0.02)
    # ... and the engine is replaced and monitoring resumed anyway, in a new epoch.
    assert source.replace(0, replacement) is old
    monitor.resume()
    old.check_gate.set()  # now the stale probe reports its failure
    await until(lambda: monitor.status()["discarded"] == 1)
    await until(lambda: replacement.checks_started >= 1)
    assert source.get(0) is replacement and not replacement.retired and not old.retired
    assert monitor.retired == []
    await monitor.stop()


async def test_retiring_a_captured_target_never_clears_a_replaced_slot() -> None:
    old, replacement = ProbeEngine("old"), ProbeEngine("new")
    source = slots(old)
    [target] = source.targets()
    source.replace(0, replacement)
    await target.retire(1.0)
    assert old.retired and not replacement.retired and source.get(0) is replacement
    assert not source.clear_if(0, old) and source.clear_if(0, replacement)
    with pytest.raises(IndexError, match="slot index 3"):
        source.get(3)


async def test_a_failed_retirement_is_counted_and_monitoring_goes_on() -> None:
    bad, good = ProbeEngine("bad", healthy=False), ProbeEngine("good")

    async def check(engine: ProbeEngine, timeout: float) -> object:
        return await engine.check(timeout)

    async def retire(engine: ProbeEngine, timeout: float) -> object:
        raise OSError("kill failed")

    source = EngineSlots(check, retire, [bad, good])
    monitor = EngineHealthMonitor(source, HealthMonitorConfig(interval=0.01, timeout=1.0))
    monitor.start()
    monitor.resume()
    await until(lambda: monitor.status()["retire_errors"] == 1)
    assert source.get(0) is None  # cleared anyway: it failed its check
    checks = good.checks_started
    await until(lambda: good.checks_started > checks)
    monitor.check_health()  # a retirement error is not a monitor failure
    await monitor.stop()


class BrokenSource:
    def targets(self) -> Sequence[HealthTarget]:
        raise KeyError("engine table corrupted")


async def test_an_internal_failure_is_recorded_and_cannot_be_resumed() -> None:
    monitor = EngineHealthMonitor(BrokenSource(), HealthMonitorConfig(interval=0.01, timeout=1.0))
    monitor.start()
    monitor.check_health()
    monitor.resume()
    await until(lambda: monitor.status()["failure"] is not None)
    with pytest.raises(HealthMonitorFailed, match="engine table corrupted"):
        monitor.check_health()
    with pytest.raises(HealthMonitorFailed):
        monitor.resume()
    await monitor.stop()


async def test_lifecycle_misuse_is_refused() -> None:
    monitor = EngineHealthMonitor(slots(), HealthMonitorConfig(interval=1, timeout=1))
    with pytest.raises(HealthMonitorStateError, match="resume needs a started"):
        monitor.resume()
    monitor.start()
    with pytest.raises(HealthMonitorStateError, match="already started"):
        monitor.start()
    await monitor.stop()
    assert monitor.status()["stopped"]
    with pytest.raises(HealthMonitorStateError):
        monitor.resume()
    with pytest.raises(HealthMonitorStateError, match="start after stop"):
        monitor.start()
    with pytest.raises(HealthConfigError, match="config"):
        EngineHealthMonitor(slots(), {"interval": 1})  # type: ignore[arg-type]


async def test_stop_after_a_drain_timeout_can_be_retried() -> None:
    engine = ProbeEngine("a")
    engine.check_gate = asyncio.Event()
    monitor = monitor_for(slots(engine))
    monitor.resume()
    await until(lambda: engine.checks_started == 1)
    with pytest.raises(TimeoutError):
        await monitor.stop(timeout=0.02)
    engine.check_gate.set()
    await monitor.stop(timeout=SAFETY)
    assert not monitor.active and monitor.status()["stopped"]


async def test_a_check_that_raises_cancelled_error_is_a_failed_check_not_the_monitors_end() -> None:
    # Fault injection: a check whose own request was cancelled by something else (a closed
    # session, a cancelled shared future) surfaces CancelledError; stand-in engines raise it here.
    bad, good = ProbeEngine("bad"), ProbeEngine("good")

    async def check(engine: ProbeEngine, timeout: float) -> object:
        if engine is bad:
            raise asyncio.CancelledError("the engine's request was cancelled")
        return await engine.check(timeout)

    async def retire(engine: ProbeEngine, timeout: float) -> object:
        await engine.retire(timeout)
        return None

    source = EngineSlots(check, retire, [bad, good])
    monitor = EngineHealthMonitor(source, HealthMonitorConfig(interval=0.01, timeout=1.0))
    monitor.start()
    monitor.resume()
    await until(lambda: monitor.status()["retired"] == 1)
    assert bad.retired and not good.retired and source.get(0) is None
    checks = good.checks_started
    await until(lambda: good.checks_started > checks)  # still probing: the monitor did not end
    monitor.check_health()
    await monitor.stop()  # a live task, stopped normally (no CancelledError escapes)
    assert monitor.status()["stopped"]


async def test_cancelling_the_monitor_during_a_probe_still_cancels_it() -> None:
    # The other side of the test above: a real cancellation of the monitor task is not
    # mistaken for a failed check (nothing is retired) and still ends the task.
    engine = ProbeEngine("a", healthy=False)
    engine.check_gate = asyncio.Event()  # never set: the probe is in flight when cancelled
    monitor = monitor_for(slots(engine))
    monitor.resume()
    await until(lambda: engine.checks_started == 1)
    task = monitor._task
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.retire_started and monitor.status()["failed_checks"] == 0
    assert not monitor.active
