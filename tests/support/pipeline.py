"""A test workflow: a pipeline of N remote steps, each one RPC through the outbox.

``pipelines`` is a kind defined here (not in the product schema): the table is
created on top of the migrated journal by :func:`install`. It exercises the
machinery the real workflows use — the transition primitive, intents with
derived ids, the dispatcher, wake-ups and recovery — end to end.

States: ``step0 -> step1 -> … -> stepN -> done``; ``stepK -> failed`` when
the remote refuses step K.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from engine.runtime.reconciler import BaseController, Context, Result
from journal import EntityKind, Journal, StateMachine, WriteTx, outbox
from journal.models import entity_columns
from journal.writes import Row

STEPS = 5
KIND = "pipelines"

metadata = sa.MetaData()
table = sa.Table(KIND, metadata, *entity_columns(),
                 sa.Column("results", sa.JSON(none_as_null=True), nullable=True))


def machine(steps: int = STEPS) -> StateMachine:
    edges: dict[str, list[str]] = {f"step{k}": [f"step{k + 1}", "failed"] for k in range(steps - 1)}
    edges[f"step{steps - 1}"] = ["done", "failed"]
    return StateMachine.build(KIND, initial=["step0"], edges=edges, terminal=["done", "failed"])


def register(journal: Journal, steps: int = STEPS) -> None:
    journal.kinds.register(EntityKind(KIND, table, machine(steps)))


async def install(journal: Journal) -> None:
    async with journal.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


class PipelineController(BaseController):
    """At ``stepK``: make sure the step-K call is queued; once it succeeded, move on."""

    kind = KIND

    def __init__(self, target: str, steps: int = STEPS) -> None:
        self.target = target
        self.steps = steps

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state in ("done", "failed"):
            return Result()
        k = int(row.state.removeprefix("step"))
        intent = outbox.Intent.for_row(row, target=self.target, method="POST", path="/apply",
                                       body={"pipeline": entity_id, "step": k}, timeout_s=5.0)

        # Odd steps are claimed at creation (created inflight, handed to the dispatcher after the
        # commit), even steps go through the dispatcher's claim: a run passes both ways in.
        claim = ctx.claims and k % 2 == 1

        async def step(tx: WriteTx) -> list[Row]:
            call = await outbox.get(tx, intent.id)
            if call is None:
                return await outbox.ensure_all(tx, [(intent, f"step {k}")], claim=claim)
            if call.state == "succeeded":
                nxt = "done" if k == self.steps - 1 else f"step{k + 1}"
                results: list[Any] = list(row["results"] or []) + [call["result"]]
                await tx.transition(KIND, entity_id, from_state=row.state, version=row.version, to_state=nxt,
                                    reason=f"step {k} applied", changes={"results": results})
            elif call.state in ("failed", "ambiguous"):
                await tx.transition(KIND, entity_id, from_state=row.state, version=row.version,
                                    to_state="failed", reason=f"step {k} {call.state}",
                                    changes={"results": row["results"]})
            return []

        ctx.send(await ctx.write(step))
        return Result()
