"""The inference-engine contract: what Tidelog's publication and memory handoff drive per engine.

An :class:`InferenceEngine` is one serving engine as seen by the orchestrator. It can

- pause generation (``abort``, ``retract`` or ``in_place``; requests that arrive while paused
  wait) and continue it;
- release and resume GPU memory by *region* — ``weights``, ``kv_cache``, ``cuda_graph``;
- load weights from a directory on disk under a *weight version*, report the version it
  serves, and set that version on its own;
- flush its prefix cache, answer a health check and generate.

Memory regions
--------------
:class:`MemoryRegions` holds the state of every region as the engine last *acknowledged* it:
``resident`` or ``released``. ``release_memory(regions)`` acts only on the requested regions
that are still resident and ``resume_memory(regions)`` only on the released ones; a repeat is
a no-op that sends nothing. A region call that fails in any way — an HTTP error, a timeout,
``success: false``, even cancellation of the caller — leaves the engine **uncertain**: the
adapter no longer knows what the engine holds, so every later call on that adapter raises
:class:`EngineUncertainError` (``close`` excepted) until the engine is replaced by a new
adapter (a new engine process, or an operator's decision to trust the old one again).

Errors
------
- :class:`EngineConfigError` — bad input or configuration, naming the field, value and rule.
- :class:`EngineCallError` — a call the engine refused or failed (status and detail); its
  subclass :class:`EngineTimeoutError` — a call that did not answer within its bound.
- :class:`EngineUncertainError` — the engine's state is unknown after a failed region call.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: The memory regions of an engine, in the order they are released and resumed.
REGIONS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
#: How in-flight requests are treated by a pause (SGLang's ``PauseGenerationReqInput.mode``).
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
PauseMode = Literal["abort", "retract", "in_place"]


class EngineError(Exception):
    """Base class of the errors an inference engine adapter raises."""


class EngineConfigError(EngineError, ValueError):
    """Bad input: ``field`` holds ``value``, which breaks ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field}: {value!r} {rule}")
        self.field, self.value, self.rule = field, value, rule


class EngineCallError(EngineError):
    """The engine answered ``endpoint`` with an error, or could not be reached.

    ``status`` is the HTTP status (``None`` when no response came back) and ``detail`` the
    engine's message.
    """

    def __init__(self, endpoint: str, status: int | None, detail: str) -> None:
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{endpoint}: {where}: {detail}")
        self.endpoint, self.status, self.detail = endpoint, status, detail


class EngineTimeoutError(EngineCallError):
    """``endpoint`` did not answer within ``timeout`` seconds; the call may still take effect."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        super().__init__(endpoint, None, f"no answer within {timeout:g} s")
        self.timeout = timeout


class EngineUncertainError(EngineError):
    """The engine's memory state is unknown since a region call failed; replace the engine."""

    def __init__(self, engine: str, reason: str) -> None:
        super().__init__(f"{engine}: state uncertain since {reason}; refusing every call "
                         "until the engine is replaced")
        self.engine, self.reason = engine, reason


class RegionState(str, enum.Enum):
    RESIDENT = "resident"
    RELEASED = "released"


def normalize_regions(regions: Iterable[str], field_name: str = "regions") -> tuple[str, ...]:
    """``regions`` deduplicated in canonical order; unknown or no regions are a config error."""
    if isinstance(regions, str):  # a bare string would iterate as characters
        raise EngineConfigError(field_name, regions, f"must be a sequence of regions from {REGIONS}")
    requested = list(regions)
    unknown = [r for r in requested if r not in REGIONS]
    if unknown:
        raise EngineConfigError(field_name, unknown, f"are not regions; the regions are {REGIONS}")
    if not requested:
        raise EngineConfigError(field_name, requested, "must name at least one region")
    return tuple(r for r in REGIONS if r in requested)


def check_pause_mode(mode: str) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise EngineConfigError("mode", mode, f"must be one of {PAUSE_MODES}")
    return mode  # type: ignore[return-value]  # narrowed by the membership test above


class MemoryRegions:
    """Acknowledged region states of one engine, and the uncertainty flag.

    Not thread-safe; :class:`InferenceEngine` serializes the calls that change it.
    """

    def __init__(self, engine: str, released: Iterable[str] = ()) -> None:
        initially = list(released)
        down = set(normalize_regions(initially)) if initially else set()
        self.engine = engine
        self._states = {r: RegionState.RELEASED if r in down else RegionState.RESIDENT
                        for r in REGIONS}
        self._uncertain: str | None = None

    @property
    def uncertain(self) -> str | None:
        """Why the state is unknown (the failed call), or ``None`` while it is known."""
        return self._uncertain

    def check(self) -> None:
        """Raise :class:`EngineUncertainError` once a region call has failed."""
        if self._uncertain is not None:
            raise EngineUncertainError(self.engine, self._uncertain)

    def snapshot(self) -> dict[str, RegionState]:
        return dict(self._states)

    def pending(self, regions: Iterable[str], target: RegionState) -> tuple[str, ...]:
        """The requested regions not yet in ``target`` (canonical order)."""
        self.check()
        return tuple(r for r in normalize_regions(regions) if self._states[r] is not target)

    def mark(self, regions: Iterable[str], state: RegionState) -> None:
        for region in regions:
            self._states[region] = state

    def poison(self, reason: str) -> None:
        if self._uncertain is None:  # the first failure is the one worth reporting
            self._uncertain = reason


