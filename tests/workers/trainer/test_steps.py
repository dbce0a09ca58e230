"""The step record file: durable, validated on read."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.trainer import StepRecordError, read_step_record, write_step_record


def test_a_record_round_trips_and_replaces_the_previous_one(tmp_path: Path) -> None:
    write_step_record(tmp_path, 4, "j4", "started")
    written = write_step_record(tmp_path, 4, "j4", "applied")
    assert read_step_record(tmp_path) == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.json"]


@pytest.mark.parametrize(("content", "rule"), [
    ("{", "unreadable"),
    ('{"format": 2}', "format 1"),
    ('{"format": 1, "step": -1, "job_id": "j", "phase": "applied", "at": 1}', "step -1"),
    ('{"format": 1, "step": 1, "job_id": "", "phase": "applied", "at": 1}', "job_id ''"),
    ('{"format": 1, "step": 1, "job_id": "j", "phase": "done", "at": 1}', "phase 'done'"),
    ('{"format": 1, "step": 1, "job_id": "j", "phase": "applied", "at": "x"}', "at 'x'"),
])
def test_a_malformed_record_is_refused_by_rule(tmp_path: Path, content: str, rule: str) -> None:
    (tmp_path / "step.json").write_text(content)
    with pytest.raises(StepRecordError, match=rule):
        read_step_record(tmp_path)
