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

#: ``engines`` states of an engine the gate has not (yet) put on the committed head since its launch.
UNGATED = ("registered", "unverified", "unreachable")


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
    if not engines:
        return None
    e = models.engines
    engine = (await conn.execute(sa.select(s.c.id, e.c.state).select_from(s.join(e, e.c.id == s.c.engine)).where(
        s.c.desired != "removed", e.c.state.in_(UNGATED)).order_by(s.c.id).limit(1))).first()
    return None if engine is None else (f"the deployment is not ready (the engine of service {engine.id} is "
                                        f"{engine.state}: not yet on the committed head)")


__all__ = ["deployment_held"]
