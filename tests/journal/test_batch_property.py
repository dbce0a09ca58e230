"""Property: random batches of random groups (legal, illegal, stale) against a serial model.

The model applies the groups of a call one after another, each all-or-nothing: a
group with an operation ``prepare`` refuses (illegal edge, unknown column, NaN)
fails with that error; otherwise its operations run in order on the model and
the first create of an existing row (not ``if_absent``) or compare-and-set that
does not match fails the group. After every call the outcomes, the rows and the
events equal the model's, and ``audit.verify`` finds nothing. Every call is fenced
(a live lease), so PostgreSQL's lazy fence check runs on every path.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from journal import (
    Committed,
    Create,
    DuplicateEntity,
    Fence,
    IllegalTransition,
    InvalidColumn,
    InvalidPayload,
    Journal,
    StaleRow,
    Transition,
    audit,
    lease,
    models,
)
from tests.support.gauges import G, GAUGE_KIND, GAUGES, C, T, gauges, open_gauge_journal

TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=6)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False,
                    allow_infinity=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(TEXT, inner, max_size=2),
                    max_leaves=4)
TIMES = st.datetimes(min_value=datetime(1971, 1, 2), max_value=datetime(2200, 1, 1),
                     timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=-3))]))
# No None for the typed nullable columns: on PostgreSQL a column set to None in every row of a
# VALUES statement fails the whole call (test_batch.py::test_a_column_cleared_in_every_row...).
VALUES = st.fixed_dictionaries({}, optional={
    "label": st.none() | TEXT, "hits": st.integers(-(2**31), 2**31 - 1),
    "ratio": st.floats(allow_nan=False, allow_infinity=False), "big": st.integers(-(2**63), 2**63 - 1),
    "data": JSON.filter(lambda v: v is not None), "seen_at": TIMES,
})
STATES = sorted(GAUGES.states)
CONFLICT = (StaleRow, DuplicateEntity)


@dataclass
class Ent:
    state: str
    version: int
    values: dict[str, Any]
    events: int = 1


@dataclass
class Model:
    rows: dict[str, Ent] = field(default_factory=dict)


def static_error(op: Create | Transition) -> type[Exception] | None:
    """What ``WriteTx.prepare`` refuses, in its order of checks."""
    if isinstance(op, Transition) and op.to_state not in GAUGES.allowed(op.from_state):
        return IllegalTransition
    columns = op.values if isinstance(op, Create) else op.changes
    if any(c not in GAUGE_KIND.data_columns for c in columns):
        return InvalidColumn
    if any(isinstance(v, float) and math.isnan(v) for v in columns.values()):
        return InvalidPayload
    return None


def run_group(model: Model, group: list[Create | Transition]) -> list[Committed | None] | type[Exception]:
    """The group's outcome on the model; the model changes only if the group succeeds."""
    for op in group:
        err = static_error(op)
        if err is not None:
            return err
    trial = copy.deepcopy(model.rows)
    out: list[Committed | None] = []
    for op in group:
        cur = trial.get(op.entity_id)
        if isinstance(op, Create):
            if cur is not None:
                if not op.if_absent:
                    return DuplicateEntity
                out.append(None)
                continue
            trial[op.entity_id] = Ent("new", 1, {**GAUGE_KIND.defaults(), **op.values})
            out.append(Committed(G, op.entity_id, None, "new", 1))
            continue
        if cur is None or (cur.state, cur.version) != (op.from_state, op.version):
            return StaleRow
        cur.state, cur.version, cur.events = op.to_state, op.version + 1, cur.events + 1
        cur.values.update(op.changes)
        out.append(Committed(G, op.entity_id, op.from_state, op.to_state, op.version + 1))
    model.rows = trial
    return out


