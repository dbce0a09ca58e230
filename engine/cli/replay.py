"""``tidelog replay``: from the event log alone, what was in flight when the leader died, and what
the next leader did about each entity after it came back.

The lease log (``entity_kind = 'leases'``) records every election: ``held`` with the holder and
the epoch in ``payload.note`` (a take-over after a lapse also names the previous holder and epoch
and when its lease expired), and ``released`` when a leader stepped down gracefully. Every fenced
write carries its writer's epoch in ``events.epoch``. So, for the last take-over (or the one into
``epoch``):

1. the previous epoch ended either ``released`` (a graceful stop) or ``lapsed`` (no release: its
   lease ran out — the process died, hung or lost the journal);
2. its last event is the last one with ``epoch`` = the previous epoch (``cutoff``);
3. the entities in flight then are those whose last event at or before the cutoff left them in a
   non-terminal state of their machine;
4. for each, the events the new epoch wrote for it, and its state now (its last event).

Nothing but ``events`` is read; the rows are not consulted (``tidelog verify`` checks that they
agree with the events).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from journal import Journal, models

from engine.runtime.leader import LEASE_NAME

CHUNK = 500


@dataclass(frozen=True)
class Step:
    seq: int
    ts: datetime
    epoch: int | None
    from_state: str | None
    to_state: str
    reason: str
    actor: str


@dataclass
class InFlight:
    """One entity that was non-terminal at the previous epoch's last event."""

    kind: str
    entity_id: str
    state: str
    version: int
    since: Step
    after: list[Step] = field(default_factory=list)
    current_state: str = ""
    current_seq: int = 0
    terminal_now: bool = False


@dataclass
class Handover:
    lease: str
    previous_epoch: int
    previous_holder: str | None
    new_epoch: int
    new_holder: str
    taken_over: Step
    ended: str  # "released" or "lapsed"
    previous_expired_at: str | None
    cutoff_seq: int
    cutoff_ts: datetime | None


@dataclass
class Replay:
    handover: Handover | None
    entities: list[InFlight] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    unknown_kinds: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        def conv(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, dict):
                return {k: conv(v) for k, v in value.items()}
            if isinstance(value, list):
                return [conv(v) for v in value]
            return value
        return {"handover": None if self.handover is None else conv(asdict(self.handover)),
                "in_flight": [conv(asdict(e)) for e in self.entities], "epochs": conv(self.epochs),
                "unknown_kinds": self.unknown_kinds, "note": self.note}


def _step(r: Any) -> Step:
    return Step(r.seq, r.ts, r.epoch, r.from_state, r.to_state, r.reason, r.actor)


def _note(r: Any) -> dict[str, Any]:
    return dict((r.payload or {}).get("note") or {})


