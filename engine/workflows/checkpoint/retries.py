"""Trying a checkpoint again under a new id, once every member of the failed try has resumed.

Two failures end a try this way, while ``try_number < max_tries``:

- **stragglers** (the straggler policy of the protocol): a prepare stage missed its deadline with
  blockers. The next try is created in the same write as a ``retire`` of the blockers
  (:func:`retirement_id`), and prepares only once that retirement is done;
- **a failed export**: a member answered a commit ``409 export_failed``. That checkpoint can never be
  committed (a later export could take a later cut than the other members committed), so the next
  try prepares again under a new id at once, nothing retired (``retry_reason``).

Try ids: ``<base>-try<N>`` (:func:`next_try_id`). The rows are created here; the checkpoint
controller runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from journal import WriteTx
from journal.writes import Row
from workers.protocol import EpisodeId, ErrorCode

from engine.runtime.reconciler import Context
from engine.workflows.checkpoint.retirement import request_retirement

KIND = "checkpoints"
MEMBERS = "checkpoint_members"
#: ``checkpoints.retry_reason`` of a try aborted because a member's export failed.
EXPORT_FAILED = ErrorCode.EXPORT_FAILED.value


def retirement_id(checkpoint_id: str) -> str:
    """The retirement that retires a failed try's blockers."""
    return f"stragglers-of-{checkpoint_id}"


def next_try_id(checkpoint_id: str, try_number: int) -> str:
    base = checkpoint_id.rsplit("-try", 1)[0] if "-try" in checkpoint_id else checkpoint_id
    return f"{base}-try{try_number}"


def member_id(checkpoint_id: str, participant: str) -> str:
    return f"{checkpoint_id}/{participant}"


def retries(row: Row, final: str) -> bool:
    """Whether a try ending ``final`` is tried again: aborted with blockers or a failed export, and
    tries left."""
    retryable = bool(row["blockers"]) or row["retry_reason"] == EXPORT_FAILED
    return final == "aborted" and retryable and row["try_number"] < row["max_tries"]


async def start_retry(ctx: Context, row: Row, members: Sequence[Row], changes: dict[str, Any]) -> str:
    """In one write: end this try (``aborted``, with ``changes``), retire its blockers if it has any,
    and create the next try with the same members. Returns the next try's id."""
    next_id = next_try_id(row.id, row["try_number"] + 1)
    blockers = sorted({k for keys in (row["blockers"] or {}).values() for k in keys})
    episodes = [EpisodeId.from_capture_key(k) for k in blockers]
    why = (f"retiring {len(blockers)} blockers, retry as {next_id}" if blockers
           else f"a member's export failed; retry as {next_id}")

    async def write(tx: WriteTx) -> None:
        await tx.transition(KIND, row.id, from_state=row.state, version=row.version, to_state="aborted",
                            reason=f"every member resumed; {why}", changes=changes)
        if episodes:
            await request_retirement(tx, retirement_id(row.id), "retire", episodes=episodes)
        await tx.create(KIND, next_id, reason=f"retry {row['try_number'] + 1} of {row.id}",
                        values={"checkpoint_dir": row["checkpoint_dir"], "max_tries": row["max_tries"],
                                "try_number": row["try_number"] + 1, "retry_of": row.id})
        for m in members:
            await tx.create(MEMBERS, member_id(next_id, m["participant"]), reason="member of the checkpoint",
                            values={"checkpoint_id": next_id, "participant": m["participant"], "kind": m["kind"],
                                    "url": m["url"], "stage": m["stage"]})
    await ctx.write(write)
    return next_id


__all__ = ["EXPORT_FAILED", "member_id", "next_try_id", "retirement_id", "retries", "start_retry"]