@dataclass(frozen=True)
class Generation:
    """One finished generation: the text, its token ids, why it stopped and the serving version."""

    text: str
    output_ids: list[int]
    finish_reason: Mapping[str, Any]
    weight_version: str | None
    meta_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightUpdate:
    """The engine's answer to a weight update: its message and how many requests it held paused."""

    message: str
    num_paused_requests: int


class InferenceEngine(abc.ABC):
    """One inference engine. Region bookkeeping lives here; transports implement the hooks.

    Subclasses implement the operations and the two region hooks
    (:meth:`_release_regions`, :meth:`_resume_regions`), and must call
    :meth:`_check_usable` before every engine call so an uncertain engine refuses them.
    """

    def __init__(self, name: str, released: Iterable[str] = ()) -> None:
        self.name = name
        self._memory = MemoryRegions(name, released)
        self._region_lock = asyncio.Lock()

    # -- regions ---------------------------------------------------------------------------

    @property
    def memory(self) -> dict[str, RegionState]:
        """Each region's last acknowledged state."""
        return self._memory.snapshot()

    @property
    def uncertain(self) -> str | None:
        """Why this engine's state is unknown, or ``None``."""
        return self._memory.uncertain

    def _check_usable(self) -> None:
        self._memory.check()

    def mark_uncertain(self, reason: str) -> None:
        """Refuse every later call, as after a failed region call: what a durable record says of
        the engine (an earlier adapter found its state unknown, and it was not replaced since)."""
        self._memory.poison(reason)

    def note_released(self, regions: Iterable[str]) -> None:
        """Take ``regions`` as released without a call: what a durable record says an earlier
        adapter had acknowledged (a new adapter otherwise takes every region for resident)."""
        self._memory.mark(normalize_regions(regions), RegionState.RELEASED)

    async def release_memory(self, regions: Iterable[str] = REGIONS) -> tuple[str, ...]:
        """Release the requested regions that are resident; returns the regions acted on."""
        return await self._change(regions, RegionState.RELEASED)

    async def resume_memory(self, regions: Iterable[str] = REGIONS) -> tuple[str, ...]:
        """Resume the requested regions that are released; returns the regions acted on."""
        return await self._change(regions, RegionState.RESIDENT)

    async def _change(self, regions: Iterable[str], target: RegionState) -> tuple[str, ...]:
        requested = normalize_regions(regions)  # bad input fails before it can poison anything
        async with self._region_lock:
            todo = self._memory.pending(requested, target)
            if not todo:
                return ()
            verb = "release" if target is RegionState.RELEASED else "resume"
            try:
                if target is RegionState.RELEASED:
                    await self._release_regions(todo)
                else:
                    await self._resume_regions(todo)
            except BaseException as exc:
                # Whatever stopped the call (error, timeout, cancellation), the engine may have
                # acted on some regions or none: its state is unknown from here on.
                self._memory.poison(f"{verb} {list(todo)} failed: {exc}")
                raise
            self._memory.mark(todo, target)
            return todo

    @abc.abstractmethod
    async def _release_regions(self, regions: tuple[str, ...]) -> None:
        """Release exactly ``regions`` (all currently resident); raise on any failure."""

    @abc.abstractmethod
    async def _resume_regions(self, regions: tuple[str, ...]) -> None:
        """Resume exactly ``regions`` (all currently released); raise on any failure."""

    # -- operations ------------------------------------------------------------------------

    @abc.abstractmethod
    async def pause_generation(self, mode: str = "retract") -> None:
        """Stop starting new requests (they wait); treat in-flight ones per ``mode``."""

    @abc.abstractmethod
    async def continue_generation(self) -> None:
        """Let waiting and paused requests run again."""

    @abc.abstractmethod
    async def flush_cache(self) -> None:
        """Drop the prefix cache; raises :class:`EngineCallError` while requests keep running."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> WeightUpdate:
        """Load the weights in ``model_path`` and serve them as ``weight_version``."""

    @abc.abstractmethod
    async def weight_version(self) -> str | None:
        """The weight version the engine serves now."""

    @abc.abstractmethod
    async def set_weight_version(self, weight_version: str) -> None:
        """Relabel the weights the engine serves as ``weight_version`` (aborting nothing)."""

    @abc.abstractmethod
    async def health(self, timeout: float | None = None) -> bool:
        """Whether the engine can generate now (a failed or late answer is ``False``)."""

    @abc.abstractmethod
    async def generate(self, text: str, max_new_tokens: int, *,
                       sampling_params: Mapping[str, Any] | None = None) -> Generation:
        """Generate a continuation of ``text``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the adapter's own resources (never the engine's); always allowed."""


__all__ = ["PAUSE_MODES", "REGIONS", "EngineCallError", "EngineConfigError", "EngineError",
           "EngineTimeoutError", "EngineUncertainError", "Generation", "InferenceEngine",
           "MemoryRegions", "PauseMode", "RegionState", "WeightUpdate", "check_pause_mode",
           "normalize_regions"]
