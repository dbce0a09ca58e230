"""The transition primitive: every row write and its event, in one transaction.

:class:`WriteTx` is handed out by :meth:`Journal.write`. Its two entity
operations are the only code in Tidelog that writes ``state``:

- :meth:`WriteTx.create` inserts a row in one of its machine's initial states;
- :meth:`WriteTx.transition` is a compare-and-set on ``state`` and ``version``
  (``UPDATE … WHERE id=:id AND state=:from AND version=:v``).

Each writes one ``events`` row that records the edge, the columns it set, the
reason and the actor (orchestrator id and fencing epoch), in the same
transaction as the row change, so both are written or neither: on PostgreSQL
in the same statement (a data-modifying CTE), on SQLite queued and inserted
just before the commit. An operation that raises (illegal edge, stale row, unknown
column, bad JSON) has written nothing, and the rest of the transaction is still
usable.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import lru_cache
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql.base import PGDialect

from . import models
from .commits import Committed, Fence
from .ops import MAX_RUN, MIN_RUN, Create, Op, Transition, runs
from .statements_pg import create_statement, create_value_names, pad, transition_statement, transition_value_names
from .errors import ConstraintViolation, DuplicateEntity, InvalidPayload, LeaseLost, StaleRow
from .types import Encoded, dumps
from .writer import Buffered, Params, Writer

if TYPE_CHECKING:
    from .database import Journal


def jsonable(value: Any) -> Any:
    """The form a column value takes inside an event payload (and when folding).

    Datetimes are recorded in UTC, the form the row gives back on every backend,
    so folding compares like with like; a naive datetime is refused here, before
    anything is written (the column type would refuse it too, but only as a
    driver-wrapped error from inside the statement).
    """
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidPayload("timestamp", f"naive datetime {value.isoformat()} (journal times are UTC-aware)")
        return value.astimezone(timezone.utc).isoformat()
    return value


@dataclass(frozen=True)
class Row:
    """A snapshot of an entity row as read inside a transaction."""

    kind: str
    id: str
    state: str
    version: int
    values: Mapping[str, Any]

    def __getitem__(self, column: str) -> Any:
        return self.values[column]


class WriteTx:
    """One open write transaction. Use only inside ``async with journal.write()``."""

    def __init__(self, journal: Journal, writer: Writer | None, fence: Fence | None, *,
                 fence_pending: bool = False) -> None:
        self.journal = journal
        self.fence = fence
        # PostgreSQL checks the fence lazily: folded into the first compare-and-set (one
        # round trip fewer), or as its own statement before anything else is written.
        self._fence_pending = fence_pending
        # A failed fence check is final for the transaction: every later write raises it too.
        self._fence_error: LeaseLost | None = None
        self.now = journal.clock()
        self.committed: list[Committed] = []
        self._writer = writer
        self._events: list[dict[str, Any]] = []

    @property
    def _w(self) -> Writer:
        # A WriteTx without a writer only plans operations (journal.batch_pg).
        assert self._writer is not None, "this WriteTx only plans operations"
        return self._writer

    async def execute(self, stmt: sa.Executable, params: Params = None) -> Buffered:
        """Run a statement in this transaction (for non-entity tables such as ``leases``).

        Entity rows change only through :meth:`create` and :meth:`transition`.
        """
        await self.ensure_fence()
        return await self._w.execute(stmt, params)

    async def ensure_fence(self) -> None:
        """Check the fence now if it has not been checked yet (raises :class:`LeaseLost`)."""
        if self._fence_error is not None:
            raise self._fence_error
        if self._fence_pending:
            assert self.fence is not None
            found = await self._w.execute(self.fence_statement(self.fence))
            try:
                self.check_fence(found)
            except LeaseLost as exc:
                self._fence_error = exc
                raise
            self._fence_pending = False

    async def settle(self) -> None:
        """Before the commit: a transaction that queued events must have checked its fence."""
        if self._events:
            await self.ensure_fence()

    # -- fencing ---------------------------------------------------------------------------
    @staticmethod
    @lru_cache(maxsize=8)
    def fence_statement(fence: Fence) -> sa.Select[Any]:
        lease = models.leases
        # FOR SHARE on PostgreSQL: a take-over (an UPDATE of this row) waits until this
        # transaction ends, so no write of the old epoch lands after the new epoch began.
        # SQLite ignores it; BEGIN IMMEDIATE already serializes every writer.
        return (sa.select(lease.c.holder, lease.c.epoch, lease.c.expires_at)
                .where(lease.c.name == fence.lease).with_for_update(read=True))

    def check_fence(self, found: Buffered | None) -> None:
        """Refuse the transaction unless the fence's holder holds the lease at its epoch."""
        fence = self.fence
        assert fence is not None and found is not None
        row = found.first()
        if row is None:
            raise LeaseLost(fence.lease, fence.holder, fence.epoch, None, None, "no lease row")
        if row.holder != fence.holder or row.epoch != fence.epoch:
            raise LeaseLost(fence.lease, fence.holder, fence.epoch, row.holder, row.epoch,
                            "another holder or epoch took over")
        if row.expires_at <= self.now:
            raise LeaseLost(fence.lease, fence.holder, fence.epoch, row.holder, row.epoch,
                            f"lease expired at {row.expires_at.isoformat()}")

    # -- entity operations -----------------------------------------------------------------
    async def create(self, kind: str, entity_id: str, *, reason: str, state: str | None = None,
                     values: Mapping[str, Any] | None = None, note: Mapping[str, Any] | None = None,
                     if_absent: bool = False) -> Committed | None:
        """Insert ``kind``/``entity_id`` in an initial state and record its first event.

        Columns not named in ``values`` take their declared defaults (and the event
        records them too, so folding the events rebuilds the whole row). With
        ``if_absent`` an existing row is left alone and ``None`` is returned;
        otherwise it raises :class:`DuplicateEntity`.
        """
        op = Create(kind, entity_id, reason, values or {}, state, note, if_absent)
        prep = self.prepare(op)
        if not await self.execute_prepared(op, prep):
            return None
        return self.record_prepared(op, prep)

    async def transition(self, kind: str, entity_id: str, *, from_state: str, version: int,
                         to_state: str, reason: str, changes: Mapping[str, Any] | None = None,
                         note: Mapping[str, Any] | None = None) -> Committed:
        """Compare-and-set ``from_state``/``version`` to ``to_state``/``version + 1``.

        Raises :class:`IllegalTransition` for an edge the machine lacks and
        :class:`StaleRow` when the row is no longer at ``from_state``/``version``;
        in both cases nothing is written.
        """
        op = Transition(kind, entity_id, from_state, version, to_state, reason, changes or {}, note)
        prep = self.prepare(op)
        await self.execute_prepared(op, prep)
        return self.record_prepared(op, prep)

    async def apply(self, ops: Sequence[Op]) -> list[Committed | None]:
        """Apply declarative operations in order, as :meth:`create` and :meth:`transition` would.

        Every operation is checked before any is written. On SQLite a run of operations of
        the same shape goes as one ``executemany`` (see :meth:`execute_prepared_many`).
        Raises what refused an operation; the ones before it stay written in this transaction.
        """
        preps = [self.prepare(op) for op in ops]
        out: list[Committed | None] = []
        for start, end in runs(ops):
            if end - start > 1 and await self.execute_prepared_many(ops[start:end], preps[start:end]):
                out += [self.record_prepared(op, prep) for op, prep in zip(ops[start:end], preps[start:end])]
                continue
            for op, prep in zip(ops[start:end], preps[start:end]):
                if not await self.execute_prepared(op, prep):
                    out.append(None)
                    continue
                out.append(self.record_prepared(op, prep))
        return out

    async def execute_prepared_many(self, ops: Sequence[Op], preps: Sequence[dict[str, Any]]) -> bool:
        """Run prepared operations of one shape (see :func:`runs`) at once: SQLite ``executemany``,
    PostgreSQL one statement that writes the rows and their events.

        ``True`` when every operation wrote its row. Otherwise the batch is rolled back to a
        savepoint and ``False`` returned (nothing written): the caller runs them one by one,
        which tells which one found a stale row or an existing id.
        """
        await self.ensure_fence()
        first = ops[0]
        table = self.journal.kinds.get(first.kind).table
        if self.journal.backend == "postgresql":
            return await self._postgresql_many(ops, preps, table)
        if isinstance(first, Create):
            stmt: sa.Executable = _insert_stmt(table)
            params = [prep["row"] for prep in preps]
        else:
            stmt = _update_stmt(table, tuple(sorted(first.changes)))
            params = [prep["params"] for prep in preps]
        sp = await self._w.savepoint()
        try:
            result = await self._w.execute(stmt, params)
        except BaseException:
            await self._w.rollback_to(sp)  # a value the database refused: let the caller's rollback see a clean state
            raise
        if result.rowcount == len(ops):
            await self._w.release(sp)
            return True
        await self._w.rollback_to(sp)
        return False

    async def _postgresql_many(self, ops: Sequence[Op], preps: Sequence[dict[str, Any]], table: sa.Table) -> bool:
        """PostgreSQL: the run's rows and their events in one statement (``VALUES`` list, data-modifying
        CTEs); all written, or rolled back to a savepoint."""

        fence = self.fence
        common = {"now": self.now, "kind": ops[0].kind, "actor": fence.holder if fence else self.journal.actor,
                  "epoch": fence.epoch if fence else None}
        params: dict[str, Any] = dict(common)
        if isinstance(ops[0], Create):
            for i, (op, prep) in enumerate(zip(ops, preps)):
                params.update({f"{n}_{i}": v for n, v in prep["row"].items()})
                params.update({f"e_reason_{i}": op.reason, f"e_payload_{i}": prep["payload"], f"ord_{i}": i})
            stmt = create_statement(table, pad(params, create_value_names(table), len(ops)))
        else:
            columns = tuple(sorted(ops[0].changes))
            for i, (op, prep) in enumerate(zip(ops, preps)):
                assert isinstance(op, Transition)
                params.update({f"w_id_{i}": op.entity_id, f"w_state_{i}": op.from_state, f"w_version_{i}": op.version,
                               f"n_state_{i}": op.to_state, f"e_reason_{i}": op.reason,
                               f"e_payload_{i}": prep["payload"], f"ord_{i}": i,
                               **{f"c_{n}_{i}": op.changes[n] for n in columns}})
            stmt = transition_statement(table, columns, pad(params, transition_value_names(columns), len(ops)), False)
        sp = await self._w.savepoint()
        try:
            written = (await self._w.execute(stmt, params)).all()
        except sa.exc.IntegrityError:
            # A unique index other than the id's: one by one, the create it refuses says so.
            await self._w.rollback_to(sp)
            return False
        except BaseException:
            await self._w.rollback_to(sp)
            raise
        if len(written) == len(ops):
            await self._w.release(sp)
            for prep in preps:
                prep["event_written"] = True
            return True
        await self._w.rollback_to(sp)
        return False

    # -- the three halves of an operation (shared with journal.batch) -----------------------
    def prepare(self, op: Op) -> dict[str, Any]:
        """Check ``op`` against its machine and table; build its parameters and event payload.

        Raises before anything is written: :class:`IllegalTransition`,
        :class:`UnknownState`, :class:`InvalidColumn`, :class:`InvalidPayload`.
        """
        ek = self.journal.kinds.get(op.kind)
        if isinstance(op, Create):
            state = op.state
            if state is None:
                if len(ek.machine.initial) != 1:
                    raise ValueError(f"{op.kind}: name the initial state, one of {sorted(ek.machine.initial)}")
                (state,) = ek.machine.initial
            ek.machine.check_initial(op.entity_id, state)
            given = dict(op.values)
            ek.check_columns(given)
            full = ek.defaults()
            full.update(given)
            ek.check_not_null(full)
            now = self.now
            row = {**full, "id": op.entity_id, "state": state, "version": 1, "created_at": now, "updated_at": now}
            return {"row": row, "state": state, "payload": self._payload(op.kind, full, op.note)}
        ek.machine.check(op.entity_id, op.from_state, op.to_state)
        changes = dict(op.changes)
        ek.check_columns(changes)
        ek.check_not_null(changes)
        params = {**changes, "w_id": op.entity_id, "w_state": op.from_state, "w_version": op.version,
                  "state": op.to_state, "version": op.version + 1, "updated_at": self.now}
        return {"params": params, "payload": self._payload(op.kind, changes, op.note)}

    async def execute_prepared(self, op: Op, prep: dict[str, Any]) -> bool:
        """Run one prepared operation; ``False`` only for a create ``if_absent`` that found a row."""
        table = self.journal.kinds.get(op.kind).table
        if isinstance(op, Create):
            await self.ensure_fence()
            if self.journal.backend == "postgresql":
                # The row and its event in one statement, like transitions (see below).
                event = self._event_row(op.kind, op.entity_id, None, prep["state"], 1, op.reason, prep["payload"])
                params = {**prep["row"], **{f"e_{k}": v for k, v in event.items()}}
                if _has_unique_index(table):
                    # ON CONFLICT covers the id only, so another unique index may refuse the row; a
                    # savepoint keeps that refusal from aborting the rest of the transaction.
                    sp = await self._w.savepoint()
                    try:
                        inserted = (await self._w.execute(_create_with_event_stmt(table), params)).all()
                    except sa.exc.IntegrityError as exc:
                        await self._w.rollback_to(sp)
                        name = getattr(getattr(exc.orig, "__cause__", None), "constraint_name", None)
                        raise ConstraintViolation(op.kind, op.entity_id, name, _first_line(exc.orig)) from None
                    await self._w.release(sp)
                else:
                    inserted = (await self._w.execute(_create_with_event_stmt(table), params)).all()
                if inserted:
                    prep["event_written"] = True
                    return True
            else:
                result = await self._w.execute(_insert_stmt(table), prep["row"])
                if result.rowcount == 1:
                    return True
                # INSERT OR IGNORE also ignores a row another unique index refuses: tell them apart.
                if not (await self._w.execute(_exists_stmt(table), {"id": op.entity_id})).all():
                    unique = sorted(str(i.name) for i in table.indexes if i.unique)
                    raise ConstraintViolation(op.kind, op.entity_id, ", ".join(unique) or None,
                                              "another row already holds the values this one needs unique")
            if op.if_absent:
                return False
            raise DuplicateEntity(op.kind, op.entity_id)
        columns = tuple(sorted(op.changes))
        if self.journal.backend == "postgresql":
            return await self._transition_with_event(op, prep, table, columns)
        if self._fence_pending:
            assert self.fence is not None
            f = self.fence
            params = {**prep["params"], "f_name": f.lease, "f_holder": f.holder, "f_epoch": f.epoch,
                      "f_now": self.now}
            result = await self._w.execute(_fenced_update_stmt(table, columns), params)
            if result.rowcount == 1:
                self._fence_pending = False  # the row lock and the lease share lock are held
                return True
            await self.ensure_fence()  # LeaseLost if that is why nothing matched
        else:
            result = await self._w.execute(_update_stmt(table, columns), prep["params"])
        if result.rowcount != 1:
            raise await self.stale(op.kind, op.entity_id, op.from_state, op.version)
        return True

    async def _transition_with_event(self, op: Transition, prep: dict[str, Any], table: sa.Table,
                                     columns: tuple[str, ...]) -> bool:
        """PostgreSQL: the compare-and-set and its event in one statement (a data-modifying CTE).

        With the fence still unchecked, the lease condition (and its share lock) rides
        along too, so a fenced transition is one round trip inside its transaction.
        """
        fenced = self._fence_pending
        event = self._event_row(op.kind, op.entity_id, op.from_state, op.to_state, op.version + 1, op.reason,
                                prep["payload"])
        params = {**prep["params"], **{f"e_{k}": v for k, v in event.items()}}
        if fenced:
            assert self.fence is not None
            params.update({"f_name": self.fence.lease, "f_holder": self.fence.holder, "f_epoch": self.fence.epoch,
                           "f_now": self.now})
        result = await self._w.execute(_update_with_event_stmt(table, columns, fenced), params)
        if result.all():
            self._fence_pending = False  # the row lock (and the lease share lock) are held
            prep["event_written"] = True
            return True
        if fenced:
            await self.ensure_fence()  # LeaseLost if that is why nothing matched
        raise await self.stale(op.kind, op.entity_id, op.from_state, op.version)

    def record_prepared(self, op: Op, prep: dict[str, Any]) -> Committed:
        """Queue the event of an operation that was written (unless its statement wrote it)."""
        if prep.get("event_written"):
    
            done = Committed(op.kind, op.entity_id, None if isinstance(op, Create) else op.from_state,
                             prep["state"] if isinstance(op, Create) else op.to_state,
                             1 if isinstance(op, Create) else op.version + 1)
            self.committed.append(done)
            return done
        if isinstance(op, Create):
            return self._record(op.kind, op.entity_id, None, prep["state"], 1, op.reason, prep["payload"])
        return self._record(op.kind, op.entity_id, op.from_state, op.to_state, op.version + 1, op.reason,
                            prep["payload"])

    async def stale(self, kind: str, entity_id: str, from_state: str, version: int) -> StaleRow:
        """The :class:`StaleRow` for a compare-and-set that matched nothing, with what is there now."""
        t = self.journal.kinds.get(kind).table
        found = (await self._w.execute(sa.select(t.c.state, t.c.version).where(t.c.id == entity_id))).first()
        return StaleRow(kind, entity_id, from_state, version, None if found is None else found.state,
                        None if found is None else found.version)

    async def get(self, kind: str, entity_id: str) -> Row | None:
        """Read one row inside this transaction."""
        ek = self.journal.kinds.get(kind)
        found = (await self._w.execute(sa.select(ek.table).where(ek.table.c.id == entity_id))).first()
        return None if found is None else to_row(kind, found._mapping)

    async def log(self, kind: str, entity_id: str, *, state: str, reason: str,
                  note: Mapping[str, Any] | None = None) -> None:
        """Append an event that records something about a non-entity record (a lease).

        It changes no entity row; ``verify`` ignores kinds that are not registered.
        """
        if kind in self.journal.kinds:
            raise ValueError(f"{kind} is an entity kind: use create() or transition()")
        self._events.append(self._event_row(kind, entity_id, None, state, 0, reason,
                                            self._payload(kind, {}, note)))

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """Make a group of operations all-or-nothing inside a shared transaction."""
        n_events, n_committed = len(self._events), len(self.committed)
        fence_pending = self._fence_pending
        sp = await self._w.savepoint()
        try:
            yield
        except BaseException:
            await self._w.rollback_to(sp)
            del self._events[n_events:]
            del self.committed[n_committed:]
            # A fence checked inside the savepoint lost its lease row lock with it.
            self._fence_pending = fence_pending
            raise
        await self._w.release(sp)

    # -- internals -------------------------------------------------------------------------
    def _payload(self, kind: str, columns: Mapping[str, Any], note: Mapping[str, Any] | None
                 ) -> Encoded | None:
        payload: dict[str, Any] = {}
        if columns:
            payload["set"] = {k: jsonable(v) for k, v in columns.items()}
        if note:
            payload["note"] = dict(note)
        if not payload:
            return None
        try:
            # Serialized once, here: NaN or an unserialisable value is refused before anything is
            # written, and the event's JSON column stores this text as it is.
            return Encoded(dumps(payload))
        except InvalidPayload as exc:
            raise InvalidPayload(f"{kind} event payload", str(exc).split(": ", 1)[-1]) from None

    def _event_row(self, kind: str, entity_id: str, from_state: str | None, to_state: str,
                   version: int, reason: str, payload: Encoded | None) -> dict[str, Any]:
        fence = self.fence
        actor = fence.holder if fence is not None else self.journal.actor
        return {"entity_kind": kind, "entity_id": entity_id, "from_state": from_state,
                "to_state": to_state, "version": version, "reason": reason, "actor": actor,
                "epoch": fence.epoch if fence is not None else None, "payload": payload,
                "ts": self.now}

    def _record(self, kind: str, entity_id: str, from_state: str | None, to_state: str,
                version: int, reason: str, payload: Encoded | None) -> Committed:

        self._events.append(self._event_row(kind, entity_id, from_state, to_state, version, reason, payload))
        done = Committed(kind, entity_id, from_state, to_state, version)
        self.committed.append(done)
        return done

    def pending_events(self) -> tuple[sa.Insert | None, list[dict[str, Any]]]:
        """The event insert to run just before the commit (with its rows)."""
        events, self._events = self._events, []
        return (sa.insert(models.events) if events else None), events


