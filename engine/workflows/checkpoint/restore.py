"""The restore workflow: all or nothing into fresh participants.

:func:`resolve_checkpoint` reads a published checkpoint (``LATEST`` and
``<dir>/<id>/checkpoint.json``, as the checkpoint controller writes them);
:func:`start_restore` creates the ``restores`` row in ``restoring``. Then:

- ``restoring``: every ``healthy`` participant gets ``POST restore
  {checkpoint_id, deadline_ts, checkpoint_dir: <dir>/<id>, episode_ids}`` — the
  same body for everyone, ``episode_ids`` the checkpoint's scope (the
  checkpointed attempts; each participant continues attempt N as N + 1). The
  members are fixed by the first look (whoever got a call); while a
  participant row is still ``pending`` (not probed yet), or while the deployment's
  stack is not ready or a participant it serves is not ``healthy``
  (``journal.readiness.participants_held``), the first look waits, up to the
  deadline. Every call settled: all succeeded → ``resuming``; any
  failed (4xx, 5xx, unreachable, timed out) → ``rolling_back`` with the restore
  error in ``detail`` (participant, HTTP status, code, detail).
- ``resuming`` → ``done``: members resumed in reverse stage order (resources,
  agent, model, environment). The write that ends it also moves each
  ``rollouts`` row of a scoped rollout to its next attempt (``dispatched ->
  dispatched`` or ``retired -> dispatched`` with ``attempt`` N + 1). A failed
  resume is noted in ``detail``; the participant's lease resumes it.
  The rows move to ``pending`` (from any of :data:`CONTINUED`) with ``restored_on`` the
  environment whose restore reply named the episode, and the rollout controller sends attempt
  N + 1 there, where it continues from its boundary (docs/rollouts.md).
- ``rolling_back`` → ``failed``: the replacement attempts (N + 1 of every
  scoped episode) are retired on every member in retire order (environment;
  agent; model and resources), then every member is resumed, under a deadline
  of at least ``resume_timeout_s`` from the failure. ``detail`` stays the
  restore error; cleanup failures are only appended to it. The write that ends
  it moves each scoped rollout to ``pending`` as attempt N + 2, unpinned: it
  starts over from its input (N + 1 is retired everywhere, so a retried
  restore could continue nothing).

Calls are outbox intents owned by the row at its state and version (no state
here has a self-edge, so each member gets one call per path per state), so a
reconcile finds the same calls again and a finished call wakes the row.
``timings`` records the seconds spent in each state.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from journal import Transition, WriteTx, models
from journal.machines import RESTORES
from journal.readiness import participants_held
from journal.writes import Row, to_row
from workers.protocol import CONTROL_PREFIX, ID_PATTERN, EpisodeId

from engine.workflows.checkpoint.confined import UnsafeFile, read_file
from engine.runtime.reconciler import BaseController, Context, Result
from engine.workflows.checkpoint.fanout import Member, fan_out, healthy, participant_rows, timings
from engine.workflows.checkpoint.retirement import RETIRE_ORDER

log = logging.getLogger("tidelog.restore")

KIND = "restores"
ROLLOUTS = "rollouts"
#: Rollout states a restore continues from (every state in which the checkpointed attempt is not
#: over for good): the row becomes ``pending`` as the next attempt.
CONTINUED = ("pending", "dispatched", "ambiguous", "errored", "retiring", "retired")
#: Rollout states a restore leaves out of its scope: the rollout ended for good after the checkpoint.
ENDED_FOR_GOOD = ("finished", "failed", "forgotten")
RESTORE_PATH = f"{CONTROL_PREFIX}/restore"
#: Resume order: the prepare order backwards.
RESUME_ORDER: tuple[str, ...] = ("resources", "agent", "model", "environment")


class CheckpointNotFound(ValueError):
    """No usable published checkpoint at ``path`` (missing, unreadable or corrupt); says why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class RestoreSettings:
    restore_timeout_s: float = 120.0
    resume_timeout_s: float = 30.0