def draw_op(data: st.DataObject, spec: dict[str, tuple[str, int]], prefix: str) -> Create | Transition:
    """An operation aimed at ``spec`` (where the entities will be if every earlier draw succeeds)."""
    eid = prefix + data.draw(st.sampled_from("abcd"), label="entity")
    values: dict[str, Any] = dict(data.draw(VALUES, label="values"))
    flaw = data.draw(st.sampled_from([None] * 18 + ["column", "nan"]), label="flaw")
    if flaw == "column":
        values["bogus"] = 1
    elif flaw == "nan":
        values["ratio"] = math.nan
    if eid not in spec or data.draw(st.integers(0, 5), label="create?") == 5:
        spec.setdefault(eid, ("new", 1))
        return C(eid, if_absent=data.draw(st.booleans(), label="if_absent"), **values)
    state, version = spec[eid]
    allowed = sorted(GAUGES.allowed(state))
    legal = data.draw(st.integers(0, 11), label="illegal?") < 11
    to = data.draw(st.sampled_from(allowed if allowed and legal else STATES), label="to")
    aim = data.draw(st.sampled_from(["exact"] * 9 + ["old", "future", "state"]), label="aim")
    if aim == "old":
        version -= 1
    elif aim == "future":
        version += 1
    elif aim == "state":
        state = next(s for s in STATES if s != state)
    if aim == "exact" and to in allowed and flaw is None:
        spec[eid] = (to, version + 1)
    return T(eid, state, version, to, **values)


async def check_db(journal: Journal, model: Model, prefix: str) -> None:
    e = models.events
    async with journal.read() as conn:
        rows = {r.id: r._mapping for r in (await conn.execute(
            sa.select(gauges).where(gauges.c.id.startswith(prefix)))).all()}
        counts: dict[str, int] = dict((await conn.execute(
            sa.select(e.c.entity_id, sa.func.count()).where(e.c.entity_kind == G, e.c.entity_id.startswith(prefix))
            .group_by(e.c.entity_id))).tuples().all())
    assert sorted(rows) == sorted(model.rows)
    for eid, ent in model.rows.items():
        found = rows[eid]
        assert (found["state"], found["version"], counts.get(eid)) == (ent.state, ent.version, ent.events), eid
        for column, value in ent.values.items():
            assert found[column] == value, (eid, column, found[column], value)
    assert [m for m in await audit.verify(journal, [G]) if m.entity_id.startswith(prefix)] == []


PROPERTY = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
EXAMPLES = itertools.count()


@pytest.fixture
async def gj(make_journal: Callable[..., Journal]) -> tuple[Journal, Fence]:
    """The journal and a fence for every call (an hour-long lease: it never lapses here)."""
    journal = await open_gauge_journal(make_journal)
    held = await lease.acquire(journal, "leader", "orch", 3600.0)
    assert held is not None
    return journal, held.fence()


@PROPERTY
@given(data=st.data())
async def test_random_batches_match_the_serial_model(gj: tuple[Journal, Fence], data: st.DataObject) -> None:
    journal, fence = gj
    prefix = f"x{next(EXAMPLES)}-"  # earlier examples' rows stay in the journal, untouched
    model, spec = Model(), dict[str, tuple[str, int]]()
    for _ in range(data.draw(st.integers(1, 3), label="calls")):
        groups = [[draw_op(data, spec, prefix) for _ in range(data.draw(st.integers(1, 3), label="ops"))]
                  for _ in range(data.draw(st.integers(1, 6), label="groups"))]
        outcomes = await journal.apply(groups, fence)
        assert len(outcomes) == len(groups)
        for g, (group, actual) in enumerate(zip(groups, outcomes)):
            expected = run_group(model, group)
            if isinstance(expected, list):
                assert actual == expected, (g, groups, outcomes)
            elif issubclass(expected, CONFLICT):
                assert isinstance(actual, CONFLICT), (g, groups, outcomes)
            else:
                assert type(actual) is expected, (g, groups, outcomes)
        await check_db(journal, model, prefix)
        spec = {eid: (ent.state, ent.version) for eid, ent in model.rows.items()}