async def replay(journal: Journal, *, epoch: int | None = None, kind: str | None = None,
                 lease_name: str = LEASE_NAME) -> Replay:
    """The last take-over of ``lease_name`` (or the one into ``epoch``) and what it found in flight."""
    e = models.events
    async with journal.read(snapshot=True) as conn:
        leases = (await conn.execute(sa.select(e).where(e.c.entity_kind == "leases", e.c.entity_id == lease_name)
                                     .order_by(e.c.seq))).all()
        held = [r for r in leases if r.to_state == "held" and isinstance(_note(r).get("epoch"), int)]
        released = {_note(r).get("epoch"): r for r in leases if r.to_state == "released"}
        epochs = [{"epoch": _note(r)["epoch"], "holder": _note(r).get("holder"), "acquired_at": r.ts,
                   "seq": r.seq, "released_at": released[_note(r)["epoch"]].ts if _note(r)["epoch"] in released
                   else None} for r in held]
        takeovers = [r for r in held if _note(r)["epoch"] > 1]
        if epoch is not None:
            takeovers = [r for r in takeovers if _note(r)["epoch"] == epoch]
            if not takeovers:
                known = ", ".join(str(x["epoch"]) for x in epochs[1:]) or "none"
                raise ValueError(f"--epoch {epoch}: no take-over into this epoch in the lease log "
                                 f"(take-overs into: {known})")
        if not takeovers:
            return Replay(None, epochs=epochs, note="no leadership change in the journal: "
                          + (f"epoch {epochs[-1]['epoch']} is the only one" if epochs else "no leader ever held it"))
        take = takeovers[-1]
        note = _note(take)
        new_epoch = int(note["epoch"])
        prev = int(note.get("previous_epoch", new_epoch - 1))
        prev_holder = note.get("previous_holder") or next(
            (x["holder"] for x in epochs if x["epoch"] == prev), None)
        last = (await conn.execute(sa.select(e.c.seq, e.c.ts).where(e.c.epoch == prev, e.c.seq < take.seq)
                                   .order_by(e.c.seq.desc()).limit(1))).first()
        if last is not None:
            cutoff, cutoff_ts = int(last.seq), last.ts
        else:  # the previous leader wrote nothing fenced: what stood when it was elected
            began = next((x for x in epochs if x["epoch"] == prev), None)
            cutoff, cutoff_ts = (int(began["seq"]), began["acquired_at"]) if began else (take.seq - 1, None)
        handover = Handover(lease_name, prev, prev_holder, new_epoch, str(note.get("holder")), _step(take),
                            "released" if prev in released else "lapsed", note.get("previous_expired_at"),
                            cutoff, cutoff_ts)

        # The last event of every entity at the cutoff that left it in a non-terminal state.
        kinds = {k.name: k for k in journal.kinds}
        if kind is not None and kind not in kinds:
            raise ValueError(f"--kind {kind!r}: not an entity kind (known: {', '.join(kinds)})")
        wanted = [kind] if kind is not None else list(kinds)
        latest = (sa.select(e.c.entity_kind, e.c.entity_id, sa.func.max(e.c.seq).label("m"))
                  .where(e.c.seq <= cutoff, e.c.entity_kind != "leases")
                  .group_by(e.c.entity_kind, e.c.entity_id).subquery())
        unknown = Counter((await conn.execute(sa.select(latest.c.entity_kind).where(
            latest.c.entity_kind.not_in(list(kinds))))).scalars())
        live = sa.or_(*(sa.and_(e.c.entity_kind == k, e.c.to_state.in_(sorted(kinds[k].machine.active)))
                        for k in wanted))
        rows = (await conn.execute(sa.select(e).join(latest, e.c.seq == latest.c.m).where(live))).all()
        found = {(r.entity_kind, r.entity_id): InFlight(r.entity_kind, r.entity_id, r.to_state, r.version, _step(r),
                                                        current_state=r.to_state, current_seq=r.seq)
                 for r in rows}

        # What happened to each afterwards.
        by_kind: dict[str, list[str]] = {}
        for k, i in found:
            by_kind.setdefault(k, []).append(i)
        for k, ids in by_kind.items():
            for n in range(0, len(ids), CHUNK):
                later = (await conn.execute(sa.select(e).where(
                    e.c.entity_kind == k, e.c.entity_id.in_(ids[n:n + CHUNK]), e.c.seq > cutoff)
                    .order_by(e.c.seq))).all()
                for r in later:
                    item = found[(k, r.entity_id)]
                    if r.epoch == new_epoch:
                        item.after.append(_step(r))
                    item.current_state, item.current_seq = r.to_state, r.seq
    for item in found.values():
        item.terminal_now = item.current_state in kinds[item.kind].machine.terminal
    entities = sorted(found.values(), key=lambda x: (wanted.index(x.kind), x.entity_id))
    return Replay(handover, entities, epochs, dict(unknown))


def render(report: Replay) -> str:
    """The replay as text: the handover, then every entity in flight with what the new leader did."""
    h = report.handover
    if h is None:
        return report.note
    lines = [f"leadership  epoch {h.previous_epoch} ({h.previous_holder}) -> epoch {h.new_epoch} ({h.new_holder}), "
             f"taken over at {h.taken_over.ts.isoformat()} (event #{h.taken_over.seq})"]
    if h.ended == "released":
        lines.append(f"epoch {h.previous_epoch}  released the lease (a graceful stop)")
    else:
        expired = f" at {h.previous_expired_at}" if h.previous_expired_at else ""
        lines.append(f"epoch {h.previous_epoch}  died: its lease lapsed{expired} with no release "
                     f"(the process was killed, hung or lost the journal)")
    when = h.cutoff_ts.isoformat() if h.cutoff_ts else "-"
    lines.append(f"last event  #{h.cutoff_seq} at {when}")
    counts = Counter(x.kind for x in report.entities)
    lines.append(f"in flight   {len(report.entities)} entit{'y' if len(report.entities) == 1 else 'ies'}"
                 + (f" ({', '.join(f'{k} {n}' for k, n in counts.items())})" if counts else ""))
    if report.unknown_kinds:
        lines.append(f"not judged  kinds without a machine here: "
                     f"{', '.join(f'{k} {n}' for k, n in sorted(report.unknown_kinds.items()))}")
    base = h.taken_over.ts
    for x in report.entities:
        end = (f"  ->  now {x.current_state}" if x.after
               else f"  ->  epoch {h.new_epoch} wrote nothing for it; now {x.current_state}")
        lines.append("")
        lines.append(f"{x.kind}:{x.entity_id}  was {x.state} (v{x.version}, since #{x.since.seq}: {x.since.reason})"
                     f"{end}")
        for s in x.after:
            offset = (s.ts - base).total_seconds()
            edge = f"{s.from_state or '*'} -> {s.to_state}"
            lines.append(f"    {offset:+8.3f}s  #{s.seq:<7} {edge:<28} {s.reason}")
    return "\n".join(lines)


__all__ = ["Handover", "InFlight", "Replay", "Step", "render", "replay"]
