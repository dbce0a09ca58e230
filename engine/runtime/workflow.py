"""The workflow registration seam: what a workflow family declares, and the families registered.

A family is one folder under ``engine/workflows/`` (or any importable module: ``workflows:`` in the
config names modules to import before anything else runs) that builds a :class:`Workflow` and
calls :func:`register` at import. ``tidelog serve``, the HTTP app, the CLI, the crash-hook
enumeration, the CLI's progress lines and the configuration's sections all iterate over
:func:`registered`; none of them names a family. The built-in families are registered by
importing :mod:`engine.workflows` (the service and the CLI do).

Invariants :func:`register` keeps: names are unique; an entity kind belongs to one family; a
settings section is not one of :class:`~engine.config.Settings`' own keys unless the family says it
is (``builtin_section``), and belongs to one family.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from journal import EntityKind, StateMachine, WriteTx
from journal.registry import builtin_kinds

if TYPE_CHECKING:  # annotations only: the service imports this module
    from aiohttp import web

    from engine.config import Settings
    from engine.http.shell import Handler
    from engine.runtime.clock import Clock
    from engine.runtime.metrics import Metrics
    from engine.runtime.reconciler import Controller
    from engine.runtime.rpc import RpcClient
    from engine.runtime.service import Orchestrator

#: A step run on election, in one fenced write before the loops start (e.g. sync configured rows).
ElectionStep = Callable[[WriteTx], Awaitable[object]]
#: A fenced write of the lease holder: runs the step in a group-committed transaction, returns its result.
FencedWrite = Callable[[Callable[[WriteTx], Awaitable[Any]]], Awaitable[Any]]
#: A CLI command: ``(settings, parsed arguments) -> exit code``.
Command = Callable[["Settings", argparse.Namespace], int]


@dataclass(frozen=True)
class Deps:
    """What a family's controllers are built from: the settings and the orchestrator's shared parts.

    ``replaced`` names the kinds whose controller the caller (a test) supplies itself; a family may
    leave those out, or not build at all when its lead kind is replaced. ``write`` is the leader's
    fenced write (for a ``run`` task) and ``holder`` this orchestrator's lease holder id."""

    settings: Settings
    rpc: RpcClient
    metrics: Metrics
    clock: Clock
    replaced: frozenset[str] = frozenset()
    write: FencedWrite | None = None
    holder: str = ""
    #: A read transaction of the journal (``journal.read``).
    read: Callable[[], Any] | None = None
    #: What a stack rebuild calls (the deployment family) once the old processes are confirmed gone
    #: and before the new ones start, with why it rebuilds: every built family's ``on_rebuild``.
    rebuilt: Callable[[str], Awaitable[None]] | None = None
    #: Asks the deployment to replace the process that serves an ``engines`` row (its id, why):
    #: True when a built family took it on (the deployment family: the service is killed and
    #: managed recovery rebuilds the stack); False when none runs it, or not now.
    replace_engine: Callable[[str, str], Awaitable[bool]] | None = None


@dataclass
class Parts:
    """One built family: its controllers and what the orchestrator does for it at each turn.

    - ``on_elected``: run in order, each in its own fenced write, on every election before the
      dispatcher recovers and the loops start; a failure steps down (the next election retries).
    - ``on_lost``: awaited when the lease is lost, after the loops stopped.
    - ``close``: awaited once when the orchestrator stops.
    - ``handle``: the family's own object, for its routes (:meth:`Orchestrator.handle`).
    - ``run``: a task run while this orchestrator leads, started after ``on_elected`` beside the
      loops and cancelled with them; it must not return (that steps down, like a loop that ends).
    - ``before_stop``: awaited when the orchestrator stops while it leads, before the loops drain
      (its writes still go through); e.g. stopping what ``run`` started, in order.
    - ``not_ready``: why ``/readyz`` answers 503 for this family (``None``: ready).
    - ``on_rebuild``: awaited by a stack rebuild (:attr:`Deps.rebuilt`) with its reason, once the
      old processes are gone and before the new ones start: what a family does about the work
      they held (the checkpoint family asks for the restore of the latest checkpoint).
    - ``replace_engine``: what :attr:`Deps.replace_engine` asks of this family (the deployment
      family runs the engines' services); ``None``: it runs no engine.
    """

    controllers: Sequence[Controller] = ()
    on_elected: Sequence[ElectionStep] = ()
    on_lost: Callable[[], Awaitable[None]] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    handle: Any = None
    run: Callable[[], Coroutine[Any, Any, None]] | None = None
    before_stop: Callable[[], Awaitable[None]] | None = None
    not_ready: Callable[[], Awaitable[str | None]] | None = None
    on_rebuild: Callable[[str], Awaitable[None]] | None = None
    replace_engine: Callable[[str, str], Awaitable[bool]] | None = None


