"""The in-memory view of a step's open calls (``engine/workflows/checkpoint/open_calls.py``)."""

from __future__ import annotations

from engine.workflows.checkpoint.open_calls import OpenCalls
from journal import Committed


def settled(*ids: str, state: str = "succeeded") -> list[Committed]:
    return [Committed("rpc_calls", i, "inflight", state, 2) for i in ids]


def test_a_step_waits_until_its_last_call_settles_then_not() -> None:
    calls = OpenCalls()
    calls.track("ck", 3, deadline=100.0, calls=["a", "b", "c"])
    assert calls.waiting_until("ck", 3, now=10.0, margin=2.0) == 100.0
    calls.on_commit(settled("a") + [Committed("rpc_calls", "b", "inflight", "pending", 2)])  # a retry is not settled
    assert calls.waiting_until("ck", 3, now=10.0, margin=2.0) == 100.0
    calls.on_commit(settled("b", state="failed") + settled("c", state="ambiguous"))
    assert calls.waiting_until("ck", 3, now=10.0, margin=2.0) is None


def test_the_view_is_trusted_only_at_its_version_and_before_the_deadline() -> None:
    calls = OpenCalls()
    calls.track("ck", 3, deadline=100.0, calls=["a"])
    assert calls.waiting_until("ck", 4, now=10.0, margin=2.0) is None  # the row moved on: read the journal
    assert calls.waiting_until("ck", None, now=10.0, margin=2.0) == 100.0
    assert calls.waiting_until("ck", 3, now=102.5, margin=2.0) is None  # past the deadline: read the journal
    assert calls.waiting_until("other", None, now=10.0, margin=2.0) is None


def test_tracking_the_same_version_again_keeps_what_commits_told_it() -> None:
    calls = OpenCalls()
    calls.track("ck", 3, deadline=100.0, calls=["a", "b"])
    calls.on_commit(settled("a"))  # settles while the owner reads the calls...
    calls.track("ck", 3, deadline=100.0, calls=["a", "b"], settled=[])  # ...with a read older than that commit
    assert calls.waiting_until("ck", 3, now=1.0, margin=0.0) == 100.0
    calls.track("ck", 3, deadline=100.0, calls=["a", "b"], settled=["b"])
    assert calls.waiting_until("ck", 3, now=1.0, margin=0.0) is None


def test_a_new_step_or_forget_drops_the_old_calls() -> None:
    calls = OpenCalls()
    calls.track("ck", 3, deadline=100.0, calls=["a", "b"])
    calls.track("ck", 5, deadline=200.0, calls=["c"], settled=["x"])
    calls.on_commit(settled("a", "b"))  # the old step's calls no longer count for anything
    assert calls.waiting_until("ck", 5, now=1.0, margin=0.0) == 200.0
    calls.forget("ck")
    assert calls.waiting_until("ck", None, now=1.0, margin=0.0) is None
    calls.on_commit(settled("c"))  # a late outcome of a forgotten step is ignored
    assert calls._owner_of == {} and calls._steps == {}  # noqa: SLF001 - nothing is left behind
