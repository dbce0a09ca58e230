"""State machines as data, entity kinds, and a property test of the transition primitive."""

from __future__ import annotations

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
    EntityKind,
    IllegalTransition,
    Journal,
    KindRegistry,
    StaleRow,
    StateMachine,
    UnknownEntityKind,
    UnknownState,
    audit,
    builtin_kinds,
    models,
)
from journal.machines import PARTICIPANTS, RPC_CALLS
from journal.types import JSONValue, UTCDateTime
from tests.support.journal_state import events, row

# -- machines ---------------------------------------------------------------------------------

WIDGETS = StateMachine.build(
    "widgets",
    initial=["new", "imported"],
    edges={"new": ["ready", "dead"], "imported": ["ready"], "ready": ["ready", "busy", "dead"],
           "busy": ["ready", "done", "dead"]},
    terminal=["done", "dead"],
)


def test_construction_refuses_an_edge_to_an_undeclared_state() -> None:
    with pytest.raises(ValueError, match="ends outside the machine"):
        StateMachine.build("k", initial=["a"], edges={"a": ["b", "helthy"], "b": []}, terminal=["b"])


def test_construction_refuses_terminal_states_with_outgoing_edges() -> None:
    with pytest.raises(ValueError, match="terminal state 'done' has outgoing edges"):
        StateMachine.build("k", initial=["a"], edges={"a": ["done"], "done": ["a"]}, terminal=["done"])


def test_construction_needs_an_initial_state() -> None:
    with pytest.raises(ValueError, match="at least one initial state"):
        StateMachine.build("k", initial=[], edges={"a": ["b"]}, terminal=["b"])


def test_a_terminal_state_may_list_no_edges() -> None:
    machine = StateMachine.build("k", initial=["a"], edges={"a": ["b"], "b": []}, terminal=["b"])
    assert machine.allowed("b") == frozenset()


def test_states_active_and_allowed() -> None:
    assert WIDGETS.states == {"new", "imported", "ready", "busy", "done", "dead"}
    assert WIDGETS.active == {"new", "imported", "ready", "busy"}
    assert WIDGETS.allowed("ready") == {"ready", "busy", "dead"}
    assert WIDGETS.allowed("done") == frozenset()
    assert WIDGETS.edge_list()[:3] == [("busy", "dead"), ("busy", "done"), ("busy", "ready")]


def test_check_accepts_edges_and_refuses_the_rest() -> None:
    WIDGETS.check("w1", "ready", "ready")
    WIDGETS.check("w1", "busy", "done")
    with pytest.raises(IllegalTransition) as info:
        WIDGETS.check("w1", "new", "busy")
    assert (info.value.kind, info.value.entity_id, info.value.allowed) == ("widgets", "w1", ["dead", "ready"])
    with pytest.raises(IllegalTransition, match=r"\(none, terminal\)"):
        WIDGETS.check("w1", "done", "ready")
    with pytest.raises(UnknownState) as unknown:
        WIDGETS.check("w1", "ready", "exploded")
    assert unknown.value.state == "exploded"
    with pytest.raises(UnknownState):
        WIDGETS.check("w1", "limbo", "ready")


def test_check_initial() -> None:
    WIDGETS.check_initial("w1", "imported")
    with pytest.raises(IllegalTransition) as info:
        WIDGETS.check_initial("w1", "ready")
    assert info.value.from_state is None and info.value.allowed == ["imported", "new"]
    with pytest.raises(UnknownState):
        WIDGETS.check_initial("w1", "nowhere")


def test_mermaid() -> None:
    machine = StateMachine.build("k", initial=["a"], edges={"a": ["b", "a"], "b": ["c"]}, terminal=["c"])
    assert machine.mermaid() == "\n".join([
        "stateDiagram-v2",
        "    [*] --> a",
        "    a --> a",
        "    a --> b",
        "    b --> c",
        "    c --> [*]",
    ])
    assert PARTICIPANTS.mermaid().splitlines()[:2] == ["stateDiagram-v2", "    [*] --> pending"]


