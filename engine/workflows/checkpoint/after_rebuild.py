"""The checkpoint family's part in a stack rebuild: the participants put back on the latest checkpoint.

A rebuild of the deployment's stack stops every service, so every participant loses what it held
in flight. The stack then calls every family's ``on_rebuild`` (``Deps.rebuilt``), once the old
processes are confirmed gone and before the new ones start. With ``checkpoint.restore_after_rebuild``
(on by default) and a checkpoint published in ``checkpoint.directory``, :meth:`AfterRebuild.restore`
asks for its restore (a ``restores`` row, run by :mod:`.restore`) for the episodes it holds that the
journal still has on their checkpointed attempt (:func:`.restore.still_on_their_attempt`). Invariants:

- The row is written before any new participant can be dispatched to: an open restore holds
  rollout dispatch (``open_workflow``), and the restore itself picks its members only once the stack
  is ready and each participant it serves is probed healthy (``participants_held``).
- ``/readyz`` waits for that restore's end (:meth:`AfterRebuild.held`): ``done``, or ``failed``
  (rolled back, its rollouts started over from their input, which is what they would have done
  without it). Read from the journal (a rebuild's restore is named ``rs-rebuild-...``), so an
  orchestrator that takes over while it runs holds readiness for it too.
- Nothing to restore (no checkpoint published, none of its episodes still on that attempt) or a
  checkpoint or restore already open: no row, and the rebuild goes on as before, saying why in the
  log. A restore is never a reason for the stack's supervisor to stop.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from journal import WriteTx, models
from journal.machines import RESTORES

from engine.runtime.workflow import FencedWrite
from engine.workflows.checkpoint.confined import run as confined_run
from engine.workflows.checkpoint.restore import (
    CheckpointNotFound, resolve_checkpoint, start_restore, still_on_their_attempt)
from engine.workflows.checkpoint.rules import WorkflowOpen, refuse_while_open

log = logging.getLogger("tidelog.restore")
#: The id prefix of the restores a rebuild asks for (``/readyz`` waits for them).
REBUILD_PREFIX = "rs-rebuild-"


class AfterRebuild:
    """The restore a rebuild asks for, and readiness held until it has ended (module docstring)."""

    def __init__(self, write: FencedWrite, read: Callable[[], Any], directory: str) -> None:
        self.write, self.read, self.directory = write, read, directory
        #: The restore the last rebuild of this process asked for (for the log and the tests).
        self.restore_id: str | None = None

    async def restore(self, why: str) -> None:
        """``on_rebuild``: ask for the restore of the latest checkpoint (or say why not, in the log)."""
        self.restore_id = await request_restore(self.write, self.directory, why)

    async def held(self) -> str | None:
        """``not_ready``: why ``/readyz`` waits for a rebuild's restore still open, or ``None``."""
        async with self.read() as conn:
            return await restore_held(conn)


async def request_restore(write: FencedWrite, directory: str, why: str) -> str | None:
    """Ask for the restore of ``directory``'s latest checkpoint (see the module docstring); the
    restore's id, or ``None`` when there is nothing to restore."""
    try:
        checkpoint_id, scope = await confined_run(resolve_checkpoint, directory)
    except CheckpointNotFound as exc:
        log.info("rebuild: no checkpoint to restore the participants from (%s)", exc.reason)
        return None
    except TimeoutError:
        log.warning("rebuild: reading the latest checkpoint of %s timed out; the participants are not restored",
                    directory)
        return None
    restore_id = f"{REBUILD_PREFIX}{secrets.token_hex(4)}"

    async def step(tx: WriteTx) -> str | None:
        kept = await still_on_their_attempt(tx, scope)
        if not kept:
            return f"none of the {len(scope)} episodes of checkpoint {checkpoint_id} is still on its attempt"
        try:
            await refuse_while_open(tx)
        except WorkflowOpen as exc:
            what = "checkpoint" if exc.kind == "checkpoints" else "restore"
            return f"{what} {exc.entity_id} is open ({exc.state}): the rollouts start over from their input"
        await start_restore(tx, restore_id, directory, checkpoint_id, kept,
                            reason=f"the stack is rebuilt ({why[:160]}): restore of checkpoint {checkpoint_id}, "
                                   f"{len(kept)} of its {len(scope)} episodes still on their attempt")
        return None

    skipped = await write(step)
    if skipped is not None:
        log.info("rebuild: the participants are not restored: %s", skipped)
        return None
    log.warning("rebuild: restore %s of checkpoint %s requested", restore_id, checkpoint_id)
    return restore_id


async def restore_held(conn: Any) -> str | None:
    """Why readiness waits for a rebuild's restore (one line, naming the oldest still open), or
    ``None`` when none is open. An operator's restore does not hold readiness."""
    r = models.restores
    row = (await conn.execute(sa.select(r.c.id, r.c.state, r.c.checkpoint_id).where(
        r.c.id.like(f"{REBUILD_PREFIX}%"), r.c.state.not_in(list(RESTORES.terminal)))
        .order_by(r.c.created_at, r.c.id).limit(1))).first()
    if row is None:
        return None
    return f"the participants are being restored from checkpoint {row.checkpoint_id} (restore {row.id} " \
           f"is {row.state})"
