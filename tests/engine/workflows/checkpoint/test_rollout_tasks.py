"""Submitting rollouts (engine/workflows/checkpoint/rollout_tasks.py) on both journal backends: new rows are
``pending`` at attempt 0; the same id with the same input is a no-op; another input is a typed
conflict that writes nothing of the batch; every bad task is refused naming its field and rule."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from engine.workflows.checkpoint.rollout_tasks import InvalidTask, ReservedSuffix, RolloutConflict, check_task, submit_rollouts
from journal import Journal, audit, models

TASK = {"prompt": "p", "turns": 2}


async def submit(journal: Journal, *raw: Any) -> list[tuple[str, str]]:
    tasks = [check_task(r, i) for i, r in enumerate(raw)]
    async with journal.write() as tx:
        return [(s.rollout_id, s.disposition) for s in await submit_rollouts(tx, tasks)]


async def rows(journal: Journal) -> dict[str, dict[str, Any]]:
    async with journal.read() as conn:
        return {r.id: dict(r._mapping) for r in (await conn.execute(sa.select(models.rollouts))).all()}


async def test_new_rollouts_are_pending_at_their_first_attempt(journal: Journal) -> None:
    got = await submit(journal, {"rollout_id": "a", "input": TASK, "labels": {"split": "train"}},
                       {"input": {"prompt": "q", "turns": 1}})
    derived = got[1][0]
    assert got == [("a", "new"), (derived, "new")]
    assert derived.startswith("r-") and len(derived) == 34
    table = await rows(journal)
    assert {k: (v["state"], v["attempt"], v["failures"], v["task"], v["labels"]) for k, v in table.items()} == {
        "a": ("pending", 0, 0, TASK, {"split": "train"}), derived: ("pending", 0, 0, {"prompt": "q", "turns": 1}, None)}
    async with journal.read() as conn:
        events = await audit.query_events(conn, audit.EventFilter(entity_kind="rollouts", entity_id="a"))
    assert [(e["from_state"], e["to_state"], e["reason"]) for e in events] == [(None, "pending", "submitted")]
    assert await audit.verify(journal) == []


async def test_the_same_input_again_is_a_no_op_and_another_input_a_conflict(journal: Journal) -> None:
    await submit(journal, {"rollout_id": "a", "input": TASK})
    # Key order does not make another input: the canonical JSON is compared.
    assert await submit(journal, {"rollout_id": "a", "input": {"turns": 2, "prompt": "p"}},
                        {"rollout_id": "b", "input": TASK}) == [("a", "existing"), ("b", "new")]
    before = await rows(journal)
    with pytest.raises(RolloutConflict) as caught:
        await submit(journal, {"rollout_id": "c", "input": TASK}, {"rollout_id": "a", "input": {"prompt": "x", "turns": 2}})
    assert (caught.value.rollout_id, caught.value.index, caught.value.in_batch) == ("a", 1, False)
    assert "nothing of this batch was written" in str(caught.value)
    assert await rows(journal) == before  # "c" was not written either
    with pytest.raises(RolloutConflict) as twice:
        await submit(journal, {"rollout_id": "d", "input": TASK}, {"rollout_id": "d", "input": {"prompt": "y", "turns": 1}})
    assert (twice.value.rollout_id, twice.value.index, twice.value.in_batch) == ("d", 1, True)
    assert await rows(journal) == before
    # The same id twice with the same input is one rollout.
    assert await submit(journal, {"rollout_id": "e", "input": TASK}, {"rollout_id": "e", "input": TASK}) == [
        ("e", "new"), ("e", "existing")]


def test_a_reserved_attempt_suffix_is_refused_naming_the_attempt_and_rollout() -> None:
    with pytest.raises(ReservedSuffix) as caught:
        check_task({"rollout_id": "job-a2", "input": TASK}, 3)
    exc = caught.value
    assert (exc.index, exc.field, exc.rollout_id, exc.suffix, exc.attempt, exc.rollout) == (
        3, "rollout_id", "job-a2", "-a2", 2, "job")
    assert str(exc) == ("task 3: rollout_id='job-a2': ends with the reserved attempt suffix -a2 (it would name "
                        "attempt 2 of rollout 'job')")
    # -a0 names no attempt, and a suffix in the middle is no suffix.
    assert check_task({"rollout_id": "job-a0", "input": TASK}).rollout_id == "job-a0"
    assert check_task({"rollout_id": "job-a2x", "input": TASK}).rollout_id == "job-a2x"


@pytest.mark.parametrize(("raw", "field", "rule"), [
    ([1], "task", "must be a JSON object, not list"),
    ({"input": TASK, "extra": 1}, "extra", "unknown field"),
    ({"rollout_id": "a"}, "input", "is required"),
    ({"rollout_id": "x" * 256, "input": TASK}, "rollout_id", "must be 1..255 characters (got 256)"),
    ({"rollout_id": "", "input": TASK}, "rollout_id", "must be 1..255 characters (got 0)"),
    ({"rollout_id": "a\x00b", "input": TASK}, "rollout_id", "must not contain a NUL character"),
    ({"rollout_id": "a b", "input": TASK}, "rollout_id", "must start with a letter or digit"),
    ({"rollout_id": "-a", "input": TASK}, "rollout_id", "must start with a letter or digit"),
    ({"rollout_id": 7, "input": TASK}, "rollout_id", "must be a string"),
    ({"input": float("nan")}, "input", "must be JSON"),
    ({"input": {"prompt": "a\x00"}}, "input", "must not contain a NUL character"),
    ({"input": "x" * (64 << 10)}, "input", "must be at most 65536 bytes encoded"),
    ({"input": TASK, "labels": [1]}, "labels", "must be a JSON object"),
    ({"input": TASK, "labels": {"k": "v" * 5000}}, "labels", "must be at most 4096 bytes encoded"),
])
def test_bad_tasks_are_refused_naming_the_field_and_the_rule(raw: Any, field: str, rule: str) -> None:
    with pytest.raises(InvalidTask) as caught:
        check_task(raw, 0)
    assert caught.value.field == field and rule in caught.value.rule, caught.value
    assert str(caught.value).startswith(f"task 0: {field}="), caught.value


def test_a_200_character_id_is_accepted() -> None:
    assert check_task({"rollout_id": "r" * 200, "input": TASK}).rollout_id == "r" * 200
