"""Episode steps: blocking, parking, replay steps, restarts, retire and deadlines, on real tasks."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from workers.participant import steps as steps_module
from workers.participant.steps import EpisodeSteps, StepMode
from workers.protocol import MAX_BLOCKERS_LISTED


async def settle(rounds: int = 10) -> None:
    """Let every runnable task run until it waits on something again."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def state(steps: EpisodeSteps, key: str) -> str | None:
    info = steps.info(key)
    return None if info is None else info.state


def fresh_blockers(steps: EpisodeSteps) -> list[str]:
    """The blocking rule applied from scratch to every tracked episode."""
    out = []
    for key in steps.live():
        info = steps.info(key)
        assert info is not None
        if info.retired or (not info.restart and info.state in ("running", "wait_step")):
            out.append(key)
    return sorted(out)


def fresh_export(steps: EpisodeSteps) -> dict[str, Any]:
    out = {}
    for key in steps.live():
        info = steps.info(key)
        assert info is not None
        if info.state in ("parked", "replay_step") and not info.retired and not info.restart:
            out[key] = info.boundary
    return out


def check(steps: EpisodeSteps) -> None:
    """Every derived view agrees with a fresh look at the episodes."""
    blockers = fresh_blockers(steps)
    assert steps.blocker_count() == len(blockers)
    assert steps.ready() == (not blockers)
    assert steps.blockers() == blockers[:MAX_BLOCKERS_LISTED]
    assert steps.blockers(3) == blockers[:3]
    assert steps.exported() == fresh_export(steps)
    restarts = [k for k in steps.live() if (i := steps.info(k)) and i.restart and not i.retired]
    assert steps.restarts() == restarts


class Gate:
    """An episode body that runs one step under the caller's control."""

    def __init__(self, steps: EpisodeSteps, key: str, **begin: Any) -> None:
        self.steps, self.key, self.begin = steps, key, begin
        self.go = asyncio.Event()
        self.done = False

    async def step(self, mode: StepMode, boundary: Any) -> str:
        self.steps.begin(self.key, **self.begin)
        try:
            async with self.steps.step(self.key, mode):
                await self.go.wait()
            await self.steps.boundary(self.key, boundary)
            self.done = True
            return "done"
        finally:
            self.steps.end(self.key)


