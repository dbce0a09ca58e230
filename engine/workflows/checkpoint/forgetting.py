"""Forgetting rollouts that are done for good, in batches.

A ``finished`` or ``failed`` rollout will not run again and nothing of any of its attempts can still
run, so the participants' retire marks for it (a retire of a rerun, a restore's marks) are no longer
needed: it is forgotten everywhere, callers first, by a ``retirements`` row of op ``forget``
(:mod:`engine.workflows.checkpoint.retirement`), whose end moves the rollouts to ``forgotten``. That
keeps every participant's ``retired_rollouts`` bounded by the rollouts still live.

One forget names many rollouts: :func:`request_forget_batch` takes up to ``limit`` of the oldest done
rollouts into one request ``fgb-…``. One batch is open at a time; the rollouts that finish meanwhile
wait for the next, so batches grow with the rate rollouts finish (as group commit does with writes).
After a batch failed (a participant refused or could not be reached), the next waits ``retry_s``.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

import sqlalchemy as sa

from journal import WriteTx, models
from journal.machines import RETIREMENTS

from engine.workflows.checkpoint.retirement import request_retirement

#: The id prefix of the forget batches the rollout controller requests.
PREFIX = "fgb-"
DONE = ("finished", "failed")


class ForgetWaits(Exception):
    """No batch now: one is open, or the last failed less than ``retry_s`` ago (``after`` seconds left)."""

    def __init__(self, reason: str, after: float | None = None) -> None:
        self.after = after
        super().__init__(reason)


def batch_id(rollout_ids: list[str], now: datetime) -> str:
    digest = hashlib.sha256("\x1f".join([now.isoformat(), *rollout_ids]).encode()).hexdigest()[:24]
    return f"{PREFIX}{digest}"


async def request_forget_batch(tx: WriteTx, *, limit: int, retry_s: float, batched: bool = False) -> list[str]:
    """Request the forget of up to ``limit`` done rollouts (oldest first) in ``tx``; the ids named.
    With ``batched`` (``training.batching.enabled``) a finished rollout is done only once a training
    batch took it (``batch_id`` set).

    Raises :class:`ForgetWaits` while an earlier batch is open or failed less than ``retry_s`` ago;
    returns ``[]`` when nothing is done and not yet forgotten."""
    q, t = models.retirements, models.rollouts
    ours = sa.and_(q.c.op == "forget", q.c.id.like(f"{PREFIX}%"))
    open_batch = (await tx.execute(sa.select(q.c.id).where(
        ours, q.c.state.not_in(sorted(RETIREMENTS.terminal))).limit(1))).scalar()
    if open_batch is not None:
        raise ForgetWaits(f"forget batch {open_batch} is open")
    last = (await tx.execute(sa.select(q.c.state, q.c.updated_at).where(ours)
                             .order_by(q.c.updated_at.desc(), q.c.id.desc()).limit(1))).first()
    if last is not None and last.state == "failed":
        waited = (tx.now - last.updated_at).total_seconds()
        if waited < retry_s:
            raise ForgetWaits("the last forget batch failed", retry_s - waited)
    done: sa.ColumnElement[bool] = t.c.state.in_(DONE)
    if batched:
        done = sa.and_(done, sa.or_(t.c.state == "failed", t.c.batch_id.is_not(None)))
    ids = list((await tx.execute(sa.select(t.c.id).where(done)
                                 .order_by(t.c.updated_at, t.c.id).limit(limit))).scalars())
    if ids:
        await request_retirement(tx, batch_id(ids, tx.now), "forget", rollout_ids=ids)
    return ids


__all__ = ["DONE", "PREFIX", "ForgetWaits", "batch_id", "request_forget_batch"]
