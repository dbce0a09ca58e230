"""The checkpoint workflow: prepare stage by stage, commit, publish, resume (or abort).

A ``checkpoints`` row and one ``checkpoint_members`` row per participant are
created together (:func:`start_checkpoint`). The controller then advances the
checkpoint; every call to a participant is an outbox intent owned by the
checkpoint at its current state and version, so reconciling the same state
again finds the same intents, never new ones, and a completed call wakes the
checkpoint.

- ``preparing`` — one stage at a time (environment, model, agent, resources):
  prepare every member of the stage with the stage's deadline. All prepared:
  the next stage (a self-edge, so the next stage's intents are new), or
  ``prepared`` after the last. A member that answers ``preparing`` (deadline
  passed with blockers) or fails: ``aborting``, with the blockers in
  ``blockers`` and the reason in ``detail``. Later stages are never touched.
- ``prepared`` → ``committing``: the environment members commit first without
  a scope (each exports every episode it holds at a boundary); their exported
  episodes, less every restart any member reported, are the scope.
- ``committing``: every other member commits that scope into the same
  directory. All committed: ``committed``; a failure: ``aborting``.
- ``committed`` → ``published``: ``<dir>/<id>/checkpoint.json`` (the members'
  manifests, the scope, the restarts) and then ``<dir>/LATEST`` are written
  atomically and durably.
- ``published`` → ``resuming`` → ``done``; ``aborting`` → ``aborted``: every
  member is resumed in reverse stage order (members never reached too, so
  their late requests are fenced). A resume that fails is recorded and not
  retried forever: the participant's lease resumes it by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from journal import Transition, WriteTx, models, outbox
from journal.writes import Row, to_row
from workers.protocol import CONTROL_PREFIX, EpisodeId

from ..reconciler import Context, Result
from .fanout import describe_error, read_calls, timings
from .retirement import KIND as RETIREMENTS
from .retirement import request_retirement

KIND = "checkpoints"
MEMBERS = "checkpoint_members"
#: Prepare order; resume runs it backwards.
STAGES: tuple[str, ...] = ("environment", "model", "agent", "resources")
#: How long past its deadline a call may take to answer (a participant answers at its deadline).
CALL_MARGIN_S = 2.0


@dataclass(frozen=True)
class CheckpointSettings:
    prepare_timeout_s: float = 30.0
    commit_timeout_s: float = 120.0
    resume_timeout_s: float = 30.0


def member_id(checkpoint_id: str, participant: str) -> str:
    return f"{checkpoint_id}/{participant}"


async def start_checkpoint(tx: WriteTx, checkpoint_id: str, checkpoint_dir: str,
                           participants: Sequence[Row], *, max_tries: int = 3) -> None:
    """Create the checkpoint and one member per participant (healthy rows with a kind)."""
    if not participants:
        raise ValueError("a checkpoint needs at least one healthy participant")
    await tx.create(KIND, checkpoint_id, reason="checkpoint requested",
                    values={"checkpoint_dir": checkpoint_dir, "max_tries": max_tries, "try_number": 1})
    for p in participants:
        await tx.create(MEMBERS, member_id(checkpoint_id, p.id), reason="member of the checkpoint",
                        values={"checkpoint_id": checkpoint_id, "participant": p.id, "kind": p["kind"],
                                "url": p["url"], "stage": STAGES.index(p["kind"])})


class CheckpointController:
    kind = KIND

    def __init__(self, settings: CheckpointSettings | None = None) -> None:
        self.settings = settings or CheckpointSettings()

    # -- reads ----------------------------------------------------------------------------------

    async def _members(self, ctx: Context, checkpoint_id: str) -> list[Row]:
        t = models.checkpoint_members
        async with ctx.journal.read() as conn:
            rows = (await conn.execute(sa.select(t).where(t.c.checkpoint_id == checkpoint_id)
                                       .order_by(t.c.stage, t.c.participant))).all()
        return [to_row(MEMBERS, r._mapping) for r in rows]

    def _intent(self, row: Row, member: Row, op: str, body: dict[str, Any], timeout_s: float) -> outbox.Intent:
        # Prepare and commit are bounded by their phase's deadline: a call that fails is not sent
        # again past it (the checkpoint aborts and a retry runs under a new id). A resume is
        # retried a little; beyond that the participant's lease resumes it.
        return outbox.Intent.for_row(row, target=member["url"], method="POST", path=f"{CONTROL_PREFIX}/{op}",
                                     body=body, timeout_s=timeout_s, max_attempts=3 if op == "resume" else 1)

    async def _fan_out(self, ctx: Context, row: Row, members: list[Row], op: str, body: dict[str, Any],
                       timeout_s: float, moving: tuple[str, str] | None) -> tuple[dict[str, Row], list[Row]]:
        """Ensure one intent per member (and move members ``from -> to``); return member id -> intent,
        and the members as they are now (read after the write: a call may settle in between, and its
        outcome must be recorded on the member's current state and version)."""
        intents = {m.id: self._intent(row, m, op, body, timeout_s) for m in members}
        rows = await read_calls(ctx, [i.id for i in intents.values()])
        # Only what is missing is written: a reconcile of the same step finds its calls made.
        missing = [m for m in members if intents[m.id].id not in rows]
        moves = [m for m in members if moving is not None and m.state == moving[0]]
        if not missing and not moves:
            return ({mid: rows[i.id] for mid, i in intents.items() if i.id in rows}, members)

        async def write(tx: WriteTx) -> None:
            for m in missing:
                await outbox.ensure(tx, intents[m.id], reason=f"{op} {m['participant']} for {row.id}")
            for m in moves:
                assert moving is not None
                await tx.transition(MEMBERS, m.id, from_state=m.state, version=m.version,
                                    to_state=moving[1], reason=f"{op} sent")
        await ctx.write(write)
        fresh = {m.id: m for m in await self._members(ctx, row.id)}
        rows = await read_calls(ctx, [i.id for i in intents.values()])
        return ({mid: rows[i.id] for mid, i in intents.items() if i.id in rows},
                [fresh.get(m.id, m) for m in members])

    def _deadline(self, row: Row, seconds: float) -> float:
        return float(row["deadline_ts"]) if row["deadline_ts"] is not None else time.time() + seconds

    # -- the machine ----------------------------------------------------------------------------

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state in ("done", "aborted", "failed"):
            return Result()
        members = await self._members(ctx, entity_id)
        if row.state == "preparing":
            return await self._preparing(ctx, row, members)
        if row.state == "prepared":
            await self._move(ctx, row, "committing", "prepared everywhere", deadline=self.settings.commit_timeout_s)
            return Result()
        if row.state == "committing":
            return await self._committing(ctx, row, members)
        if row.state == "committed":
            await self._publish(ctx, row, members)
            return Result()
        if row.state == "published":
            await self._move(ctx, row, "resuming", "published", deadline=self.settings.resume_timeout_s)
            return Result()
        return await self._resuming(ctx, row, members)

    async def _move(self, ctx: Context, row: Row, to_state: str, reason: str, *, deadline: float | None = None,
                    **changes: Any) -> None:
        if deadline is not None:
            changes["deadline_ts"] = time.time() + deadline
        changes["timings"] = timings(ctx, row)
        await ctx.apply(Transition(KIND, row.id, row.state, row.version, to_state, reason, changes))

    async def _abort(self, ctx: Context, row: Row, detail: str, **changes: Any) -> Result:
        await self._move(ctx, row, "aborting", detail, deadline=self.settings.resume_timeout_s, detail=detail,
                         **changes)
        return Result()

    async def _preparing(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        if not members:
            await ctx.apply(Transition(KIND, row.id, "preparing", row.version, "failed", "no participants",
                                       {"detail": "the checkpoint has no members"}))
            return Result()
        if row["deadline_ts"] is None:
            if row["retry_of"] is not None:
                waiting = await self._retirement_pending(ctx, retirement_id(row["retry_of"]))
                if waiting is not None:
                    return waiting
            await ctx.apply(Transition(KIND, row.id, "preparing", row.version, "preparing", "stage 0 starts",
                                       {"deadline_ts": time.time() + self.settings.prepare_timeout_s}))
            return Result()
        stage = row["stage"]
        current = [m for m in members if m["stage"] == stage]
        if current:
            deadline = float(row["deadline_ts"])
            body = {"checkpoint_id": row.id, "deadline_ts": deadline}
            intents, current = await self._fan_out(ctx, row, current, "prepare", body,
                                                   max(deadline - time.time(), 0.0) + CALL_MARGIN_S,
                                                   ("pending", "preparing"))
            outcome = await self._record_prepares(ctx, current, intents)
            if outcome is None:
                return Result(requeue_after=max(deadline - time.time(), 0.0) + CALL_MARGIN_S + 1.0)
            why, blockers = outcome
            if why:
                return await self._abort(ctx, row, f"stage {STAGES[stage]} not prepared: {why}", blockers=blockers)
        if stage + 1 < len(STAGES):
            await ctx.apply(Transition(KIND, row.id, "preparing", row.version, "preparing",
                                       f"stage {STAGES[stage + 1]} starts",
                                       {"stage": stage + 1, "deadline_ts": time.time() + self.settings.prepare_timeout_s}))
        else:
            await self._move(ctx, row, "prepared", "every stage prepared")
        return Result()

    async def _retirement_pending(self, ctx: Context, retirement: str) -> Result | None:
        """A straggler retry prepares only once its predecessor's blockers are retired."""
        row = await ctx.get(RETIREMENTS, retirement)
        if row is not None and row.state not in ("done", "failed"):
            return Result(requeue_after=0.25)
        return None

    async def _record_prepares(self, ctx: Context, members: list[Row], intents: dict[str, Row]
                               ) -> tuple[str, dict[str, Any]] | None:
        """Record each settled prepare on its member. ``None`` while a call is open; else why the
        stage is not prepared (``""``: it is) and the blockers by participant."""
        ops: list[Transition] = []
        open_calls = False
        failures: list[str] = []
        blockers: dict[str, Any] = {}
        for m in members:
            intent = intents.get(m.id)
            if intent is None or intent.state not in ("succeeded", "failed", "ambiguous"):
                open_calls = True
                continue
            if intent.state == "succeeded" and (intent["result"] or {}).get("phase") == "prepared":
                state, detail = "prepared", None
            elif intent.state == "succeeded":
                report = (intent["result"] or {}).get("report") or {}
                state, detail = "not_ready", f"{report.get('blocker_count', 0)} blockers"
                blockers[m["participant"]] = report.get("blockers", [])
                failures.append(f"{m['participant']} has {detail}")
            else:
                state, detail = "failed", describe_error(intent)
                failures.append(f"{m['participant']} failed: {detail}")
            if m.state == "preparing":
                ops.append(Transition(MEMBERS, m.id, "preparing", m.version, state, f"prepare answered: {state}",
                                      {"report": (intent["result"] or {}).get("report"), "detail": detail}))
        if ops:
            await ctx.apply(*ops)
        if open_calls:
            return None
        return "; ".join(failures), blockers

    async def _committing(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        deadline = self._deadline(row, self.settings.commit_timeout_s)
        directory = str(Path(row["checkpoint_dir"]) / row.id)
        timeout = max(deadline - time.time(), 0.0) + CALL_MARGIN_S
        envs = [m for m in members if m["kind"] == "environment"]
        others = [m for m in members if m["kind"] != "environment"]
        if row["scope"] is None:
            body = {"checkpoint_id": row.id, "deadline_ts": deadline, "checkpoint_dir": directory}
            intents, envs = await self._fan_out(ctx, row, envs, "commit", body, timeout, ("prepared", "committing"))
            done = await self._record_commits(ctx, envs, intents)
            if done is None:
                return Result(requeue_after=timeout)
            if done:
                return await self._abort(ctx, row, done)
            restarts = sorted({k for m in members for k in ((m["report"] or {}).get("restarts") or [])})
            exported = {k for i in intents.values() for k in (i["result"] or {}).get("episode_ids", [])}
            scope = sorted(exported - set(restarts))
            await ctx.apply(Transition(KIND, row.id, "committing", row.version, "committing",
                                       f"scope of {len(scope)} episodes", {"scope": scope, "restarts": restarts}))
            return Result()
        episodes = [EpisodeId.from_capture_key(k).model_dump() for k in row["scope"]]
        body = {"checkpoint_id": row.id, "deadline_ts": deadline, "checkpoint_dir": directory, "episode_ids": episodes}
        intents, others = await self._fan_out(ctx, row, others, "commit", body, timeout, ("prepared", "committing"))
        done = await self._record_commits(ctx, others, intents)
        if done is None:
            return Result(requeue_after=timeout)
        if done:
            return await self._abort(ctx, row, done)
        await self._move(ctx, row, "committed", "committed everywhere")
        return Result()

    async def _record_commits(self, ctx: Context, members: list[Row], intents: dict[str, Row]) -> str | None:
        ops: list[Transition] = []
        open_calls = False
        failures: list[str] = []
        for m in members:
            intent = intents.get(m.id)
            if intent is None or intent.state not in ("succeeded", "failed", "ambiguous"):
                open_calls = True
                continue
            if intent.state == "succeeded":
                reply = intent["result"] or {}
                if m.state == "committing":
                    ops.append(Transition(MEMBERS, m.id, "committing", m.version, "committed", "commit answered",
                                          {"manifest": reply.get("manifest"), "episode_ids": reply.get("episode_ids")}))
            else:
                detail = describe_error(intent)
                failures.append(f"{m['participant']} did not commit: {detail}")
                if m.state == "committing":
                    ops.append(Transition(MEMBERS, m.id, "committing", m.version, "failed", "commit failed",
                                          {"detail": detail}))
        if ops:
            await ctx.apply(*ops)
        if open_calls:
            return None
        return "; ".join(failures)

    async def _publish(self, ctx: Context, row: Row, members: list[Row]) -> None:
        root = Path(row["checkpoint_dir"])
        manifest = {"checkpoint_id": row.id, "scope": row["scope"], "restarts": row["restarts"],
                    "members": {m["participant"]: {"kind": m["kind"], "manifest": m["manifest"],
                                                   "episode_ids": m["episode_ids"]} for m in members}}
        path = root / row.id / "checkpoint.json"
        await asyncio.to_thread(_write_atomically, path, json.dumps(manifest, indent=1, sort_keys=True).encode())
        await asyncio.to_thread(_write_atomically, root / "LATEST", (row.id + "\n").encode())
        await self._move(ctx, row, "published", "checkpoint manifest and LATEST written", manifest_path=str(path))

    async def _resuming(self, ctx: Context, row: Row, members: list[Row]) -> Result:
        """Resume members in reverse stage order; every member ends ``resumed``."""
        final = "done" if row.state == "resuming" else "aborted"
        deadline = self._deadline(row, self.settings.resume_timeout_s)
        pending = [m for m in members if m.state != "resumed"]
        if not pending:
            blockers = sorted({k for keys in (row["blockers"] or {}).values() for k in keys})
            if final == "aborted" and blockers and row["try_number"] < row["max_tries"]:
                await self._retry(ctx, row, members, blockers)
            else:
                await self._move(ctx, row, final, "every member resumed")
            return Result()
        stage = max(m["stage"] for m in pending)
        current = [m for m in pending if m["stage"] == stage]
        body = {"checkpoint_id": row.id, "deadline_ts": deadline}
        timeout = max(deadline - time.time(), 0.0) + CALL_MARGIN_S
        # Members are moved to ``resuming`` one by one, from wherever they stand.
        moves = [Transition(MEMBERS, m.id, m.state, m.version, "resuming", "resume sent")
                 for m in current if m.state != "resuming"]
        if moves:
            await ctx.apply(*moves)
            # Member rows have no controller of their own: look at this checkpoint again now.
            return Result(requeue_after=0.0)
        intents, current = await self._fan_out(ctx, row, current, "resume", body, timeout, None)
        ops: list[Transition] = []
        for m in current:
            intent = intents.get(m.id)
            if intent is None or intent.state not in ("succeeded", "failed", "ambiguous"):
                continue
            detail = None if intent.state == "succeeded" else (
                f"resume failed ({describe_error(intent)}); its lease resumes it")
            ops.append(Transition(MEMBERS, m.id, "resuming", m.version, "resumed", "resume answered",
                                  {"detail": detail}))
        if ops:
            await ctx.apply(*ops)
            return Result(requeue_after=0.0)  # the next stage, or done
        return Result(requeue_after=timeout)


    async def _retry(self, ctx: Context, row: Row, members: list[Row], blockers: list[str]) -> None:
        """Straggler policy: in one write, end this try, retire its blockers, and start the next try
        under a new id (it prepares once the retirement is done)."""
        next_id = next_try_id(row.id, row["try_number"] + 1)
        episodes = [EpisodeId.from_capture_key(k) for k in blockers]
        changes = {"timings": timings(ctx, row)}

        async def write(tx: WriteTx) -> None:
            await tx.transition(KIND, row.id, from_state=row.state, version=row.version, to_state="aborted",
                                reason=f"every member resumed; retiring {len(blockers)} blockers, retry as {next_id}",
                                changes=changes)
            await request_retirement(tx, retirement_id(row.id), "retire", episodes=episodes)
            await tx.create(KIND, next_id, reason=f"straggler retry {row['try_number'] + 1} of {row.id}",
                            values={"checkpoint_dir": row["checkpoint_dir"], "max_tries": row["max_tries"],
                                    "try_number": row["try_number"] + 1, "retry_of": row.id})
            for m in members:
                await tx.create(MEMBERS, member_id(next_id, m["participant"]), reason="member of the checkpoint",
                                values={"checkpoint_id": next_id, "participant": m["participant"], "kind": m["kind"],
                                        "url": m["url"], "stage": m["stage"]})
        await ctx.write(write)


def retirement_id(checkpoint_id: str) -> str:
    """The retirement that retires a failed try's blockers."""
    return f"stragglers-of-{checkpoint_id}"


def next_try_id(checkpoint_id: str, try_number: int) -> str:
    base = checkpoint_id.rsplit("-try", 1)[0] if "-try" in checkpoint_id else checkpoint_id
    return f"{base}-try{try_number}"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` so it is either the old or the new content, durable when this returns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["MEMBERS", "STAGES", "CheckpointController", "CheckpointSettings", "member_id", "next_try_id",
           "retirement_id", "start_checkpoint"]