def start(body: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
    return asyncio.ensure_future(body())


# -- lifecycle --------------------------------------------------------------------------------

async def test_duplicate_begin_is_refused_until_end() -> None:
    steps = EpisodeSteps()
    steps.begin("r-a1")
    with pytest.raises(ValueError, match=r"episode 'r-a1' is already running"):
        steps.begin("r-a1")
    assert steps.live() == ["r-a1"] and "r-a1" in steps and len(steps) == 1
    steps.end("r-a1")
    assert "r-a1" not in steps and steps.blocker_count() == 0
    steps.end("r-a1")  # unknown: no-op
    steps.begin("r-a1")
    assert steps.blocker_count() == 1


async def test_unknown_keys_and_bad_mode_are_refused() -> None:
    steps = EpisodeSteps()
    with pytest.raises(KeyError):
        steps.step("nope", "wait")
    with pytest.raises(KeyError):
        await steps.boundary("nope", 1)
    with pytest.raises(KeyError):
        await steps.mark_restart("nope")
    steps.begin("a")
    with pytest.raises(ValueError, match="step mode"):
        steps.step("a", "sometimes")  # type: ignore[arg-type]
    assert await steps.retire("nope") is False


async def test_blocking_rule_by_state() -> None:
    steps = EpisodeSteps()
    steps.begin("a")
    assert steps.blockers() == ["a"] and not steps.ready()
    async with steps.step("a", "wait"):
        assert state(steps, "a") == "wait_step" and steps.blocker_count() == 1
    async with steps.step("a", "replay"):
        assert state(steps, "a") == "replay_step" and steps.ready()
    assert state(steps, "a") == "running" and steps.blocker_count() == 1
    await steps.boundary("a", {"n": 1})  # open: returns at once, still running
    assert state(steps, "a") == "running" and steps.blockers() == ["a"]
    assert steps.info("a") is not None and steps.info("a").boundary == {"n": 1}  # type: ignore[union-attr]
    check(steps)


# -- parking ----------------------------------------------------------------------------------

async def test_boundary_parks_while_closed_and_open_wakes() -> None:
    steps = EpisodeSteps()
    gate = Gate(steps, "e")
    task = start(lambda: gate.step("wait", {"next": "verify"}))
    await settle()
    steps.close()
    assert steps.blockers() == ["e"]  # in a wait step: the checkpoint waits for it
    gate.go.set()
    await settle()
    assert state(steps, "e") == "parked" and steps.ready()
    assert steps.exported() == {"e": {"next": "verify"}}
    assert not task.done()
    steps.open()
    assert await task == "done"
    assert steps.live() == [] and steps.blocker_count() == 0


async def test_woken_episode_stays_parked_if_a_new_checkpoint_closed_first() -> None:
    steps = EpisodeSteps()
    gate = Gate(steps, "e")
    task = start(lambda: gate.step("wait", "b1"))
    await settle()
    steps.close()
    gate.go.set()
    await settle()
    assert state(steps, "e") == "parked"
    steps.open()
    steps.close()  # before the parked task got to run
    await settle()
    assert state(steps, "e") == "parked" and not task.done() and steps.ready()
    assert steps.exported() == {"e": "b1"}
    steps.open()
    assert await task == "done"


async def test_replay_step_ending_during_checkpoint_does_not_block_again() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    await steps.boundary("e", "before")
    async with steps.step("e", "replay"):
        steps.close()
        assert steps.ready() and steps.exported() == {"e": "before"}
    # The step ended while closed: still at the boundary before it, not a blocker.
    assert state(steps, "e") == "replay_step"
    assert steps.ready() and steps.blocker_count() == 0
    assert steps.exported() == {"e": "before"}
    # Its next boundary parks it with the step's result.
    parked = start(lambda: steps.boundary("e", "after"))
    await settle()
    assert state(steps, "e") == "parked" and steps.exported() == {"e": "after"}
    assert steps.ready()
    steps.open()
    await parked
    assert state(steps, "e") == "running" and steps.blockers() == ["e"]


async def test_replay_step_that_ended_in_a_checkpoint_runs_again_after_open() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    steps.close()
    async with steps.step("e", "replay"):  # starts while closed
        assert steps.ready()
    assert steps.ready()
    steps.open()  # no boundary came: back to running
    assert state(steps, "e") == "running" and steps.blockers() == ["e"]
    check(steps)


async def test_wait_step_ending_during_checkpoint_blocks_until_its_boundary() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    steps.close()
    async with steps.step("e", "wait"):
        assert steps.blockers() == ["e"]
    assert state(steps, "e") == "running" and steps.blockers() == ["e"]
    parked = start(lambda: steps.boundary("e", 7))
    await settle()
    assert steps.ready() and steps.exported() == {"e": 7}
    steps.open()
    await parked


# -- exported shapes --------------------------------------------------------------------------

async def test_exported_shapes() -> None:
    steps = EpisodeSteps()
    steps.begin("fresh")  # no boundary yet
    steps.begin("restored", continuation={"next": "verify", "turn": 3})
    steps.begin("running")
    fresh = steps.step("fresh", "replay")
    restored = steps.step("restored", "replay")
    await fresh.__aenter__()
    await restored.__aenter__()
    steps.close()
    assert steps.exported() == {"fresh": None, "restored": {"next": "verify", "turn": 3}}
    assert steps.blockers() == ["running"]
    assert list(steps.exported()) == ["fresh", "restored"]
    await fresh.__aexit__(None, None, None)
    await restored.__aexit__(None, None, None)
    assert steps.exported() == {"fresh": None, "restored": {"next": "verify", "turn": 3}}
    steps.open()
    assert steps.exported() == {}


# -- restarts ---------------------------------------------------------------------------------

async def test_restarts_never_block_park_or_export() -> None:
    steps = EpisodeSteps()
    steps.begin("z-restart", restart=True)
    steps.begin("a-restart", restart=True)
    assert steps.ready() and steps.restarts() == ["a-restart", "z-restart"]
    steps.close()
    async with steps.step("z-restart", "wait"):
        assert steps.ready()
    await asyncio.wait_for(steps.boundary("z-restart", "b"), 1)  # does not park
    assert state(steps, "z-restart") == "running"
    async with steps.step("a-restart", "replay"):
        assert steps.exported() == {}
    assert steps.exported() == {} and steps.ready()
    check(steps)


async def test_retiring_restart_still_blocks() -> None:
    steps = EpisodeSteps()
    release = asyncio.Event()

    async def episode() -> None:
        steps.begin("r", restart=True)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()
            raise

    task = start(episode)
    await settle()
    steps.close()
    assert steps.ready() and steps.restarts() == ["r"]
    retiring = start(lambda: steps.retire("r"))
    await settle()
    assert steps.blockers() == ["r"] and steps.restarts() == [] and steps.exported() == {}
    release.set()
    assert await retiring is True
    assert task.cancelled() and steps.ready() and "r" not in steps


async def test_mark_restart_waits_for_an_open_checkpoint() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    async with steps.step("e", "replay"):
        steps.close()
        marking = start(lambda: steps.mark_restart("e"))
        await settle()
        assert not marking.done() and steps.restarts() == []
        assert steps.exported() == {"e": None}  # the pre-seed boundary is still exported
    steps.open()
    await asyncio.wait_for(marking, 1)
    assert steps.restarts() == ["e"] and steps.ready()


async def test_mark_restart_stops_blocking_when_open() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    assert steps.blocker_count() == 1
    await steps.mark_restart("e")
    await steps.mark_restart("e")  # idempotent
    assert steps.blocker_count() == 0 and steps.restarts() == ["e"]


# -- retire -----------------------------------------------------------------------------------

class Stubborn:
    """An episode whose cleanup after cancellation waits for ``release``; counts cancellations."""

    def __init__(self, steps: EpisodeSteps, key: str) -> None:
        self.steps, self.key = steps, key
        self.release = asyncio.Event()
        self.cancels = 0
        self.cancelling_at_end = -1

    async def run(self) -> None:
        self.steps.begin(self.key)
        try:
            await self.steps.boundary(self.key, "b")
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancels += 1
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancels += 1
            raise
        finally:
            task = asyncio.current_task()
            assert task is not None
            self.cancelling_at_end = task.cancelling()
            self.steps.end(self.key)  # no-op: retire forgets a retired episode


async def test_retire_cut_short_keeps_episode_tracked_and_blocking() -> None:
    steps = EpisodeSteps()
    ep = Stubborn(steps, "r")
    steps.close()
    task = start(ep.run)
    await settle()
    assert state(steps, "r") == "parked" and steps.ready() and steps.exported() == {"r": "b"}

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(steps.retire("r"), 0.05)
    assert ep.cancels == 1 and not task.done()
    assert "r" in steps and steps.blockers() == ["r"] and not steps.ready()
    assert steps.exported() == {}  # a retiring episode is never exported
    with pytest.raises(ValueError, match="already running"):
        steps.begin("r")
    check(steps)

    retry = start(lambda: steps.retire("r"))
    await settle()
    assert ep.cancels == 1 and not retry.done()  # waits again without cancelling again
    ep.release.set()
    assert await retry is True
    assert ep.cancels == 1 and ep.cancelling_at_end == 1 and task.cancelled()
    assert "r" not in steps and steps.ready()
    steps.begin("r")  # the key is free once the episode is forgotten


async def test_retire_after_its_task_ended_still_forgets() -> None:
    steps = EpisodeSteps()
    ep = Stubborn(steps, "r")
    task = start(ep.run)
    await settle()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(steps.retire("r"), 0.01)
    ep.release.set()
    await asyncio.gather(task, return_exceptions=True)
    assert "r" in steps and steps.blockers() == ["r"]  # task over, still tracked
    assert await steps.retire("r") is True
    assert "r" not in steps and steps.ready() and ep.cancels == 1


async def test_concurrent_retires_cancel_each_episode_once() -> None:
    steps = EpisodeSteps()
    eps = [Stubborn(steps, f"r{i}") for i in range(4)]
    tasks = [start(e.run) for e in eps]
    await settle()
    retires = [asyncio.ensure_future(steps.retire(e.key)) for e in eps for _ in range(3)]
    await settle()
    assert steps.blocker_count() == 4
    for e in eps:
        e.release.set()
    assert await asyncio.gather(*retires) == [True] * 12
    assert [e.cancels for e in eps] == [1] * 4
    assert all(t.cancelled() for t in tasks) and len(steps) == 0 and steps.ready()


async def test_retire_wakes_a_parked_episode_with_cancellation() -> None:
    steps = EpisodeSteps()
    gate = Gate(steps, "e")
    task = start(lambda: gate.step("replay", "b"))
    await settle()
    steps.close()
    gate.go.set()
    await settle()
    assert state(steps, "e") == "parked"
    assert await steps.retire("e") is True
    assert task.cancelled() and not gate.done and "e" not in steps


async def test_episode_cannot_retire_itself() -> None:
    steps = EpisodeSteps()
    steps.begin("me")
    with pytest.raises(RuntimeError, match="itself"):
        await steps.retire("me")


# -- deadlines --------------------------------------------------------------------------------

async def test_parked_time_does_not_consume_the_deadline() -> None:
    steps = EpisodeSteps()

    async def episode() -> str:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.3):
                await steps.boundary("e", 1)  # parks for ~0.5 s
                await asyncio.sleep(0.05)
            return "completed"
        finally:
            steps.end("e")

    steps.close()
    task = start(episode)
    await asyncio.sleep(0.5)
    assert not task.done() and state(steps, "e") == "parked"
    steps.open()
    assert await task == "completed"