#: Largest ``LATEST`` pointer and checkpoint manifest the orchestrator reads (docs/security.md).
LATEST_LIMIT = 4096
MANIFEST_LIMIT = 64 << 20


def _read(root: Path, parts: tuple[str, ...], limit: int, missing: str, what: str) -> bytes:
    path = root.joinpath(*parts)
    try:
        return read_file(str(root), parts, limit)
    except FileNotFoundError:
        raise CheckpointNotFound(path, missing) from None
    except UnsafeFile as exc:
        raise CheckpointNotFound(path, f"refused to read the {what}: {exc.strerror}") from None
    except OSError as exc:
        raise CheckpointNotFound(path, f"cannot read the {what}: {exc.strerror or exc}") from None


def read_latest(checkpoint_dir: str) -> str:
    """The checkpoint id ``<dir>/LATEST`` names (blocking; see :func:`resolve_checkpoint`)."""
    root = Path(checkpoint_dir)
    raw = _read(root, ("LATEST",), LATEST_LIMIT, "no LATEST pointer: no checkpoint was published here",
                "LATEST pointer")
    try:
        checkpoint_id = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointNotFound(root / "LATEST", "the LATEST pointer is not UTF-8 text") from None
    if not re.match(ID_PATTERN, checkpoint_id) or len(checkpoint_id) > 128:
        raise CheckpointNotFound(root / "LATEST", f"does not name a checkpoint: {checkpoint_id[:80]!r}")
    return checkpoint_id


