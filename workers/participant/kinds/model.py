"""The policy-model participant: held responses and a token-free capture ledger.

Only the model server that produces training tokens takes part (judges and
simulators keep serving). Its data plane wraps every policy call::

    async with participant.call(episode) as ticket:   # admission
        ...                                           # generate
        await ticket.start_response()                 # held while a checkpoint is open
        ticket.record(row)                            # one token-free ledger row
        ...                                           # stream the response

Admission (:meth:`PolicyModelParticipant.call`) refuses a retired attempt
(``stale_attempt``) and, while a checkpoint holds the gate closed, any new call
(``checkpoint_parked``). An admitted call gets a :class:`ModelTicket`.

**Held responses.** :meth:`ModelTicket.start_response` waits while the gate is
closed: the generation may run to completion, but nothing reaches the caller,
which is still at its pre-call boundary. Such a call is *undelivered*. A
prepare never waits for generations; it waits only for responses that already
started and have not finished (ready = no ticket streaming). Rows an
undelivered call recorded are left out of the commit — after a crash the agent
re-issues the call — and are dropped if the call ends without delivering.

**Ledger and records.** Rows are JSON payloads, checked once when recorded. A
commit *requires* a scope (``episode_ids``): without one it is refused with
``invalid_request`` (422), since the model cannot tell continued episodes from
finished ones. Each scoped episode with rows (or a restored generation cut) is
exported as ``{"episode_id", "rows", "generation_cuts"}``; this server makes no
generation cuts of its own, so ``generation_cuts`` is ``[]`` unless a restored
cut is carried forward. The commit reply adds ``staging_keys`` (sorted, unique)
and ``staging_keys_by_episode`` (capture key -> sorted keys, for every exported
episode): every ``staging_key`` string and ``staging_keys`` list found in a
row (or cut) object.

**Restore** requires a freshly started model server (no call ever admitted, no
ledger): rows are imported under the replacement attempt's capture key and
wait there, unclaimed, until a call of that attempt is admitted. The replaced
attempt and earlier ones are retired (the control plane marks them; their
ledgers, if any, are dropped). **Retire** cancels every live call of the attempt
and earlier ones, waits for them to end and drops their ledgers; a call cancelled
this way ends with ``stale_attempt``. :meth:`delete_restored` drops an unclaimed
restored ledger and fences nothing.

The participant is attached to its control plane by constructing
``ControlPlane(participant, state_dir=...)``, which sets ``participant.marks``
(the retire marks every call is checked against) and ``participant.notify``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ...protocol import MAX_BLOCKERS_LISTED, EpisodeId, ErrorCode, PrepareReport, ProtocolError
from ..base import ExportRecord, Participant
from ..storage import check_payload

__all__ = ["ModelTicket", "PolicyModelParticipant", "staging_keys_of"]

_RECORD_FIELDS = frozenset({"episode_id", "rows", "generation_cuts"})


def staging_keys_of(items: Iterable[Any]) -> set[str]:
    """The staging keys a list of rows (or cuts) references: ``staging_key`` / ``staging_keys``."""
    keys: set[str] = set()
    for item in items:
        if not isinstance(item, dict):
            continue
        single = item.get("staging_key")
        if isinstance(single, str):
            keys.add(single)
        many = item.get("staging_keys")
        if isinstance(many, list | tuple):
            keys.update(k for k in many if isinstance(k, str))
    return keys


@dataclass(eq=False)
class _Ledger:
    """The rows of one attempt; ``rows`` pairs each payload with the call that recorded it
    (``None``: restored, so delivered)."""

    episode: EpisodeId
    rows: list[tuple[Any, ModelTicket | None]] = field(default_factory=list)
    cuts: list[Any] = field(default_factory=list)

    def delivered(self) -> list[Any]:
        return [row for row, ticket in self.rows if ticket is None or ticket.started]


@dataclass(frozen=True)
class _RestoredLedger:
    episode: EpisodeId  # the replacement attempt
    rows: list[Any]
    cuts: list[Any]


class ModelTicket:
    """One admitted policy call. Use it only inside its :meth:`PolicyModelParticipant.call` block."""

    def __init__(self, owner: PolicyModelParticipant, ticket_id: int, episode: EpisodeId,
                 task: asyncio.Task[Any] | None) -> None:
        self._owner = owner
        self.ticket_id = ticket_id
        self.episode = episode
        self.key = episode.capture_key
        #: The response has started (it counts as streaming until the call block exits).
        self.started = False
        #: Waiting in :meth:`start_response` for the gate to reopen.
        self.held = False
        self._task = task
        self._cancelled = False  # retire cancelled the call's task (it does so once)
        self._ended = asyncio.Event()

    async def start_response(self) -> None:
        """Deliver: wait while the gate is closed (the response is held), then count as streaming.

        Idempotent. Raises ``stale_attempt`` if the attempt was retired meanwhile.
        """
        if self.started:
            return
        owner = self._owner
        owner.check_attempt(self.episode)
        while not owner._open:
            self.held = True
            owner._held += 1
            try:
                await owner._opened.wait()
            finally:
                self.held = False
                owner._held -= 1
        owner.check_attempt(self.episode)
        self.started = True
        owner._streaming[self.ticket_id] = self.key

    def record(self, row: Any) -> None:
        """Append one token-free row (a JSON payload, checked now) to this attempt's ledger.

        Rows of a call whose response never starts are left out of commits, and dropped
        when the call ends. ``ValueError`` if ``row`` is not JSON.
        """
        if self._cancelled:
            raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"call of {self.key!r} was retired")
        if self._ended.is_set():
            raise RuntimeError(f"the call of {self.key!r} has ended; record rows inside its block")
        check_payload(row)
        ledger = self._owner._ledgers.get(self.key)
        if ledger is None:
            ledger = self._owner._ledgers[self.key] = _Ledger(self.episode)
        ledger.rows.append((row, self))


class PolicyModelParticipant(Participant):
    """The policy model server as a checkpoint participant (see the module docstring)."""

    kind = "model"

    def __init__(self, instance: str) -> None:
        super().__init__(instance)
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._ids = itertools.count(1)
        self._tickets: dict[int, ModelTicket] = {}
        self._streaming: dict[int, str] = {}  # ticket id -> capture key, response started, not ended
        self._held = 0
        self._ledgers: dict[str, _Ledger] = {}
        self._restored: set[str] = set()  # restored ledgers whose replacement has not called yet
        #: Calls ever admitted by this process (a restore needs 0).
        self.served = 0

    # -- data plane -----------------------------------------------------------------------------

    def call(self, episode: EpisodeId) -> AbstractAsyncContextManager[ModelTicket]:
        """Admit one policy call of ``episode`` for the duration of the ``async with`` block.

        Refuses a retired attempt (409 ``stale_attempt``) and, while the gate is closed, any
        new call (409 ``checkpoint_parked``). If a retire cancels the call, the block ends
        with ``stale_attempt`` instead of ``CancelledError``.
        """
        return self._call(episode)

    @asynccontextmanager
    async def _call(self, episode: EpisodeId) -> AsyncIterator[ModelTicket]:
        self.check_attempt(episode)
        if not self._open:
            raise ProtocolError(ErrorCode.CHECKPOINT_PARKED,
                                f"a checkpoint is open; the call of {episode.capture_key!r} must be retried")
        task = asyncio.current_task()
        ticket = ModelTicket(self, next(self._ids), episode, task)
        self._tickets[ticket.ticket_id] = ticket
        self.served += 1
        self._restored.discard(ticket.key)  # the replacement has claimed its restored ledger
        try:
            yield ticket
        except asyncio.CancelledError:
            if ticket._cancelled and task is not None and task.uncancel() == 0:
                raise ProtocolError(ErrorCode.STALE_ATTEMPT,
                                    f"the call of {ticket.key!r} was retired") from None
            raise
        finally:
            self._end(ticket)

    def _end(self, ticket: ModelTicket) -> None:
        del self._tickets[ticket.ticket_id]
        streamed = self._streaming.pop(ticket.ticket_id, None) is not None
        if not ticket.started:
            ledger = self._ledgers.get(ticket.key)
            if ledger is not None:
                ledger.rows = [(r, t) for r, t in ledger.rows if t is not ticket]
                if not ledger.rows and not ledger.cuts:
                    del self._ledgers[ticket.key]
        ticket._ended.set()
        if streamed:
            self.notify()

    def ledger(self, episode: EpisodeId) -> list[Any]:
        """The delivered rows of one attempt (restored rows first), as recorded."""
        ledger = self._ledgers.get(episode.capture_key)
        return [] if ledger is None else ledger.delivered()

    def release(self, episode: EpisodeId) -> None:
        """Free the ledger of a finished attempt (its rows were consumed). Refused with
        ``checkpoint_parked`` while a checkpoint is open (retry after it resumes)."""
        if not self._open:
            raise ProtocolError(ErrorCode.CHECKPOINT_PARKED,
                                f"a checkpoint is open; release {episode.capture_key!r} after it resumes")
        self._ledgers.pop(episode.capture_key, None)
        self._restored.discard(episode.capture_key)

    # -- admission and readiness ----------------------------------------------------------------

    async def close_admission(self) -> None:
        self._open = False
        self._opened.clear()

    async def open_admission(self) -> None:
        self._open = True
        self._opened.set()

    def ready(self) -> bool:
        return not self._streaming

    def readiness(self) -> PrepareReport:
        keys = heapq.nsmallest(MAX_BLOCKERS_LISTED, set(self._streaming.values()))
        return PrepareReport(ready=not self._streaming, blockers=keys, blocker_count=len(self._streaming),
                             counts={"inflight": len(self._tickets), "held": self._held,
                                     "streaming": len(self._streaming)})

    # -- commit ---------------------------------------------------------------------------------

    def check_commit(self, scope: frozenset[str] | None) -> None:
        if scope is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                "a model commit requires episode_ids: the model cannot tell continued "
                                "episodes from finished ones")

    async def export(self, scope: frozenset[str] | None) -> list[ExportRecord]:
        self.check_commit(scope)
        assert scope is not None
        records: list[ExportRecord] = []
        for key in sorted(scope):
            ledger = self._ledgers.get(key)
            if ledger is None:
                continue
            rows = ledger.delivered()
            if rows or ledger.cuts:
                records.append((key, {"episode_id": ledger.episode.model_dump(), "rows": rows,
                                      "generation_cuts": list(ledger.cuts)}))
        return records

    def commit_extra(self, records: Sequence[ExportRecord]) -> dict[str, Any]:
        by_episode: dict[str, list[str]] = {}
        for key, record in records:
            keys = staging_keys_of(record["rows"]) | staging_keys_of(record["generation_cuts"])
            by_episode[key] = sorted(keys | set(by_episode.get(key, ())))
        every = sorted({k for keys in by_episode.values() for k in keys})
        return {"staging_keys": every, "staging_keys_by_episode": by_episode}

    def restored_pending(self) -> list[EpisodeId]:
        return [self._ledgers[key].episode for key in sorted(self._restored) if key in self._ledgers]

    async def delete_restored(self, episode: EpisodeId) -> None:
        # Only an unclaimed restored ledger; nothing is fenced, the attempt may still run.
        key = episode.capture_key
        if key in self._restored:
            self._restored.discard(key)
            self._ledgers.pop(key, None)

    # -- restore --------------------------------------------------------------------------------

    def check_restorable(self) -> None:
        if self.served or self._tickets or self._ledgers:
            raise ProtocolError(ErrorCode.INVALID_PHASE,
                                "a model restore requires a freshly started model server "
                                f"(this one has served {self.served} call(s))")

    def decode(self, record: dict[str, Any]) -> _RestoredLedger:
        unknown = set(record) - _RECORD_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        episode = EpisodeId.model_validate(record["episode_id"])
        rows = record.get("rows")
        cuts = record.get("generation_cuts", [])
        if not isinstance(rows, list):
            raise ValueError("rows is not a list")
        if not isinstance(cuts, list):
            raise ValueError("generation_cuts is not a list")
        if len(cuts) > 1:
            raise ValueError(f"{len(cuts)} generation cuts (at most one per episode)")
        return _RestoredLedger(episode.next_attempt(), rows, cuts)

    async def install(self, records: Sequence[Any], scope: Sequence[EpisodeId]) -> None:
        self.check_restorable()
        restored: list[_RestoredLedger] = list(records)
        keys = [r.episode.capture_key for r in restored]
        if len(set(keys)) != len(keys):
            raise ProtocolError(ErrorCode.INVALID_CHECKPOINT_STATE, "the checkpoint holds an episode twice")
        for replaced in scope:
            self._drop_ledgers(replaced)  # the replaced attempt and earlier ones are retired
        for item in restored:
            key = item.episode.capture_key
            self._ledgers[key] = _Ledger(item.episode, [(row, None) for row in item.rows], list(item.cuts))
            self._restored.add(key)
        self.notify()

    # -- retire ---------------------------------------------------------------------------------

    def _covered(self, target: EpisodeId, episode: EpisodeId) -> bool:
        return episode.rollout_id == target.rollout_id and episode.attempt <= target.attempt

    def _drop_ledgers(self, target: EpisodeId) -> None:
        for key, ledger in list(self._ledgers.items()):
            if self._covered(target, ledger.episode):
                del self._ledgers[key]
                self._restored.discard(key)

    async def retire(self, episode: EpisodeId) -> None:
        covered = [t for t in self._tickets.values() if self._covered(episode, t.episode)]
        for ticket in covered:
            if not ticket._cancelled and ticket._task is not None:
                ticket._cancelled = True
                ticket._task.cancel()
        self._drop_ledgers(episode)
        # Cut short, the calls stay tracked (and streaming ones keep blocking); a retry waits again.
        await asyncio.gather(*(t._ended.wait() for t in covered))
        self._drop_ledgers(episode)

    def status_extra(self) -> dict[str, Any]:
        return {"inflight": len(self._tickets), "held": self._held, "served_calls": self.served,
                "ledgers": len(self._ledgers), "restored_pending": len(self._restored)}
