"""Which finished rollouts a batch may train on, and what each becomes in the job's payload.

Pure functions, no journal: :class:`BatchRules` decides for one finished rollout whether it joins a
batch or is excluded (and why), in this order:

1. ``labels``: every configured label must be on the rollout with the same value (evaluation
   rollouts, say, carry a label that keeps them out of training);
2. ``reward_key``: the result must be a JSON object holding a finite number under that key (``null``:
   no reward needed);
3. ``max_staleness``: the rollout's ``weight_version`` (the committed head when its attempt was sent)
   must be at most that many publications behind the head the job will train from. A rollout without
   a recorded version, or one of another incarnation of the deployment's weights, is excluded too
   (``null``: no bound);
4. the sample function (``training.batching.sample``): it maps the rollout to the job's sample; if it
   raises, or returns what canonical JSON cannot hold, the rollout is excluded with its words.

The default sample, :func:`rollout_sample`, is the rollout as recorded (id, weight version, input,
result, labels); a trainer reads what it needs from it. ``workers.reference.samples:episode`` is the
reference task's (prompt, completion, reward), which the reference trainer takes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.executor import import_object

from engine.workflows.training.identity import LoadId, LoadIdError, TrainingPayloadError, canonical

#: What a sample function is given: the rollout's recorded columns.
Rollout = Mapping[str, Any]
SampleFn = Callable[[Rollout], Mapping[str, Any]]


def rollout_sample(rollout: Rollout) -> dict[str, Any]:
    """The default sample: the rollout as the journal holds it."""
    return {"rollout_id": rollout["id"], "weight_version": rollout["weight_version"], "input": rollout["task"],
            "result": rollout["result"], "labels": rollout["labels"]}


def load_sample(path: str, kwargs: Mapping[str, Any]) -> SampleFn:
    """The sample function ``package.module:name`` with its keyword arguments bound."""
    fn = import_object(path, field="training.batching.sample")
    if not callable(fn):
        raise TypeError(f"training.batching.sample {path!r} is not callable")
    bound = dict(kwargs)
    return (lambda rollout: fn(rollout, **bound)) if bound else fn


def staleness(head: str, ran_on: str | None, committed: Sequence[int] | None = None) -> tuple[int | None, str | None]:
    """How many publications ``ran_on`` is behind ``head``: ``(n, None)``, or ``(None, why)`` when it
    cannot be said (no version recorded, another incarnation, not a runtime load id). ``committed``:
    the committed sequences of the head's incarnation; only those count (a rejected candidate used a
    sequence number without being published). Without it, every sequence counts."""
    if ran_on is None:
        return None, "its attempt recorded no weight version"
    try:
        h, r = LoadId.parse(head), LoadId.parse(ran_on)
    except LoadIdError as exc:
        return None, f"weight version {ran_on!r} is not comparable with the head ({exc.rule})"
    if h.incarnation != r.incarnation:
        return None, f"it ran on {ran_on}, of another incarnation than the head {head}"
    if committed is None:
        return h.sequence - r.sequence, None
    return bisect.bisect_right(committed, h.sequence) - bisect.bisect_right(committed, r.sequence), None


@dataclass(frozen=True)
class BatchRules:
    """The ``training.batching`` rules for one rollout (see the module docs)."""

    reward_key: str | None = "reward"
    labels: Mapping[str, Any] = field(default_factory=dict)
    max_staleness: int | None = 1
    sample: SampleFn = rollout_sample

    def judge(self, rollout: Rollout, head: str | None,
              committed: Sequence[int] | None = None) -> tuple[dict[str, Any] | None, str | None]:
        """``(sample, None)`` for a rollout that joins, ``(None, why)`` for one that is excluded:
        :meth:`exclusion`, then :meth:`sample_of`."""
        why = self.exclusion(rollout, head, committed)
        return (None, why) if why is not None else self.sample_of(rollout)

    def exclusion(self, rollout: Rollout, head: str | None, committed: Sequence[int] | None = None) -> str | None:
        """Why the rules 1-3 exclude the rollout, or ``None``. ``head`` is the committed version the job
        would train from (``None``: none yet; only possible without a staleness bound, see
        :attr:`needs_head`); ``committed``: the sequences of the head's incarnation that were
        committed, so that staleness counts publications (``None``: every sequence counts)."""
        found = rollout.get("labels")
        labels: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        for key, want in self.labels.items():
            if key not in labels or labels[key] != want:
                return f"label {key!r} is {labels.get(key)!r}, not {want!r} (training.batching.labels)"
        if self.reward_key is not None:
            result = rollout.get("result")
            reward = result.get(self.reward_key) if isinstance(result, Mapping) else None
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                return (f"its result has no finite number under {self.reward_key!r} "
                        f"(training.batching.reward_key; got {_short(reward)})")
        if self.max_staleness is not None:
            assert head is not None, "a staleness bound needs the head (needs_head)"
            lag, why = staleness(head, rollout.get("weight_version"), committed)
            if why is not None:
                return why
            assert lag is not None
            if lag > self.max_staleness:
                return (f"stale: it ran on {rollout.get('weight_version')}, {lag} publications behind the "
                        f"head {head} (training.batching.max_staleness = {self.max_staleness})")
        return None

    def sample_of(self, rollout: Rollout) -> tuple[dict[str, Any] | None, str | None]:
        """Rule 4: ``(sample, None)``, or ``(None, why)`` when the sample function fails."""
        try:
            sample = self.sample(rollout)
            if not isinstance(sample, Mapping):
                raise TypeError(f"returned a {type(sample).__name__}, not a mapping")
            canonical(sample)
        except TrainingPayloadError as exc:
            return None, f"its sample cannot be a job's payload: {exc}"
        except Exception as exc:  # noqa: BLE001 - the user's function: any failure excludes the rollout
            return None, f"the sample function failed: {type(exc).__name__}: {str(exc)[:300]}"
        return dict(sample), None

    @property
    def needs_head(self) -> bool:
        return self.max_staleness is not None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["BatchRules", "Rollout", "SampleFn", "load_sample", "rollout_sample", "staleness"]
