"""The hooks a server implements to take part in checkpoints.

:class:`Participant` is what the control plane (:mod:`.control`) drives. A
server subclasses it — usually through one of the four kinds in
:mod:`workers.participant.kinds` — and the control plane calls the hooks in
the protocol's order; a hook never needs to know about phases, fencing,
leases, recorded results or storage.

Contract of the hooks, in the order a checkpoint uses them:

- :meth:`close_admission` stops new work from starting; :meth:`open_admission`
  undoes it. Both may be called again after a failure and must be idempotent.
- :meth:`ready` is asked repeatedly while a prepare waits and must be cheap;
  :meth:`readiness` is asked once per reply and may list blockers.
- :meth:`export` returns the records of the checkpoint as ``(capture key,
  record)`` pairs. It runs once per checkpoint id, while the participant is
  prepared. A record is a JSON object with an ``episode_id`` field; payloads in
  it were checked with :func:`~workers.participant.storage.check_payload` when
  they were recorded and are written as they are — by reference, not copied, so
  a recorded payload must never be changed in place afterwards.
- :meth:`decode` validates one restored record (only records in scope reach
  it); :meth:`install` installs all of them, or raises and installs nothing.
- :meth:`retire` stops an attempt and every earlier one, waits for it and frees
  it; the control plane has already marked it before calling.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from ..protocol import KINDS, EpisodeId, ErrorCode, PrepareReport, ProtocolError
from .marks import RetiredMarks

#: ``(capture key, record)``: one exported episode.
ExportRecord = tuple[str, dict[str, Any]]


class Participant(abc.ABC):
    """One checkpoint participant of a server: the hooks.

    The six abstract hooks (admission, ``ready``, ``export``, ``install``, ``retire``) must be
    implemented — a subclass missing one cannot be instantiated; the others have defaults.
    """

    kind: ClassVar[str] = ""

    def __init__(self, instance: str) -> None:
        if self.kind not in KINDS:
            raise TypeError(f"{type(self).__name__}.kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        self.instance = instance
        #: Set by the control plane that drives this participant: call it when readiness may
        #: have changed, so a waiting prepare looks again.
        self.notify: Any = lambda: None
        #: The control plane's durable retire marks (set when a ControlPlane is built for this
        #: participant); the data plane checks every attempt against them.
        self.marks: RetiredMarks | None = None

    def check_attempt(self, episode: EpisodeId) -> None:
        """Refuse a retired attempt (409 ``stale_attempt``); data-plane entry points call this first."""
        if self.marks is None:
            raise ProtocolError(ErrorCode.INVALID_PHASE,
                                f"{self.kind} participant {self.instance!r} has no control plane attached")
        self.marks.check(episode)

    # -- admission and readiness ----------------------------------------------------------------

    @abc.abstractmethod
    async def close_admission(self) -> None:
        """Stop admitting new work until :meth:`open_admission` (called from idle)."""

    @abc.abstractmethod
    async def open_admission(self) -> None:
        """Admit work again. Idempotent."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether nothing blocks a checkpoint now. Cheap: called on every wake-up of a prepare."""

    def readiness(self) -> PrepareReport:
        """The report sent with a prepare reply and status: blockers (at most 100), counts, restarts."""
        return PrepareReport(ready=self.ready())

    # -- commit ---------------------------------------------------------------------------------

    def check_commit(self, scope: frozenset[str] | None) -> None:
        """Refuse a commit's arguments before anything is exported (a typed ``ProtocolError``);
        a refusal here pins nothing, so the controller may retry the same id with other ones."""
        return None

    @abc.abstractmethod
    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        """The records of this checkpoint, restricted to ``scope`` (capture keys) when given."""

    def restarts(self) -> list[str]:
        """Capture keys of live episodes this participant cannot save (never exported)."""
        return list(self.readiness().restarts)

    def restored_pending(self) -> list[EpisodeId]:
        """Restored episodes (by replacement attempt) whose replacement has not started here."""
        return []

    async def delete_restored(self, episode: EpisodeId) -> None:
        """Free unclaimed restored state left out of a commit's scope, leaving no refusal behind.

        Defaults to :meth:`retire`, which is enough where retire refuses nothing beyond itself.
        """
        await self.retire(episode)

    def commit_extra(self, records: Sequence[ExportRecord]) -> dict[str, Any]:
        """Extra fields of the commit reply (the model adds ``staging_keys``)."""
        return {}

    async def park_exported(self, records: Sequence[ExportRecord]) -> None:
        """A commit with ``stop``: the records are durable and the process is about to stop."""
        return None

    # -- restore --------------------------------------------------------------------------------

    def check_restorable(self) -> None:
        """Raise :class:`~workers.protocol.ProtocolError` if this process cannot take a restore."""
        return None

    def decode(self, record: dict[str, Any]) -> Any:
        """Validate one restored record in scope; raise ``ValueError`` to refuse it.

        The default keeps the record as read. Payloads read back are not checked again.
        """
        return record

    @abc.abstractmethod
    async def install(self, records: Sequence[Any], scope: Sequence[EpisodeId]) -> None:
        """Install every decoded record; ``scope`` names every checkpointed episode the restore
        continues, including ones without a record here. All or nothing."""

    # -- retire and forget ----------------------------------------------------------------------

    @abc.abstractmethod
    async def retire(self, episode: EpisodeId) -> None:
        """Stop ``episode`` and every earlier attempt of its rollout, wait for them, free them.

        If cut short the episode must stay tracked (and blocking), so a retry waits again.
        """

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """The controller is done with these rollouts for good (their marks are gone)."""
        return None

    def status_extra(self) -> dict[str, Any]:
        """Extra fields of ``GET status`` (counts a server wants to show)."""
        return {}