@lru_cache(maxsize=256)
def _update_stmt(table: sa.Table, columns: tuple[str, ...]) -> sa.Update:
    """The compare-and-set UPDATE for ``table`` setting ``columns`` (built once, reused)."""
    c = table.c
    setting = ("state", "version", "updated_at", *columns)
    return (sa.update(table)
            .where(c.id == sa.bindparam("w_id", type_=c.id.type),
                   c.state == sa.bindparam("w_state", type_=c.state.type),
                   c.version == sa.bindparam("w_version", type_=c.version.type))
            .values({name: sa.bindparam(name, type_=c[name].type) for name in setting}))


@lru_cache(maxsize=256)
def _fenced_update_stmt(table: sa.Table, columns: tuple[str, ...]) -> sa.Update:
    """The compare-and-set UPDATE that also requires the lease (PostgreSQL: FOR SHARE on it)."""
    lease = models.leases
    holds = (sa.select(sa.literal(1)).select_from(lease)
             .where(lease.c.name == sa.bindparam("f_name", type_=lease.c.name.type),
                    lease.c.holder == sa.bindparam("f_holder", type_=lease.c.holder.type),
                    lease.c.epoch == sa.bindparam("f_epoch", type_=lease.c.epoch.type),
                    lease.c.expires_at > sa.bindparam("f_now", type_=lease.c.expires_at.type))
             .with_for_update(read=True))
    return _update_stmt(table, columns).where(holds.exists())


