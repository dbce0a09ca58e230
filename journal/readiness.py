"""Whether the deployment's service stack lets work go on, read from its ``services`` rows.

Rollout dispatch and the start of a publication hold while any service the configuration declares
is not ``ready`` (starting, being rebuilt, failed, or brought down by an operator), and while the
``engines`` row a service runs has not been put on the committed head by the engine gate since the
service's launch (``registered``, ``unverified``, ``unreachable``); a journal with no ``services``
rows (no stack declared) never holds. Rows of services no longer declared carry
``desired = 'removed'`` and do not count.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from . import models
from .lease import ORCHESTRATOR

#: ``engines`` states of an engine the gate has not (yet) put on the committed head since its launch,
#: or one that is never used again until it is replaced (``uncertain``: a memory-region call failed).
UNGATED = ("registered", "unverified", "unreachable", "uncertain")


async def deployment_held(conn: Any, *, engines: bool = True) -> str | None:
    """Why work is held (one line naming the first service that is not ready), or ``None``.

    ``engines=False`` leaves out the engines not yet gated: the start of a publication must not wait
    for them, since the engine gate leaves an unverified engine alone while a job is in
    ``CHECKPOINT`` (the publisher is about to act on every engine, the new one included), and the
    two would wait for each other."""
    s = models.services
    row = (await conn.execute(sa.select(s.c.id, s.c.state).where(
        s.c.desired != "removed", s.c.state != "ready").order_by(s.c.id).limit(1))).first()
    if row is not None:
        return f"the deployment is not ready (service {row.id} is {row.state})"
    # A row last moved under an earlier lease epoch says what a previous leader saw: right after an
    # election its processes may be gone while it still reads "ready", until the new leader's
    # stack has taken it over (confirmed the old group gone and launched it again).
    e, lease = models.events, models.leases
    latest = (sa.select(e.c.epoch).where(e.c.entity_kind == "services", e.c.entity_id == s.c.id)
              .order_by(e.c.seq.desc()).limit(1).correlate(s).scalar_subquery())
    epoch = sa.select(lease.c.epoch).where(lease.c.name == ORCHESTRATOR).scalar_subquery()
    stale = (await conn.execute(sa.select(s.c.id).where(
        s.c.desired != "removed", epoch.is_not(None), latest.is_distinct_from(epoch)).order_by(s.c.id)
        .limit(1))).scalar()
    if stale is not None:
        return (f"the deployment is not ready (service {stale} was ready under a previous leader and is not "
                f"taken over yet)")
    if not engines:
        return None
    e = models.engines
    engine = (await conn.execute(sa.select(s.c.id, e.c.state).select_from(s.join(e, e.c.id == s.c.engine)).where(
        s.c.desired != "removed", e.c.state.in_(UNGATED)).order_by(s.c.id).limit(1))).first()
    if engine is None:
        return None
    if engine.state == "uncertain":
        return (f"the deployment is not ready (the engine of service {engine.id} is uncertain: its memory state "
                f"is unknown, and it is being replaced)")
    return (f"the deployment is not ready (the engine of service {engine.id} is {engine.state}: not yet on the "
            f"committed head)")


async def participants_held(conn: Any) -> str | None:
    """Why a restore must not pick its members yet (one line), or ``None``.

    A restore is all or nothing into the participants that are ``healthy`` at its first look, so
    it waits while the stack is being started or rebuilt (any declared service not ``ready``), and
    while a participant the stack serves (its ``url`` is a service's ``endpoint``) is not
    ``healthy``: right after a rebuild its row still says what the probes saw while it was down,
    until the probe that every service's ``ready`` triggers. Engines are left out (a restore does
    not involve them)."""
    held = await deployment_held(conn, engines=False)
    if held is not None:
        return held
    s, p = models.services, models.participants
    endpoints = {str(e).rstrip("/") for e in (await conn.execute(sa.select(s.c.endpoint).where(
        s.c.desired != "removed", s.c.endpoint.is_not(None)))).scalars()}
    if not endpoints:
        return None
    for name, url, state in (await conn.execute(sa.select(p.c.id, p.c.url, p.c.state).where(
            p.c.state != "removed").order_by(p.c.id))).all():
        if state != "healthy" and str(url).rstrip("/") in endpoints:
            return f"participant {name} of the deployment is {state}, not yet probed healthy again"
    return None


__all__ = ["deployment_held", "participants_held"]