async def test_deadline_still_runs_after_parking() -> None:
    steps = EpisodeSteps()

    async def episode() -> None:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.3):
                await steps.boundary("e", 1)
                await asyncio.sleep(5)
        finally:
            steps.end("e")

    steps.close()
    task = start(episode)
    await asyncio.sleep(0.1)
    steps.open()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, 3)


async def test_replay_step_in_a_checkpoint_does_not_consume_the_deadline() -> None:
    steps = EpisodeSteps()

    async def episode() -> str:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.3):
                async with steps.step("e", "replay"):
                    await asyncio.sleep(0.5)  # the checkpoint is closed meanwhile
                await steps.boundary("e", 2)
            return "completed"
        finally:
            steps.end("e")

    task = start(episode)
    await settle()
    steps.close()
    await asyncio.sleep(0.6)
    assert state(steps, "e") == "parked"
    steps.open()
    assert await task == "completed"


async def test_replay_step_starting_in_a_checkpoint_does_not_consume_the_deadline() -> None:
    steps = EpisodeSteps()

    async def episode() -> str:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.3):
                async with steps.step("e", "replay"):
                    await asyncio.sleep(0.5)
                await steps.boundary("e", 2)
            return "completed"
        finally:
            steps.end("e")

    steps.close()
    task = start(episode)
    await asyncio.sleep(0.6)
    assert state(steps, "e") == "parked"
    steps.open()
    assert await task == "completed"