_EVENT_FIELDS = ("entity_kind", "entity_id", "from_state", "to_state", "version", "reason", "actor", "epoch",
                 "payload", "ts")


@lru_cache(maxsize=256)
def _update_with_event_stmt(table: sa.Table, columns: tuple[str, ...], fenced: bool) -> sa.Insert:
    """``WITH u AS (UPDATE … RETURNING id) INSERT INTO events … SELECT … FROM u RETURNING seq``."""
    update = _fenced_update_stmt(table, columns) if fenced else _update_stmt(table, columns)
    u = update.returning(table.c.id).cte("u")
    ev = models.events.c
    values = [sa.bindparam(f"e_{name}", type_=ev[name].type) for name in _EVENT_FIELDS]
    insert = (sa.insert(models.events)
              .from_select(list(_EVENT_FIELDS), sa.select(*values).select_from(u))
              .returning(ev.seq))
    return insert.add_cte(u)


@lru_cache(maxsize=64)
def _has_unique_index(table: sa.Table) -> bool:
    return any(index.unique for index in table.indexes)


@lru_cache(maxsize=64)
def _exists_stmt(table: sa.Table) -> sa.Select[Any]:
    return sa.select(sa.literal(1)).select_from(table).where(table.c.id == sa.bindparam("id"))