@pytest.mark.parametrize("machine", [PARTICIPANTS, RPC_CALLS], ids=lambda m: m.kind)
def test_builtin_machines_are_well_formed(machine: StateMachine) -> None:
    # Every state is reachable from an initial state, and only terminal states are dead ends.
    seen, todo = set(machine.initial), list(machine.initial)
    while todo:
        for nxt in machine.allowed(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == machine.states
    assert {s for s in machine.states if not machine.allowed(s)} == machine.terminal


# -- kinds --------------------------------------------------------------------------------------

widget_metadata = sa.MetaData()
widgets = sa.Table(
    "widgets", widget_metadata, *models.entity_columns(),
    sa.Column("label", sa.Text, nullable=True),
    sa.Column("count", sa.Integer, nullable=False, default=0),
    sa.Column("score", sa.Float, nullable=True),
    sa.Column("meta", JSONValue(), nullable=True),
    sa.Column("seen_at", UTCDateTime(), nullable=True),
)
WIDGET_KIND = EntityKind("widgets", widgets, WIDGETS)


def test_entity_kind_invariants() -> None:
    bare = sa.Table("bare", sa.MetaData(), sa.Column("id", sa.String, primary_key=True))
    with pytest.raises(ValueError, match="lacks entity columns"):
        EntityKind("widgets", bare, WIDGETS)
    with pytest.raises(ValueError, match="machine is for 'widgets'"):
        EntityKind("gadgets", widgets, WIDGETS)
    assert WIDGET_KIND.data_columns == ("label", "count", "score", "meta", "seen_at")
    assert WIDGET_KIND.defaults() == {"label": None, "count": 0, "score": None, "meta": None, "seen_at": None}


def test_registry() -> None:
    kinds = builtin_kinds()
    assert kinds.names() == ["checkpoint_members", "checkpoints", "engines", "participants", "restores",
                             "retirements", "rollouts", "rpc_calls", "services", "training_batches", "training_jobs",
                             "weight_versions"]
    kinds.register(WIDGET_KIND)
    kinds.register(EntityKind("widgets", widgets, WIDGETS))  # the same again is fine
    assert "widgets" in kinds and kinds.get("widgets") == WIDGET_KIND
    other = StateMachine.build("widgets", initial=["new"], edges={"new": []})
    with pytest.raises(ValueError, match="already registered differently"):
        kinds.register(EntityKind("widgets", widgets, other))
    with pytest.raises(UnknownEntityKind) as info:
        KindRegistry().get("widgets")
    assert info.value.known == []


# -- property: random transition sequences against a real journal --------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
ZONES = st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))])
TIMES = st.datetimes(min_value=datetime(1971, 1, 2), max_value=datetime(2200, 1, 1), timezones=ZONES)
WIDGET_CHANGES = st.fixed_dictionaries({}, optional={
    "label": st.none() | TEXT, "count": st.integers(-(2**31), 2**31 - 1), "score": st.none() | FLOATS,
    "meta": JSON, "seen_at": st.none() | TIMES,
})
PARTICIPANT_CHANGES = st.fixed_dictionaries({}, optional={
    "phase": st.none() | st.sampled_from(["serving", "draining", "paused"]),
    "probe_failures": st.integers(0, 10_000), "detail": st.none() | TEXT, "last_probe_at": st.none() | TIMES,
})
#: How a step names the row it expects: right, an old or a future version, or the wrong state.
AIMS = st.sampled_from(["exact", "exact", "exact", "old_version", "new_version", "wrong_state"])


@dataclass
class Model:
    state: str
    version: int
    values: dict[str, Any]
    n_events: int = 1
    log: list[str] = field(default_factory=list)


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, float):
        return actual == expected or (math.isnan(actual) and math.isnan(expected))
    return bool(actual == expected)


