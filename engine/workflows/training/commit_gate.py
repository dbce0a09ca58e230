"""The commit gate: what makes a ``READY_TO_COMMIT`` candidate the deployment's head, or rejects it.

The publisher asks :meth:`CommitGate.decide` each time it finds a job ``READY_TO_COMMIT`` (every
engine verified on the candidate, still paused). ``training.commit`` says who decides:

- ``auto``: nobody waits; the verdict is ``commit`` by ``auto``.
- ``acknowledge``: the candidate waits for an operator. ``acknowledge_job`` (``POST
  /v1/jobs/{id}/acknowledge``, ``tidelog jobs acknowledge``) records the operator's verdict on the
  job (a ``READY_TO_COMMIT`` self-transition: the durable scenario commit of the seed), and the next
  look commits it; ``reject_job`` moves it to ``REJECTING`` instead. Nothing else commits it, so an
  operator's reject never races the controller. With ``acknowledge_timeout_s``, a candidate still
  waiting that long after ``ready_at`` is rejected by ``timeout`` (``on_acknowledge_timeout:
  reject``) or keeps waiting with the overrun said once in ``detail`` (``hold``). ``ready_at`` is a
  column, so the wait counts across restarts; it is measured on the orchestrator's clock.
- ``evaluate``: the configured evaluator is given the candidate and the incumbent (their
  checkpoints, weights and load ids) and returns ``commit`` or ``reject`` with a reason and metrics.
  It runs on a thread of its own (one evaluation at a time: a look while one still runs waits for
  it), and a reply later than ``timeout_s`` counts as a failure; a failure or a malformed reply is
  said in ``detail`` and it is asked again after ``retry_after_s``. The publisher's lock (and so the
  engine gate) is held while the gate waits for that reply, at most ``timeout_s``. A crash before its verdict is
  written asks it again, so an evaluator must give the same verdict for the same pair (or at least
  one that is acceptable either way).

An operator's recorded verdict wins in every mode. Apart from the acknowledgement, a verdict is
written in the same transaction as the move it causes (``HEAD_COMMITTED`` or ``REJECTING``).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from journal.writes import Row
from workers.executor import import_object

from engine.runtime.reconciler import Context

Mode = Literal["auto", "acknowledge", "evaluate"]
MODES: tuple[str, ...] = ("auto", "acknowledge", "evaluate")
DECISIONS: tuple[str, ...] = ("commit", "reject")


class EvaluatorReplyError(ValueError):
    """The evaluator's reply breaks its contract: ``field`` held ``value``, breaking ``rule``."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        shown = repr(value)
        super().__init__(f"evaluator reply {field}: {shown[:80]} {rule}")
        self.field, self.value, self.rule = field, value, rule


