"""The one paging lister: ``GET /v1/<rows>[?state=&limit=&before=]``, newest first.

Every family lists its rows the same way: an optional ``state`` (one of the kind's states), a
``limit`` (1..the page maximum) and ``before`` (the id of the last row of the previous page, the
reply's ``next_before``, ``null`` on the last page). Rows are ordered by ``order`` descending
(default ``created_at`` then ``id``; the last column must be unique), so a page never repeats or
skips a row that was there when the first page was read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from aiohttp import web

from journal import Journal

from engine.http.query import QueryError, parse_list_query, single_values
from engine.http.shell import Handler


def before(cols: Sequence[Any], anchor: Sequence[Any]) -> Any:
    """Rows strictly before ``anchor`` in the descending order of ``cols`` (a keyset condition)."""
    terms = []
    for i, col in enumerate(cols):
        terms.append(sa.and_(*(c == a for c, a in zip(cols[:i], anchor[:i])), col < anchor[i]))
    return sa.or_(*terms)


def lister(journal: Journal, kind: str, key: str, shape: Callable[[Mapping[Any, Any], datetime], dict[str, Any]],
           now: Callable[[], datetime], *, order: tuple[str, ...] = ("created_at", "id")) -> Handler:
    """The handler listing ``kind``'s rows as ``{key: [shape(row, now)...], "next_before"}`` (``now``
    read once per request, from the injectable clock); wrap it in :func:`~engine.http.shell.typed`
    (a bad parameter is a :class:`QueryError`)."""
    table = journal.kinds.get(kind).table
    cols = [table.c[name] for name in order]

    async def handler(request: web.Request) -> web.Response:
        state, limit, before_id = parse_list_query(single_values(request.query), kind, journal.kinds)
        stmt = sa.select(table)
        if state is not None:
            stmt = stmt.where(table.c.state == state)
        async with journal.read() as conn:
            if before_id is not None:
                anchor = (await conn.execute(sa.select(*cols).where(table.c.id == before_id))).first()
                if anchor is None:
                    raise QueryError("before", before_id, f"no {kind} row has this id (give a next_before)")
                stmt = stmt.where(before(cols, tuple(anchor)))
            rows = (await conn.execute(stmt.order_by(*(c.desc() for c in cols)).limit(limit))).all()
        at = now()
        items = [shape(r._mapping, at) for r in rows]
        return web.json_response({key: items, "next_before": items[-1]["id"] if len(items) == limit else None})

    return handler


__all__ = ["before", "lister"]