def _first_line(error: object) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@lru_cache(maxsize=64)
def _create_with_event_stmt(table: sa.Table) -> sa.TextClause | sa.TextualSelect:
    """PostgreSQL: ``WITH r AS (INSERT … ON CONFLICT DO NOTHING RETURNING id) INSERT INTO events …``.

    Built with the dialect's ``insert()`` and then frozen as text with the same typed
    parameters: the dialect construct has no cache key, so SQLAlchemy would compile it
    again on every execution (~0.8 ms per create); the text form is compiled once.
    """
    row = (postgresql.insert(table)
           .values({name: sa.bindparam(name, type_=col.type) for name, col in table.c.items()})
           .on_conflict_do_nothing(index_elements=["id"]).returning(table.c.id).cte("r"))
    ev = models.events.c
    values = [sa.bindparam(f"e_{name}", type_=ev[name].type) for name in _EVENT_FIELDS]
    stmt = (sa.insert(models.events).from_select(list(_EVENT_FIELDS), sa.select(*values).select_from(row))
            .returning(ev.seq).add_cte(row))
    return _frozen(stmt, {**{n: c.type for n, c in table.c.items()},
                          **{f"e_{n}": ev[n].type for n in _EVENT_FIELDS}}, seq=ev.seq.type)


@lru_cache(maxsize=64)
def _insert_stmt(table: sa.Table) -> sa.Insert:
    """SQLite: an INSERT that leaves an existing row (same ``id``) alone, for ``table``.

    ``INSERT OR IGNORE``: a plain insert with a prefix, which SQLAlchemy caches (its
    dialect ``insert().on_conflict_do_nothing()`` has no cache key and compiles on every call).
    Besides the primary key it would ignore NOT NULL too, but :meth:`WriteTx.prepare` has
    refused a missing NOT NULL value before, and the tables have no other constraint.
    """
    return sa.insert(table).prefix_with("OR IGNORE")


def _frozen(stmt: sa.Insert, types: Mapping[str, Any], **returning: Any) -> sa.TextClause | sa.TextualSelect:
    """``stmt`` compiled once for PostgreSQL as a cacheable text clause with the same typed parameters."""
    sql = str(stmt.compile(dialect=PGDialect(paramstyle="named")))  # type: ignore[no-untyped-call]
    # ``:p::JSON`` would hide ``p`` from text()'s parameter parsing: spell the cast out.
    sql = re.sub(r":(\w+)::(\w+)", r"CAST(:\1 AS \2)", sql)
    text = sa.text(sql).bindparams(*(sa.bindparam(n, type_=t) for n, t in types.items()))
    return text.columns(**returning) if returning else text


def to_row(kind: str, mapping: Mapping[Any, Any]) -> Row:
    values = {k: v for k, v in mapping.items() if k not in ("id", "state", "version")}
    return Row(kind, mapping["id"], mapping["state"], mapping["version"], values)


__all__ = ["MAX_RUN", "MIN_RUN", "Row", "WriteTx", "jsonable", "runs", "to_row"]
