"""A small Prometheus text-format registry (counters, gauges, summaries with labels).

Kept in-process and dependency-free: the orchestrator exports a handful of
series, and gauges that describe the journal are computed at scrape time.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable

LabelKey = tuple[tuple[str, str], ...]


def _key(labels: dict[str, str]) -> LabelKey:
    return tuple(sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(key: LabelKey, extra: Iterable[tuple[str, str]] = ()) -> str:
    items = list(key) + list(extra)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric(ABC):
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    @abstractmethod
    def lines(self) -> list[str]:
        """The sample lines of this metric."""


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[LabelKey, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        k = _key(labels)
        self.values[k] = self.values.get(k, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(_key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[LabelKey, float] = {}

    def set(self, value: float, **labels: str) -> None:
        self.values[_key(labels)] = float(value)

    def clear(self) -> None:
        self.values.clear()

    def lines(self) -> list[str]:
        return [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(self.values.items())]


class Summary(_Metric):
    kind = "summary"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.sums: dict[LabelKey, float] = {}
        self.counts: dict[LabelKey, int] = {}

    def observe(self, value: float, **labels: str) -> None:
        k = _key(labels)
        self.sums[k] = self.sums.get(k, 0.0) + value
        self.counts[k] = self.counts.get(k, 0) + 1

    def lines(self) -> list[str]:
        out = []
        for k in sorted(self.counts):
            out.append(f"{self.name}_sum{_fmt_labels(k)} {_fmt_value(self.sums[k])}")
            out.append(f"{self.name}_count{_fmt_labels(k)} {self.counts[k]}")
        return out


class Metrics:
    """Every series the orchestrator exports."""

    def __init__(self) -> None:
        self.reconciles = Counter("tidelog_reconciles_total", "Reconciles by entity kind and outcome.")
        self.reconcile_seconds = Summary("tidelog_reconcile_seconds", "Time spent in one reconcile.")
        self.rpc_calls = Counter("tidelog_rpc_calls_total", "Dispatched RPC attempts by method and outcome.")
        self.rpc_seconds = Summary("tidelog_rpc_seconds", "Duration of dispatched RPC attempts.")
        self.probes = Counter("tidelog_discovery_probes_total", "Participant status probes by result.")
        self.commits = Gauge("tidelog_group_commits", "Write transactions committed by the group committer.")
        self.writes = Gauge("tidelog_group_commit_writes", "Write submissions carried by those commits.")
        self.queue_depth = Gauge("tidelog_queue_depth", "Keys waiting in the reconciler queue.")
        self.leader = Gauge("tidelog_leader", "1 while this orchestrator holds the leader lease.")
        self.epoch = Gauge("tidelog_lease_epoch", "Fencing epoch of the lease this orchestrator holds.")
        self.entities = Gauge("tidelog_entities", "Journal rows by kind and state (read at scrape time).")

    def all(self) -> list[_Metric]:
        return [self.reconciles, self.reconcile_seconds, self.rpc_calls, self.rpc_seconds, self.probes,
                self.commits, self.writes, self.queue_depth, self.leader, self.epoch, self.entities]

    def render(self) -> str:
        out: list[str] = []
        for m in self.all():
            out += m.header()
            out += m.lines()
        return "\n".join(out) + "\n"
