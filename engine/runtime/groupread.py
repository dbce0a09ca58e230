"""Group reads: point lookups issued in the same loop iteration share one query.

Many controllers woken by one group commit each read their own row at about
the same moment; :class:`GroupReader` turns those reads into one
``SELECT … WHERE id IN (…)`` per kind, the read-side twin of group commit.
A read never waits for more than the current loop iteration to be batched.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import sqlalchemy as sa

from journal import Journal
from journal.writes import Row, to_row


class GroupReader:
    def __init__(self, journal: Journal, *, max_batch: int = 500) -> None:
        self._journal = journal
        self._max_batch = max_batch
        self._waiting: dict[str, dict[str, list[asyncio.Future[Row | None]]]] = defaultdict(dict)
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def get(self, kind: str, entity_id: str) -> Row | None:
        self._journal.kinds.get(kind)  # an unknown kind fails here, in the caller
        fut: asyncio.Future[Row | None] = asyncio.get_running_loop().create_future()
        self._waiting[kind].setdefault(entity_id, []).append(fut)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)
        return await fut

    def _start_flush(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, defaultdict(dict)
        task = asyncio.create_task(self._flush(waiting))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self, waiting: dict[str, dict[str, list[asyncio.Future[Row | None]]]]) -> None:
        for kind, by_id in waiting.items():
            table = self._journal.kinds.get(kind).table
            ids = list(by_id)
            for start in range(0, len(ids), self._max_batch):
                chunk = ids[start:start + self._max_batch]
                try:
                    found = await self._journal.fetch(sa.select(table).where(table.c.id.in_(chunk)))
                except BaseException as exc:
                    for entity_id in chunk:
                        for fut in by_id[entity_id]:
                            if not fut.done():
                                fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
                    if not isinstance(exc, Exception):
                        raise
                    continue
                rows = {r.id: to_row(kind, r._mapping) for r in found.all()}
                for entity_id in chunk:
                    for fut in by_id[entity_id]:
                        if not fut.done():
                            fut.set_result(rows.get(entity_id))
