"""The orchestrator's Prometheus series, on prometheus-client.

Each :class:`Metrics` owns its own :class:`~prometheus_client.CollectorRegistry`
(several orchestrators share one process in the tests, so nothing goes on the
global registry), with the process, platform and GC collectors registered on it.
Gauges that describe the journal are set at scrape time by the ``/metrics``
handler; :meth:`Metrics.render` is the standard text exposition
(``generate_latest``), served with :data:`CONTENT_TYPE`.

Series (names as exposed):

- ``tidelog_reconciles_total{kind,outcome}`` counter
- ``tidelog_reconcile_seconds{kind}`` histogram (``_bucket``/``_sum``/``_count``)
- ``tidelog_rpc_calls_total{method,outcome}`` counter
- ``tidelog_rpc_seconds{method}`` histogram (``_bucket``/``_sum``/``_count``)
- ``tidelog_commit_seconds`` histogram: one group commit (the write transaction that carries a
  batch of transitions), from its start to its commit
- ``tidelog_discovery_probes_total{result}`` counter
- ``tidelog_group_commits``, ``tidelog_group_commit_writes``, ``tidelog_queue_depth``,
  ``tidelog_leader``, ``tidelog_lease_epoch`` gauges
- ``tidelog_entities{kind,state}`` gauge (read at scrape time)
- ``process_*``, ``python_info``, ``python_gc_*`` from the standard collectors

The two latency series were summaries (``_sum``/``_count`` only) before the move to
prometheus-client; they keep their names and labels and gain ``_bucket`` series.
Counters also expose prometheus-client's standard ``_created`` samples.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

__all__ = ["COMMIT_BUCKETS", "CONTENT_TYPE", "LATENCY_BUCKETS", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# RPC and reconcile latencies: a control call or a reconcile is milliseconds; a data call or a
# slow remote runs to the call's deadline (tens of seconds).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, float("inf"))
# Group commits: a commit (one fsync) is a fraction of a millisecond to a few; a large batch or a
# busy database takes longer.
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  float("inf"))

class Metrics:
    """Every series the orchestrator exports, on a registry of its own."""

    content_type = CONTENT_TYPE

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconciles = Counter("tidelog_reconciles", "Reconciles by entity kind and outcome.",
                                  ["kind", "outcome"], registry=r)
        self.reconcile_seconds = Histogram("tidelog_reconcile_seconds", "Time spent in one reconcile.",
                                           ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.rpc_calls = Counter("tidelog_rpc_calls", "Dispatched RPC attempts by method and outcome.",
                                 ["method", "outcome"], registry=r)
        self.rpc_seconds = Histogram("tidelog_rpc_seconds", "Duration of dispatched RPC attempts.",
                                     ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.commit_seconds = Histogram("tidelog_commit_seconds",
                                        "Duration of one group commit (a write transaction carrying a batch "
                                        "of transitions), from its start to its commit.",
                                        buckets=COMMIT_BUCKETS, registry=r)
        self.probes = Counter("tidelog_discovery_probes", "Participant status probes by result.",
                              ["result"], registry=r)
        self.commits = Gauge("tidelog_group_commits", "Write transactions committed by the group committer.",
                             registry=r)
        self.writes = Gauge("tidelog_group_commit_writes", "Write submissions carried by those commits.",
                            registry=r)
        self.queue_depth = Gauge("tidelog_queue_depth", "Keys waiting in the reconciler queue.", registry=r)
        self.leader = Gauge("tidelog_leader", "1 while this orchestrator holds the leader lease.", registry=r)
        self.epoch = Gauge("tidelog_lease_epoch", "Fencing epoch of the lease this orchestrator holds.",
                           registry=r)
        self.entities = Gauge("tidelog_entities", "Journal rows by kind and state (read at scrape time).",
                              ["kind", "state"], registry=r)
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def set_entities(self, counts: dict[str, dict[str, int]]) -> None:
        """Replace every ``tidelog_entities`` sample (no await inside: a scrape sees one snapshot)."""
        self.entities.clear()
        for kind, states in counts.items():
            for state, n in states.items():
                self.entities.labels(kind=kind, state=state).set(n)

    def render(self) -> bytes:
        """The standard Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
