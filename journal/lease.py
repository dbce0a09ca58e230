"""The leader lease: one active orchestrator, fenced by a monotonic epoch.

A holder renews its lease before ``expires_at``. Anyone may take over a lease
that has lapsed; taking over always increments the epoch, even when the lapsed
holder is the one taking it back, because the lapsed holder's earlier calls may
still be on the wire. Every fenced write (see :meth:`Journal.write`) checks
holder, epoch and expiry in its own transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from . import models
from .commits import Fence
from .database import Journal
from .errors import LeaseLost

#: The orchestrator's lease: whoever holds it leads (``engine.runtime.leader``).
ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class LeaseState:
    name: str
    holder: str
    epoch: int
    expires_at: datetime
    #: The journal's line of leaders: minted with the lease row by the journal's first leader and
    #: never changed (``None`` only for a row an older version wrote, until its next take-over).
    lineage: str | None = None

    def fence(self) -> Fence:
        return Fence(self.name, self.holder, self.epoch)


async def read_lease(journal: Journal, name: str) -> LeaseState | None:
    async with journal.read() as conn:
        row = (await conn.execute(sa.select(models.leases).where(models.leases.c.name == name))).first()
    return None if row is None else LeaseState(row.name, row.holder, row.epoch, row.expires_at, row.lineage)


async def acquire(journal: Journal, name: str, holder: str, ttl_s: float) -> LeaseState | None:
    """Take a new or lapsed lease with epoch + 1; ``None`` while any lease is live.

    Never a renewal, not even for the same holder name: a restarted process with
    a configured id must not inherit its predecessor's epoch (the predecessor's
    calls may still be on the wire). Renewal is :func:`renew`, with the fence
    that :func:`acquire` returned. A take-over is logged as an event.
    """
    t = models.leases
    async with journal.write() as tx:
        now = tx.now
        expires = now + timedelta(seconds=ttl_s)
        row = (await tx.execute(sa.select(t).where(t.c.name == name).with_for_update())).first()
        # Minted here, by the first leader of this journal (not by a migration: a journal copied
        # from a migrated template must still get a lineage of its own).
        lineage = uuid.uuid4().hex if row is None or row.lineage is None else row.lineage
        if row is None:
            # Two candidates may both find no row (PostgreSQL: FOR UPDATE locks nothing that
            # does not exist yet); the one whose insert loses sees a live lease, not an error.
            insert = postgresql.insert(t) if journal.backend == "postgresql" else sqlite.insert(t)
            result = await tx.execute(
                insert.values(name=name, holder=holder, epoch=1, expires_at=expires, acquired_at=now,
                              renewed_at=now, lineage=lineage).on_conflict_do_nothing(index_elements=["name"]))
            if result.rowcount != 1:
                return None
            await tx.log("leases", name, state="held", reason="acquired",
                         note={"holder": holder, "epoch": 1, "lineage": lineage})
            return LeaseState(name, holder, 1, expires, lineage)
        if row.expires_at > now:
            return None
        epoch = row.epoch + 1
        await tx.execute(sa.update(t).where(t.c.name == name).values(
            holder=holder, epoch=epoch, expires_at=expires, acquired_at=now, renewed_at=now, lineage=lineage))
        await tx.log("leases", name, state="held", reason="taken over after lapse",
                     note={"holder": holder, "epoch": epoch, "previous_holder": row.holder,
                           "previous_epoch": row.epoch,
                           "previous_expired_at": row.expires_at.isoformat()})
        return LeaseState(name, holder, epoch, expires, lineage)


async def renew(journal: Journal, fence: Fence, ttl_s: float) -> LeaseState:
    """Extend a lease still held at ``fence.epoch``; :class:`LeaseLost` otherwise."""
    t = models.leases
    async with journal.write(fence) as tx:
        expires = tx.now + timedelta(seconds=ttl_s)
        await tx.execute(sa.update(t).where(t.c.name == fence.lease)
                              .values(expires_at=expires, renewed_at=tx.now))
        lineage = (await tx.execute(sa.select(t.c.lineage).where(t.c.name == fence.lease))).scalar()
    return LeaseState(fence.lease, fence.holder, fence.epoch, expires, lineage)


async def release(journal: Journal, fence: Fence) -> bool:
    """Let the lease lapse now so a standby takes over at once (graceful shutdown)."""
    t = models.leases
    try:
        async with journal.write(fence) as tx:
            await tx.execute(sa.update(t).where(t.c.name == fence.lease).values(expires_at=tx.now))
            await tx.log("leases", fence.lease, state="released", reason="released on shutdown",
                         note={"holder": fence.holder, "epoch": fence.epoch})
    except LeaseLost:
        return False
    return True