class Evaluator:
    """A user's evaluator named by import path: a function ``fn(candidate, incumbent, **kwargs)``, or a
    class built once as ``Class(**kwargs)`` whose ``evaluate(candidate, incumbent)`` is called. Both get
    plain dicts (see :meth:`CommitGate.evaluate`) and return ``{"decision": "commit"|"reject",
    "reason": str, "metrics": {...}?}``."""

    def __init__(self, path: str, kwargs: Mapping[str, Any] | None = None, *,
                 loader: Callable[[str], Any] | None = None) -> None:
        self.path = path
        self.kwargs = dict(kwargs or {})
        self._loader = loader
        self._call: Callable[[dict[str, Any], dict[str, Any] | None], Any] | None = None
        # One thread of its own: a hung evaluation cannot take the threads trainer calls run on,
        # and at most one runs (a thread cannot be stopped when its reply is late).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidelog-evaluator")
        self._running: tuple[tuple[Any, Any], Future[dict[str, Any]]] | None = None

    def _resolve(self) -> Callable[[dict[str, Any], dict[str, Any] | None], Any]:
        if self._call is None:
            load = self._loader or functools.partial(import_object, field="training.evaluator.callable")
            target = load(self.path)
            if isinstance(target, type):
                self._call = target(**self.kwargs).evaluate
            elif callable(target):
                self._call = functools.partial(target, **self.kwargs)
            else:
                raise TypeError(f"training.evaluator.callable {self.path!r} is neither a function nor a class")
        return self._call

    def __call__(self, candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> dict[str, Any]:
        return check_reply(self._resolve()(candidate, incumbent))

    async def evaluate(self, candidate: dict[str, Any], incumbent: dict[str, Any] | None,
                       timeout: float) -> dict[str, Any]:
        """The checked reply, from this evaluator's own thread. An evaluation still running from an
        earlier look, or ended since without its reply taken, is waited for (its reply is for the
        same candidate: one job is in flight per deployment) rather than started again. A reply later than ``timeout`` raises ``TimeoutError``;
        one still running for another candidate raises ``RuntimeError`` (asked again later)."""
        key = (candidate.get("job_id"), candidate.get("load_id"))
        if self._running is not None and self._running[1].done() and self._running[0] != key:
            self._running = None  # an earlier candidate's, ended: nobody waits for it any more
        if self._running is None:
            self._running = (key, self._pool.submit(self, candidate, incumbent))
        elif self._running[0] != key:
            raise RuntimeError(f"the evaluation of an earlier candidate (job {str(self._running[0][0])[:12]}) is "
                               f"still running; this one waits for its thread")
        running = self._running[1]
        try:
            reply = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(running)), timeout)
        except TimeoutError:
            # Kept, even if it ended just now: the next look takes its reply instead of asking again
            # (a reply that came in between the timeout and this line was lost, and asked twice).
            raise TimeoutError(f"the evaluator did not reply within {timeout:g} s (still running; the next "
                               f"look waits for it)") from None
        except BaseException:
            if running.done():
                self._running = None  # the evaluation itself failed: asked again later
            raise
        self._running = None  # its reply is taken
        return reply


def check_reply(reply: Any) -> dict[str, Any]:
    """The evaluator's reply as a verdict's fields, or :class:`EvaluatorReplyError` naming what is wrong."""
    if not isinstance(reply, Mapping):
        raise EvaluatorReplyError("(reply)", reply, "must be a mapping with decision and reason")
    unknown = sorted(set(reply) - {"decision", "reason", "metrics"})
    if unknown:
        raise EvaluatorReplyError(unknown[0], reply[unknown[0]], "is not a field of a verdict (decision, reason, "
                                                                 "metrics)")
    decision, reason, metrics = reply.get("decision"), reply.get("reason"), reply.get("metrics", {})
    if decision not in DECISIONS:
        raise EvaluatorReplyError("decision", decision, "must be 'commit' or 'reject'")
    if not isinstance(reason, str) or not reason.strip():
        raise EvaluatorReplyError("reason", reason, "must be a non-empty string saying why")
    if not isinstance(metrics, Mapping):
        raise EvaluatorReplyError("metrics", metrics, "must be a mapping")
    # Recorded on the job: JSON that reads back as written. orjson would write NaN and infinities as
    # null, so they are refused first.
    if any(not math.isfinite(v) for v in _floats(dict(metrics))):
        raise EvaluatorReplyError("metrics", metrics, "must hold finite numbers only")
    try:
        metrics = orjson.loads(orjson.dumps(dict(metrics)))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise EvaluatorReplyError("metrics", metrics, f"must be plain JSON ({exc})") from None
    return {"decision": decision, "reason": reason[:500], "metrics": metrics}


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, Mapping):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list | tuple):
        return [f for v in value for f in _floats(v)]
    return []


@dataclass(frozen=True)
class CommitGateSettings:
    mode: str = "auto"
    #: None: an acknowledgement is waited for without end.
    acknowledge_timeout_s: float | None = None
    on_acknowledge_timeout: str = "reject"
    evaluator: Evaluator | None = field(default=None, compare=False)
    evaluate_timeout_s: float = 600.0
    #: How soon a failed evaluation is tried again.
    retry_after_s: float = 5.0