@dataclass(frozen=True)
class Workflow:
    """A workflow family as the rest of Tidelog sees it. Every field but ``name`` is optional.

    - ``kinds``: the entity kinds (table + machine) it owns; registered in every journal the
      service and the CLI open, so the transition primitive, events, ``verify`` and ``replay``
      know them. Their tables come from the family's migration.
    - ``build``: its controllers and hooks from :class:`Deps`; ``None`` from ``build`` means
      "not enabled by these settings" (its routes still answer reads).
    - ``routes``: adds its HTTP routes; ``guard`` wraps a mutating handler (token, then leader).
    - ``commands``: adds its subcommands to ``tidelog``'s subparsers; returns their handlers.
    - ``settings``: the pydantic model of its configuration section, keyed by ``section``
      (default: the name); read back with :meth:`Settings.section`.
    - ``stage_names``: for a staged kind, the name of each ``stage`` index (progress lines).
    """

    name: str
    kinds: tuple[EntityKind, ...] = ()
    build: Callable[[Deps], Parts | None] | None = None
    routes: Callable[[web.Application, Orchestrator, Callable[[Handler], Handler]], None] | None = None
    commands: Callable[[Any], Mapping[str, Command]] | None = None
    settings: type[BaseModel] | None = None
    section: str | None = None
    builtin_section: bool = False
    stage_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def section_key(self) -> str | None:
        """The configuration key of its section (``None`` when it has no settings)."""
        if self.settings is None:
            return None
        return self.section or self.name


_REGISTERED: dict[str, Workflow] = {}


def register(workflow: Workflow) -> Workflow:
    """Add ``workflow`` (idempotent for the same object); ``ValueError`` on a clash, naming it."""
    existing = _REGISTERED.get(workflow.name)
    if existing is workflow:
        return workflow
    if existing is not None:
        raise ValueError(f"a workflow named {workflow.name!r} is already registered")
    owners = {k.name: w.name for w in _REGISTERED.values() for k in w.kinds}
    for kind in workflow.kinds:
        if kind.name in owners:
            raise ValueError(f"workflow {workflow.name!r}: kind {kind.name!r} belongs to workflow {owners[kind.name]!r}")
    key = workflow.section_key
    if key is not None:
        taken = {w.section_key: w.name for w in _REGISTERED.values() if w.section_key is not None}
        if key in taken:
            raise ValueError(f"workflow {workflow.name!r}: settings section {key!r} belongs to workflow {taken[key]!r}")
    _REGISTERED[workflow.name] = workflow
    return workflow


def unregister(name: str) -> None:
    """Remove a registered workflow (tests that register their own take it out again)."""
    _REGISTERED.pop(name, None)


def registered() -> tuple[Workflow, ...]:
    """Every registered workflow, in registration order."""
    return tuple(_REGISTERED.values())


def kinds() -> list[EntityKind]:
    """The journal's own kinds, then every registered workflow's."""
    return [*builtin_kinds(), *(k for w in registered() for k in w.kinds)]


def register_kinds(registry: Any, workflows: Iterable[Workflow] | None = None) -> None:
    """Register every workflow's kinds in a journal's kind registry (``journal.kinds``)."""
    for w in registered() if workflows is None else workflows:
        for kind in w.kinds:
            registry.register(kind)


def machines() -> list[StateMachine]:
    """The machine of every kind :func:`kinds` lists (the crash-hook enumeration walks them)."""
    seen: dict[str, StateMachine] = {}
    for kind in kinds():
        seen.setdefault(kind.name, kind.machine)
    return list(seen.values())


def terminal(kind: str) -> frozenset[str]:
    """The terminal states of ``kind``, as its machine declares them; ``KeyError`` if unknown."""
    for k in kinds():
        if k.name == kind:
            return k.machine.terminal
    raise KeyError(kind)


def stage_names(kind: str) -> tuple[str, ...] | None:
    """The names of ``kind``'s stages, if a registered workflow declares them."""
    for w in registered():
        if kind in w.stage_names:
            return w.stage_names[kind]
    return None


def sections() -> dict[str, type[BaseModel]]:
    """Settings sections that registered workflows declare beyond ``Settings``' own keys."""
    return {w.section_key: w.settings for w in registered()
            if w.settings is not None and w.section_key is not None and not w.builtin_section}


__all__ = ["Command", "Deps", "ElectionStep", "Parts", "Workflow", "kinds", "machines", "register",
           "register_kinds", "registered", "sections", "stage_names", "terminal", "unregister"]
