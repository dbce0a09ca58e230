"""The engine contract without an engine: region bookkeeping, input checks, adapter configuration."""

from __future__ import annotations

import math

import pytest

from workers.inference import (REGIONS, EngineConfigError, EngineUncertainError, MemoryRegions,
                               RegionState, SGLangConfig)
from workers.inference.engine import check_pause_mode, normalize_regions


def test_regions_normalize_to_canonical_order_without_duplicates() -> None:
    assert normalize_regions(["cuda_graph", "weights", "cuda_graph"]) == ("weights", "cuda_graph")
    assert normalize_regions(REGIONS) == REGIONS


@pytest.mark.parametrize(("regions", "rule"), [
    (["weights", "kv"], "are not regions"),
    ([], "at least one region"),
    ("weights", "sequence of regions"),  # a bare string must not iterate as characters
])
def test_bad_regions_name_the_field_value_and_rule(regions: object, rule: str) -> None:
    with pytest.raises(EngineConfigError) as err:
        normalize_regions(regions)  # type: ignore[arg-type]
    assert err.value.field == "regions"
    assert rule in err.value.rule


def test_pause_mode_is_checked() -> None:
    assert check_pause_mode("in_place") == "in_place"
    with pytest.raises(EngineConfigError, match="mode: 'drain'"):
        check_pause_mode("drain")


def test_memory_regions_track_acknowledged_states_and_report_pending_work() -> None:
    memory = MemoryRegions("engine-a", released=["kv_cache"])
    assert memory.snapshot() == {"weights": RegionState.RESIDENT, "kv_cache": RegionState.RELEASED,
                                 "cuda_graph": RegionState.RESIDENT}
    assert memory.pending(REGIONS, RegionState.RELEASED) == ("weights", "cuda_graph")
    assert memory.pending(REGIONS, RegionState.RESIDENT) == ("kv_cache",)
    memory.mark(("weights", "cuda_graph"), RegionState.RELEASED)
    assert memory.pending(REGIONS, RegionState.RELEASED) == ()


def test_a_poisoned_state_refuses_everything_and_keeps_the_first_reason() -> None:
    memory = MemoryRegions("engine-a")
    memory.poison("release ['weights'] failed: boom")
    memory.poison("a later failure")
    assert memory.uncertain == "release ['weights'] failed: boom"
    with pytest.raises(EngineUncertainError, match="engine-a: state uncertain since release"):
        memory.pending(["weights"], RegionState.RELEASED)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"url": "127.0.0.1:30000"}, "url"),
    ({"url": "http://127.0.0.1:30000/v1"}, "url"),
    ({"url": "http://127.0.0.1:30000", "timeout": 0}, "timeout"),
    ({"url": "http://127.0.0.1:30000", "weight_update_timeout": math.inf}, "weight_update_timeout"),
    ({"url": "http://127.0.0.1:30000", "health_timeout": -1.0}, "health_timeout"),
    ({"url": "http://127.0.0.1:30000", "flush_attempts": 0}, "flush_attempts"),
    ({"url": "http://127.0.0.1:30000", "flush_interval": -0.5}, "flush_interval"),
])
def test_config_rejects_bad_values_by_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(EngineConfigError) as err:
        SGLangConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert repr(kwargs[field]) in str(err.value)


def test_config_accepts_a_plain_base_url() -> None:
    assert SGLangConfig("http://127.0.0.1:30000/").base == "http://127.0.0.1:30000"