async def test_open_resumes_the_deadline_of_a_replay_step() -> None:
    steps = EpisodeSteps()

    async def episode() -> str:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.3):
                async with steps.step("e", "replay"):
                    await asyncio.sleep(5)  # outlives the checkpoint
        except TimeoutError:
            return "timed out"
        finally:
            steps.end("e")
        return "completed"

    task = start(episode)
    await settle()
    steps.close()
    await asyncio.sleep(0.5)
    assert not task.done()
    steps.open()
    assert await asyncio.wait_for(task, 3) == "timed out"


async def test_wait_step_in_a_checkpoint_consumes_the_deadline() -> None:
    steps = EpisodeSteps()

    async def episode() -> None:
        steps.begin("e")
        try:
            async with steps.deadline("e", 0.2):
                async with steps.step("e", "wait"):
                    await asyncio.sleep(2)
        finally:
            steps.end("e")

    task = start(episode)
    await settle()
    steps.close()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, 3)


async def test_one_deadline_at_a_time() -> None:
    steps = EpisodeSteps()
    steps.begin("e")
    async with steps.deadline("e", None):
        pass
    async with steps.deadline("e", 10):
        with pytest.raises(RuntimeError, match="already has a deadline"):
            async with steps.deadline("e", 1):
                pass


# -- readiness --------------------------------------------------------------------------------

async def test_listener_called_only_while_closed() -> None:
    steps = EpisodeSteps()
    seen: list[tuple[bool, int]] = []
    steps.add_listener(lambda: seen.append((steps.closed, steps.blocker_count())))
    steps.begin("a")
    steps.begin("b")
    for _ in range(3):
        async with steps.step("a", "replay"):
            pass
        await steps.boundary("a", 1)
    assert seen == []
    steps.close()
    assert seen == []  # closing changes no count
    async with steps.step("a", "replay"):
        assert seen == [(True, 1)]
    parked = start(lambda: steps.boundary("a", 2))
    await settle()
    assert seen == [(True, 1)]  # the replay step ended in the checkpoint: no change
    steps.begin("c")
    assert seen == [(True, 1), (True, 2)]
    steps.end("c")
    steps.end("b")
    assert seen[-1] == (True, 0) and steps.ready()
    steps.open()
    await parked
    calls = len(seen)
    steps.begin("d")
    steps.end("d")
    assert len(seen) == calls


async def test_failing_listener_does_not_break_a_transition() -> None:
    steps = EpisodeSteps()
    calls: list[int] = []

    def bad() -> None:
        raise RuntimeError("boom")

    steps.add_listener(bad)
    steps.add_listener(lambda: calls.append(steps.blocker_count()))
    steps.close()
    steps.begin("a")
    assert calls == [1] and steps.blockers() == ["a"]
    steps.remove_listener(bad)
    steps.remove_listener(bad)
    steps.end("a")
    assert calls == [1, 0]


