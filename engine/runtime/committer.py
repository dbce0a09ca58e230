"""Group commit: many controllers' writes in shared transactions, each still its own unit.

Controllers and the dispatcher hand a write function to :meth:`GroupCommitter.run`.
Submissions that arrive while a transaction is being committed wait and are
then written together in the next one. Each submission runs inside its own
savepoint, so one that raises (a stale row, an illegal edge) is rolled back
alone and gets its exception; the others commit. Every transition is still a
compare-and-set with its own event — batching only shares the commit (and so
the fsync) between independent entities. One entity's sequential steps still
cost one commit each, because a controller awaits its write before deciding
the next step.

The transaction is fenced with the current leader fence. If the fence check
fails, every submission of that batch gets :class:`journal.LeaseLost` and
``on_lease_lost`` is called so the leader loop can stop at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from journal import Committed, Fence, Journal, LeaseLost, StaleRow, WriteTx
from journal.batch import Op

from engine.runtime.metrics import Metrics

T = TypeVar("T")
WriteFn = Callable[[WriteTx], Awaitable[Any]]


def raise_if_cancelled(exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError):
        raise exc


class NotLeader(Exception):
    """This orchestrator holds no valid lease, so it may not write."""


@dataclass
class _Submission:
    fn: WriteFn | None = None
    ops: Sequence[Op] | None = None
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupCommitter:
    def __init__(self, journal: Journal, fence: Callable[[], Fence | None], *, max_batch: int = 256,
                 on_lease_lost: Callable[[LeaseLost], None] | None = None,
                 metrics: Metrics | None = None) -> None:
        self._journal = journal
        self._metrics = metrics
        self._fence = fence
        self._max_batch = max_batch
        self._on_lease_lost = on_lease_lost
        self._pending: list[_Submission] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        self.writes = 0

    async def run(self, fn: Callable[[WriteTx], Awaitable[T]]) -> T:
        """Run ``fn`` in a shared fenced transaction and return its result after the commit."""
        return await self._submit(_Submission(fn=fn))  # type: ignore[no-any-return]

    async def run_fresh(self, fn: Callable[[WriteTx], Awaitable[T]], *, tries: int = 5) -> T:
        """:meth:`run` for a compare-and-set that reads the row it moves: run again while it raises
        :class:`StaleRow` (a controller moved the row between the read and the write), at most
        ``tries`` times; the last :class:`StaleRow` propagates for the caller to refuse."""
        if tries < 1:
            raise ValueError(f"tries must be at least 1, not {tries}")
        # No wait between tries: the row moved, so the next read sees its new version at once.
        retrying = AsyncRetrying(retry=retry_if_exception_type(StaleRow), stop=stop_after_attempt(tries),
                                 reraise=True)
        result: T = await retrying(self.run, fn)
        return result

    async def apply(self, *ops: Op) -> list[Committed | None]:
        """Apply declarative operations (all-or-nothing) in a shared fenced transaction.

        The cheapest write: on PostgreSQL a whole batch of them costs a few
        statements (see :mod:`journal.batch`). Raises what refused them
        (:class:`StaleRow`, :class:`IllegalTransition`, ...).
        """
        return await self._submit(_Submission(ops=ops))  # type: ignore[no-any-return]

    async def apply_each(self, ops: Sequence[Op]) -> list[Committed | None | Exception]:
        """Apply each operation as its own group (one may fail alone), all in the same commit.

        Returns, per operation, what it committed or the exception that refused it
        (a :class:`StaleRow` for a row another writer moved first).
        """
        if not ops:
            return []
        subs = [_Submission(ops=(op,)) for op in ops]
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="tidelog-group-commit")
        self._pending.extend(subs)
        self._wake.set()
        out: list[Committed | None | Exception] = []
        for got in await asyncio.gather(*(sub.future for sub in subs), return_exceptions=True):
            if isinstance(got, BaseException) and not isinstance(got, Exception):
                raise got
            out.append(got if isinstance(got, Exception) else got[0])
        return out

    async def _submit(self, sub: _Submission) -> Any:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="tidelog-group-commit")
        self._pending.append(sub)
        self._wake.set()
        return await sub.future

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sub in self._pending:
            if not sub.future.done():
                sub.future.set_exception(NotLeader("orchestrator stopping"))
        self._pending.clear()

    async def _loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch:]
            # A submitter that gave up (cancelled) must not have its write committed behind its back.
            batch = [sub for sub in batch if not sub.future.done()]
            try:
                await self._commit(batch)
            except asyncio.CancelledError:
                self._fail(batch, NotLeader("group commit stopped"))
                raise
            except Exception as exc:  # noqa: BLE001 - never let one batch stop the loop
                self._fail(batch, exc)

    async def _commit(self, batch: list[_Submission]) -> None:
        fence = self._fence()
        if fence is None:
            self._fail(batch, NotLeader("no valid leader lease"))
            return
        declared = [sub for sub in batch if sub.ops is not None]
        if declared:
            await self._apply(declared, fence)
        batch = [sub for sub in batch if sub.fn is not None]
        if batch:
            await self._run(batch, fence)

    async def _apply(self, batch: list[_Submission], fence: Fence) -> None:
        started = time.perf_counter()
        try:
            outcomes = await self._journal.apply([sub.ops or () for sub in batch], fence)
        except (LeaseLost, asyncio.CancelledError) as exc:
            self._fail(batch, exc)
            raise_if_cancelled(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a database error from one submission
            if len(batch) == 1:
                self._fail(batch, exc)
                return
            # Do not let one bad write (a value the column refuses) fail the others:
            # apply each submission on its own.
            for sub in batch:
                await self._apply([sub], fence)
            return
        self._settle(batch, [(not isinstance(o, Exception), o) for o in outcomes], started)

    def _fail(self, batch: list[_Submission], exc: BaseException) -> None:
        if isinstance(exc, LeaseLost) and self._on_lease_lost is not None:
            self._on_lease_lost(exc)
        for sub in batch:
            if not sub.future.done():
                sub.future.set_exception(exc if isinstance(exc, Exception) else NotLeader("cancelled"))

    async def _run(self, batch: list[_Submission], fence: Fence) -> None:
        outcomes: list[tuple[bool, Any]] = []
        started = time.perf_counter()
        try:
            async with self._journal.write(fence) as tx:
                if len(batch) == 1:
                    assert batch[0].fn is not None
                    outcomes.append((True, await batch[0].fn(tx)))
                else:
                    for sub in batch:
                        assert sub.fn is not None
                        try:
                            async with tx.savepoint():
                                outcomes.append((True, await sub.fn(tx)))
                        except LeaseLost:
                            raise  # the whole transaction is fenced off, not just this write
                        except Exception as exc:  # noqa: BLE001 - handed to its submitter
                            outcomes.append((False, exc))
        except BaseException as exc:
            self._fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._settle(batch, outcomes, started)

    def _settle(self, batch: list[_Submission], outcomes: list[tuple[bool, Any]], started: float) -> None:
        """After a commit (begun at ``started``, ``perf_counter`` seconds): time it, and hand each
        submitter its result, or the exception that refused it."""
        if self._metrics is not None:
            self._metrics.commit_seconds.observe(time.perf_counter() - started)
        self.commits += 1
        self.writes += len(batch)
        for sub, (ok, value) in zip(batch, outcomes):
            if sub.future.done():
                continue
            if ok:
                sub.future.set_result(value)
            else:
                sub.future.set_exception(value)