@dataclass(frozen=True)
class Wait:
    """No verdict yet: look again after ``after`` seconds (None: only when woken); ``say`` goes in ``detail``."""

    after: float | None
    say: str | None = None


class CommitGate:
    """Decides a ``READY_TO_COMMIT`` candidate's verdict (see the module docs)."""

    def __init__(self, settings: CommitGateSettings) -> None:
        if settings.mode not in MODES:
            raise ValueError(f"commit mode {settings.mode!r}: must be one of {', '.join(MODES)}")
        if settings.mode == "evaluate" and settings.evaluator is None:
            raise ValueError("commit mode 'evaluate' needs an evaluator")
        self.settings = settings

    async def decide(self, ctx: Context, row: Row,
                     describe: Callable[[], Awaitable[tuple[dict[str, Any], dict[str, Any] | None]]]
                     ) -> dict[str, Any] | Wait:
        """The verdict on ``row`` (with ``by`` and ``at``), or how long to wait for one. ``describe``
        gives the candidate and the incumbent as an evaluator is told them; it is awaited only when an
        evaluator is asked (its reads are not paid by the other modes)."""
        recorded = row["verdict"]
        if recorded is not None:
            return dict(recorded)  # an operator's acknowledgement, recorded earlier
        now = ctx.clock.now()
        mode = self.settings.mode
        if mode == "auto":
            return {"decision": "commit", "by": "auto", "reason": "commit: auto", "metrics": {}, "at": now.isoformat()}
        if mode == "acknowledge":
            return self._acknowledgement(row, now)
        try:
            reply = await self.evaluate(*await describe())
        except Exception as exc:  # noqa: BLE001 - said in detail, asked again later
            return Wait(self.settings.retry_after_s,
                        f"the evaluator failed ({type(exc).__name__}: {exc}); asking it again")
        return {**reply, "by": "evaluator", "at": ctx.clock.now().isoformat()}

    async def evaluate(self, candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> dict[str, Any]:
        """The evaluator's checked reply, in a thread, bounded by ``evaluate_timeout_s``."""
        evaluator = self.settings.evaluator
        assert evaluator is not None  # the constructor refuses 'evaluate' without one
        return await evaluator.evaluate(candidate, incumbent, self.settings.evaluate_timeout_s)

    def _acknowledgement(self, row: Row, now: Any) -> dict[str, Any] | Wait:
        limit = self.settings.acknowledge_timeout_s
        if limit is None:
            return Wait(None)  # the acknowledgement (or a reject) wakes the job
        since = row["ready_at"] or row["updated_at"]
        waited = (now - since).total_seconds()
        if waited < limit:
            return Wait(limit - waited)
        # The same words at every look: the hold is said once (a detail that changes is written again).
        why = f"no acknowledgement within acknowledge_timeout_s={limit:g} of ready_at {since.isoformat()}"
        if self.settings.on_acknowledge_timeout == "reject":
            return {"decision": "reject", "by": "timeout", "reason": why, "metrics": {}, "at": now.isoformat()}
        return Wait(None, f"{why}; held for an operator (on_acknowledge_timeout: hold)")


def candidate_info(row: Row, weights_path: str) -> dict[str, Any]:
    """What an evaluator is told about the candidate."""
    return {"job_id": row.id, "load_id": row["runtime_load_id"], "checkpoint_path": row["checkpoint_path"],
            "weights_path": weights_path, "metrics": row["metrics"]}


def incumbent_info(head: Row | None, job: Row | None) -> dict[str, Any] | None:
    """What an evaluator is told about the committed head (None before the first publication; a
    ``job_id`` and ``checkpoint_path`` of None for the weights the engines started with)."""
    if head is None:
        return None
    return {"job_id": head["job_id"], "load_id": head.id, "weights_path": head["weights_path"],
            "checkpoint_path": None if job is None else job["checkpoint_path"]}


__all__ = ["DECISIONS", "MODES", "CommitGate", "CommitGateSettings", "Evaluator", "EvaluatorReplyError", "Wait",
           "candidate_info", "check_reply", "incumbent_info"]