async def _check(journal: Journal, kind: str, entity_id: str, model: Model) -> None:
    found = await row(journal, kind, entity_id)
    assert found is not None
    assert (found["state"], found["version"]) == (model.state, model.version), model.log
    for col, value in model.values.items():
        assert _same(found[col], value), (col, found[col], value, model.log)
    assert len(await events(journal, kind, entity_id)) == model.n_events
    # Only this example's entity: an earlier example's failure must not leak into the replay.
    assert [m for m in await audit.verify(journal, [kind]) if m.entity_id == entity_id] == [], model.log


async def _run_sequence(journal: Journal, kind: str, entity_id: str, machine: StateMachine,
                        initial_values: dict[str, Any], changes: st.SearchStrategy[dict[str, Any]],
                        data: st.DataObject) -> None:
    ek = journal.kinds.get(kind)
    initial = data.draw(st.sampled_from(sorted(machine.initial)), label="initial state")
    async with journal.write() as tx:
        await tx.create(kind, entity_id, state=initial, reason="created", values=initial_values)
    model = Model(initial, 1, {**ek.defaults(), **initial_values})
    await _check(journal, kind, entity_id, model)
    for step in range(data.draw(st.integers(1, 10), label="steps")):
        # Half the time aim at an edge that exists from the current state, else at any state.
        allowed = sorted(machine.allowed(model.state))
        pool = allowed if allowed and data.draw(st.booleans(), label="legal") else sorted(machine.states)
        to_state = data.draw(st.sampled_from(pool), label="to")
        aim = data.draw(AIMS, label="aim")
        change = data.draw(changes, label="changes")
        from_state, version = model.state, model.version
        if aim == "old_version":
            version -= 1
        elif aim == "new_version":
            version += 1
        elif aim == "wrong_state":
            from_state = next(s for s in sorted(machine.states) if s != model.state)
        legal = to_state in machine.allowed(from_state)
        stale = aim != "exact"
        model.log.append(f"{from_state}@{version} -> {to_state} {change}")
        try:
            async with journal.write() as tx:
                await tx.transition(kind, entity_id, from_state=from_state, version=version,
                                    to_state=to_state, reason=f"step {step}", changes=change)
        except IllegalTransition:
            assert not legal, model.log
        except StaleRow:
            assert legal and stale, model.log
        else:
            assert legal and not stale, model.log
            model.state, model.version = to_state, version + 1
            model.values.update(change)
            model.n_events += 1
        await _check(journal, kind, entity_id, model)


PROPERTY = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
async def widget_journal(make_journal: Callable[..., Journal]) -> Journal:
    kinds = builtin_kinds()
    kinds.register(WIDGET_KIND)
    journal = make_journal(kinds=kinds)
    async with journal.engine.begin() as conn:
        await conn.run_sync(widget_metadata.create_all)
    return journal


@PROPERTY
@given(data=st.data())
async def test_random_widget_transitions_match_the_model(widget_journal: Journal, data: st.DataObject) -> None:
    # Each example works on a new entity; earlier ones stay in the journal and must stay consistent.
    entity_id = f"w{len(await events(widget_journal, 'widgets'))}"
    initial_values = data.draw(WIDGET_CHANGES, label="initial")
    await _run_sequence(widget_journal, "widgets", entity_id, WIDGETS, initial_values, WIDGET_CHANGES, data)


@PROPERTY
@given(data=st.data())
async def test_random_participant_transitions_match_the_model(journal: Journal, data: st.DataObject) -> None:
    entity_id = f"p{len(await events(journal, 'participants'))}"
    initial_values = {"url": f"http://{entity_id}", **data.draw(PARTICIPANT_CHANGES, label="initial")}
    await _run_sequence(journal, "participants", entity_id, PARTICIPANTS, initial_values, PARTICIPANT_CHANGES, data)