async def test_blockers_capped_and_sorted() -> None:
    steps = EpisodeSteps()
    keys = [f"r{i:04d}" for i in range(250)]
    for key in random.Random(7).sample(keys, len(keys)):
        steps.begin(key)
    assert steps.blocker_count() == 250
    assert steps.blockers() == keys[:MAX_BLOCKERS_LISTED]
    assert steps.blockers(limit=5) == keys[:5]
    assert steps.blockers(limit=0) == []
    for key in keys[:3]:
        await steps.mark_restart(key)
    assert steps.blockers(limit=2) == keys[3:5] and steps.blocker_count() == 247
    assert steps.restarts() == keys[:3]  # never capped


async def test_counting_does_not_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = EpisodeSteps()
    for i in range(200):
        steps.begin(f"p{i}")
        await steps.mark_restart(f"p{i}")
    steps.begin("e")
    calls = 0
    real = steps_module._Episode.blocks

    def counted(self: Any) -> bool:
        nonlocal calls
        calls += 1
        return real(self)

    monkeypatch.setattr(steps_module._Episode, "blocks", counted)
    async with steps.step("e", "replay"):
        pass
    await steps.boundary("e", 1)
    assert calls <= 6  # per-transition work, independent of the 200 other episodes
    await steps.mark_restart("e")
    calls = 0
    assert steps.blockers() == [] and steps.ready() and calls == 0  # no scan at count 0


# -- the counter against random operation sequences -------------------------------------------

class Driver:
    """One episode task taking commands: a step mode, ``exit``, ``boundary`` or ``end``."""

    def __init__(self, steps: EpisodeSteps, key: str, **begin: Any) -> None:
        self.steps, self.key = steps, key
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.boundaries = 0
        self.task = asyncio.ensure_future(self.run(begin))

    async def run(self, begin: dict[str, Any]) -> None:
        self.steps.begin(self.key, **begin)
        async with contextlib.AsyncExitStack() as stack:
            in_step = False
            while True:
                cmd = await self.queue.get()
                if cmd in ("wait", "replay") and not in_step:
                    await stack.enter_async_context(self.steps.step(self.key, cmd))  # type: ignore[arg-type]
                    in_step = True
                elif cmd == "exit" and in_step:
                    await stack.aclose()
                    in_step = False
                elif cmd == "boundary" and not in_step:
                    self.boundaries += 1
                    await self.steps.boundary(self.key, {"n": self.boundaries})
                elif cmd == "end":
                    break
        self.steps.end(self.key)


@pytest.mark.parametrize("seed", range(8))
async def test_counter_equals_fresh_count_over_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    steps = EpisodeSteps()

    def listener() -> None:
        assert steps.closed
        assert steps.blocker_count() == len(fresh_blockers(steps))

    steps.add_listener(listener)
    drivers: dict[str, Driver] = {}
    background: list[asyncio.Task[Any]] = []
    next_key = 0
    for _ in range(400):
        op = rng.choices(
            ["begin", "cmd", "close", "open", "restart", "retire", "cut_retire"],
            weights=[3, 12, 2, 2, 1, 1, 1],
        )[0]
        live = [k for k in drivers if k in steps]
        if op == "begin" or not live:
            key = f"k{next_key:03d}"
            next_key += 1
            cont = rng.choice([None, {"restored": key}])
            drivers[key] = Driver(steps, key, continuation=cont, restart=rng.random() < 0.15)
        elif op == "cmd":
            key = rng.choice(live)
            drivers[key].queue.put_nowait(rng.choice(["wait", "replay", "exit", "boundary", "end"]))
        elif op == "close":
            steps.close()
        elif op == "open":
            steps.open()
        elif op == "restart":
            background.append(asyncio.ensure_future(steps.mark_restart(rng.choice(live))))
        elif op == "retire":
            background.append(asyncio.ensure_future(steps.retire(rng.choice(live))))
        else:
            cut = asyncio.ensure_future(steps.retire(rng.choice(live)))
            await asyncio.sleep(0)
            cut.cancel()
        await settle(rng.randint(0, 4))
        check(steps)
    steps.open()
    for key in steps.live():
        await steps.retire(key)
    await settle()
    for task in background:
        with contextlib.suppress(KeyError):
            await task
    assert steps.live() == [] and steps.blocker_count() == 0
    check(steps)