def read_manifest(checkpoint_dir: str, checkpoint_id: str) -> dict[str, Any]:
    """``<dir>/<id>/checkpoint.json``, checked to be a manifest of that checkpoint with a valid scope."""
    root = Path(checkpoint_dir)
    if not re.match(ID_PATTERN, checkpoint_id) or len(checkpoint_id) > 128:
        raise CheckpointNotFound(root / checkpoint_id, "not a valid checkpoint id")
    path = root / checkpoint_id / "checkpoint.json"
    raw = _read(root, (checkpoint_id, "checkpoint.json"), MANIFEST_LIMIT,
                f"checkpoint {checkpoint_id!r} was never published here", "checkpoint manifest")
    try:
        manifest = json.loads(raw)
    except RecursionError:
        raise CheckpointNotFound(path, "the checkpoint manifest is nested too deeply") from None
    except ValueError as exc:
        raise CheckpointNotFound(path, f"the checkpoint manifest is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointNotFound(path, "the checkpoint manifest is not a JSON object")
    if manifest.get("checkpoint_id") != checkpoint_id:
        raise CheckpointNotFound(path, f"the manifest names checkpoint {str(manifest.get('checkpoint_id'))[:80]!r}, "
                                       f"not {checkpoint_id!r}")
    scope = manifest.get("scope")
    if not isinstance(scope, list) or not all(isinstance(k, str) for k in scope):
        raise CheckpointNotFound(path, "the manifest's scope is not a list of capture keys")
    for key in scope:
        try:
            EpisodeId.from_capture_key(key)
        except ValueError:
            raise CheckpointNotFound(path, f"the manifest's scope holds an invalid capture key {key[:80]!r}") from None
    return manifest


def resolve_checkpoint(checkpoint_dir: str, checkpoint_id: str | None = None) -> tuple[str, list[str]]:
    """The checkpoint's id (``<dir>/LATEST`` when ``None``) and scope (capture keys).

    Blocking file reads (run it on :data:`engine.workflows.checkpoint.confined.FILES` from async code, through
    :func:`engine.workflows.checkpoint.confined.run`). Files are read as :func:`engine.workflows.checkpoint.confined.read_file` reads them:
    no symlink below ``checkpoint_dir``, regular files only, at most :data:`LATEST_LIMIT` and
    :data:`MANIFEST_LIMIT` bytes. Raises :class:`CheckpointNotFound` naming the path when
    ``LATEST`` or ``<dir>/<id>/checkpoint.json`` is missing, unreadable, unsafe or corrupt.
    """
    if checkpoint_id is None:
        checkpoint_id = read_latest(checkpoint_dir)
    manifest = read_manifest(checkpoint_dir, checkpoint_id)
    return checkpoint_id, list(manifest["scope"])


async def still_on_their_attempt(tx: WriteTx, scope: list[str]) -> list[str]:
    """The capture keys of ``scope`` whose rollout the journal holds on that very attempt and not
    ended (:data:`CONTINUED`): what a restore after a crash can continue. A rollout that has moved
    past its checkpointed attempt, ended, or is not the journal's is left to its own lineage."""
    wanted: dict[str, list[tuple[str, int]]] = {}
    for key in scope:
        episode = EpisodeId.from_capture_key(key)
        wanted.setdefault(episode.rollout_id, []).append((key, episode.attempt))
    t = models.rollouts
    ids = sorted(wanted)
    kept: list[str] = []
    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite's variable limit)
        for rid, attempt in (await tx.execute(sa.select(t.c.id, t.c.attempt).where(
                t.c.id.in_(ids[i:i + 500]), t.c.state.in_(CONTINUED)))).all():
            kept += [key for key, captured in wanted[rid] if captured == attempt]
    return sorted(kept)


async def start_restore(tx: WriteTx, restore_id: str, checkpoint_dir: str, checkpoint_id: str,
                        scope: list[str], *, deadline_ts: float | None = None, reason: str | None = None) -> None:
    """Create the ``restores`` row in ``restoring``: restore ``checkpoint_id`` (published under
    ``checkpoint_dir``) for the episodes ``scope`` names. Without ``deadline_ts`` the restore's
    deadline is its creation plus ``restore_timeout_s``. Raises ``ValueError`` for an invalid
    capture key in ``scope``.

    A scoped rollout the journal holds as ended for good (``finished``, ``failed``, ``forgotten``:
    its reply came in after the checkpoint) is left out: nothing of it is continued, and no
    participant is left holding a retire mark that no forget would clear."""
    wanted = {EpisodeId.from_capture_key(key).rollout_id: key for key in scope}
    t = models.rollouts
    ids = sorted(wanted)
    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite's variable limit)
        ended = (await tx.execute(sa.select(t.c.id).where(t.c.id.in_(ids[i:i + 500]),
                                                          t.c.state.in_(ENDED_FOR_GOOD)))).scalars()
        for rid in ended:
            wanted.pop(rid, None)
    scope = list(wanted.values())
    await tx.create(KIND, restore_id, reason=reason or f"restore of checkpoint {checkpoint_id} requested",
                    values={"checkpoint_id": checkpoint_id, "checkpoint_dir": checkpoint_dir,
                            "scope": sorted(set(scope)), "deadline_ts": deadline_ts})


def _episodes(row: Row, *, next_attempt: bool = False) -> list[dict[str, Any]]:
    out = []
    for key in row["scope"]:
        e = EpisodeId.from_capture_key(key)
        out.append((e.next_attempt() if next_attempt else e).model_dump())
    return out


class RestoreController(BaseController):
    """Runs ``restores`` rows (see the module docstring)."""

    kind = KIND

    def __init__(self, settings: RestoreSettings | None = None) -> None:
        self.settings = settings or RestoreSettings()
        #: Per restore waiting for the deployment: the reason last logged (logged once per reason).
        self._waiting: dict[str, str] = {}

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state in RESTORES.terminal:
            return Result()
        if row.state == "restoring":
            return await self._restoring(ctx, row)
        return await self._finishing(ctx, row)

    async def _members(self, ctx: Context, row: Row) -> list[Member]:
        """Whoever got a restore call, as the participants table names them (by URL)."""
        t = models.rpc_calls
        async with ctx.journal.read() as conn:
            targets = set((await conn.execute(sa.select(t.c.target).where(
                t.c.entity_kind == KIND, t.c.entity_id == row.id, t.c.path == RESTORE_PATH))).scalars())
        by_url: dict[str, Member] = {}
        for p in await participant_rows(ctx):
            if p["url"] in targets and p["kind"] and (p["url"] not in by_url or p.state != "removed"):
                by_url[p["url"]] = Member(p.id, p["kind"], p["url"])
        # A target no row names any more: still resumed (and retired) last, as a callee.
        return [by_url.get(u, Member(u, "resources", u)) for u in sorted(targets)]

    def _deadline(self, row: Row, seconds: float) -> float:
        if row["deadline_ts"] is not None:
            return float(row["deadline_ts"])
        return float(row["updated_at"].timestamp()) + seconds

    async def _move(self, ctx: Context, row: Row, to_state: str, reason: str, *extra: Transition,
                    **changes: Any) -> None:
        changes["timings"] = timings(ctx, row)
        await ctx.apply(Transition(KIND, row.id, row.state, row.version, to_state, reason[:300], changes), *extra)

    async def _restoring(self, ctx: Context, row: Row) -> Result:
        deadline = self._deadline(row, self.settings.restore_timeout_s)
        members = await self._members(ctx, row)
        if not members:
            # The first look fixes the members: not while the deployment's stack is starting or being
            # rebuilt (its participants are down or just back, and their rows say what the probes saw
            # meanwhile); up to the deadline, after which whoever is healthy is restored into.
            async with ctx.journal.read() as conn:
                held = await participants_held(conn)
            if held is not None and ctx.clock.time() < deadline:
                if self._waiting.get(row.id) != held:
                    self._waiting[row.id] = held
                    log.info("restore %s waits: %s", row.id, held)
                return Result(requeue_after=0.5)
            self._waiting.pop(row.id, None)
            rows = await participant_rows(ctx)
            if any(r.state == "pending" for r in rows) and ctx.clock.time() < deadline:
                return Result(requeue_after=0.5)  # discovery has not probed every participant yet
            members = healthy(rows)
            if not members:
                detail = "restore failed: no healthy participant to restore into"
                await self._move(ctx, row, "rolling_back", detail, detail=detail,
                                 deadline_ts=ctx.clock.time() + self.settings.resume_timeout_s)
                return Result()
        directory = str(Path(row["checkpoint_dir"]) / row["checkpoint_id"])
        body = {"checkpoint_id": row["checkpoint_id"], "deadline_ts": deadline, "checkpoint_dir": directory,
                "episode_ids": _episodes(row)}
        outcome = await fan_out(ctx, row, members, "restore", body, deadline)
        if outcome.open:
            return Result(requeue_after=max(deadline - ctx.clock.time(), 0.0) + 6.0)
        if outcome.failures:
            detail = f"restore failed on {len(outcome.failures)} participant(s): " + "; ".join(outcome.failures)
            cleanup = max(deadline, ctx.clock.time() + self.settings.resume_timeout_s)
            await self._move(ctx, row, "rolling_back", detail, detail=detail, deadline_ts=cleanup)
            return Result()
        await self._move(ctx, row, "resuming", f"restored on {len(members)} participant(s)",
                         deadline_ts=ctx.clock.time() + self.settings.resume_timeout_s)
        return Result()

    async def _finishing(self, ctx: Context, row: Row) -> Result:
        """``resuming`` or ``rolling_back``: run the groups of calls in order, then end the restore."""
        rollback = row.state == "rolling_back"
        deadline = self._deadline(row, self.settings.resume_timeout_s)
        members = await self._members(ctx, row)
        base = {"checkpoint_id": row["checkpoint_id"], "deadline_ts": deadline}
        steps: list[tuple[str, list[Member], dict[str, Any]]] = []
        if rollback and row["scope"]:
            retire = {**base, "episode_ids": _episodes(row, next_attempt=True)}
            steps += [("retire", [m for m in members if m.kind in kinds], retire) for kinds in RETIRE_ORDER]
        known = set(RESUME_ORDER)
        steps += [("resume", [m for m in members if m.kind == kind or (kind == "resources" and m.kind not in known)],
                   base) for kind in RESUME_ORDER]
        cleanup: list[str] = []
        for op, group, body in steps:
            if not group:
                continue
            outcome = await fan_out(ctx, row, group, op, body, deadline)
            if outcome.open:
                return Result(requeue_after=max(deadline - ctx.clock.time(), 0.0) + 6.0)
            cleanup += [f"{op} {f}" for f in outcome.failures]
        if rollback:
            detail = row["detail"] or "restore failed"
            if cleanup:
                detail += f" [cleanup failures: {'; '.join(cleanup)}]"
            await self._move(ctx, row, "failed", "rolled back: replacement attempts retired, everyone resumed",
                             *await self._next_attempts(ctx, row, start_over=True), detail=detail)
            return Result()
        note = f"resumed with failures (their leases resume them): {'; '.join(cleanup)}" if cleanup else None
        await self._move(ctx, row, "done", "every participant restored and resumed", *await self._next_attempts(
            ctx, row), detail=note)
        return Result()

    async def _restored_on(self, ctx: Context, row: Row) -> dict[str, str]:
        """Rollout id -> the environment server whose restore reply named it (its boundary is there)."""
        t = models.rpc_calls
        async with ctx.journal.read() as conn:
            calls = (await conn.execute(sa.select(t.c.target, t.c.result).where(
                t.c.entity_kind == KIND, t.c.entity_id == row.id, t.c.path == RESTORE_PATH,
                t.c.state == "succeeded"))).all()
        environments = {p["url"]: p.id for p in await participant_rows(ctx) if p["kind"] == "environment"}
        out: dict[str, str] = {}
        for call in calls:
            name = environments.get(call.target)
            restored = (call.result or {}).get("restored") if isinstance(call.result, dict) else None
            if name is None or not isinstance(restored, list):
                continue
            for key in restored:
                try:
                    out[EpisodeId.from_capture_key(str(key)).rollout_id] = name
                except ValueError:
                    log.warning("restore %s: %s answered an invalid capture key %r", row.id, name, key)
        return out

    async def _next_attempts(self, ctx: Context, row: Row, *, start_over: bool = False) -> list[Transition]:
        """Each rollout row of a scoped rollout moved to ``pending`` as the attempt the restore
        continues, sent (by the rollout controller) to the environment that restored it.

        ``start_over`` (the restore failed and was rolled back): as attempt N + 2 instead, to any
        environment, run again from its input, since attempt N + 1 is now retired everywhere."""
        step = 2 if start_over else 1
        wanted = {e["rollout_id"]: e["attempt"] + step - 1 for e in _episodes(row, next_attempt=True)}
        if not wanted:
            return []
        pinned = {} if start_over else await self._restored_on(ctx, row)
        t = models.rollouts
        async with ctx.journal.read() as conn:
            found = (await conn.execute(sa.select(t).where(t.c.id.in_(sorted(wanted))))).all()
        ops = []
        for r in (to_row(ROLLOUTS, f._mapping) for f in found):
            attempt = wanted[r.id]
            if r["attempt"] >= attempt:
                continue  # already there
            if r.state not in CONTINUED:
                log.warning("rollout %s is %s; restore %s leaves it as it is", r.id, r.state, row.id)
                continue
            if start_over:
                reason = (f"restore {row.id} of {row['checkpoint_id']} failed: started over from its input "
                          f"as attempt {attempt}")
                changes = {"attempt": attempt, "run_call": None, "restored_on": None, "environment": None,
                           "detail": reason}
            else:
                reason = (f"restored from {row['checkpoint_id']} as attempt {attempt} on "
                          f"{pinned.get(r.id, 'any environment')} ({row.id})")
                changes = {"attempt": attempt, "checkpoint_id": row["checkpoint_id"], "run_call": None,
                           "restored_on": pinned.get(r.id), "environment": None}
            ops.append(Transition(ROLLOUTS, r.id, r.state, r.version, "pending", reason[:300], changes))
        return ops


__all__ = ["LATEST_LIMIT", "MANIFEST_LIMIT", "RESUME_ORDER", "CheckpointNotFound", "read_latest", "read_manifest", "RestoreController", "RestoreSettings", "resolve_checkpoint",
           "start_restore", "still_on_their_attempt"]
