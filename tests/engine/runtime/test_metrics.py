"""The Prometheus exposition: per-orchestrator registries, histograms after real calls, /metrics parses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.clock import SystemClock
from engine.runtime.committer import GroupCommitter
from engine.runtime.dispatcher import Dispatcher
from engine.runtime.metrics import COMMIT_BUCKETS, CONTENT_TYPE, Metrics
from engine.runtime.rpc import RpcClient
from engine.runtime.service import Orchestrator
from journal import Journal, WriteTx, lease
from tests.engine.http.test_api import api  # noqa: F401 - the fixture, shared
from tests.engine.runtime.test_dispatcher import Scripted, queue, remote, wait_settled  # noqa: F401
from tests.support.gauges import C, T, open_gauge_journal
from tests.support.participant_server import StatusServer


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], family: str, name: str, **labels: str) -> float:
    values = [s.value for s in fams[family].samples if s.name == name and s.labels == labels]
    assert len(values) == 1, (family, name, labels, fams[family].samples)
    return float(values[0])


def test_two_registries_do_not_collide() -> None:
    a, b = Metrics(), Metrics()
    a.rpc_calls.labels(method="/x", outcome="ok").inc()
    fa, fb = families(a.render().decode()), families(b.render().decode())
    assert sample(fa, "tidelog_rpc_calls", "tidelog_rpc_calls_total", method="/x", outcome="ok") == 1
    assert [s for s in fb["tidelog_rpc_calls"].samples] == []
    assert "process_cpu_seconds" in fa or "python_info" in fa  # process metrics (Linux) / platform


def test_entity_gauge_is_replaced_at_each_scrape() -> None:
    m = Metrics(process=False)
    m.set_entities({"participants": {"healthy": 2, "lost": 1}})
    m.set_entities({"participants": {"healthy": 3}})
    f = families(m.render().decode())
    assert [(s.labels, s.value) for s in f["tidelog_entities"].samples] == [
        ({"kind": "participants", "state": "healthy"}, 3.0)]


async def test_a_dispatched_call_lands_in_the_rpc_histogram(journal: Journal, remote: Scripted) -> None:
    rpc = RpcClient(token=None, transport_tries=1)
    held = await lease.acquire(journal, "orchestrator", "test", 60)
    assert held is not None
    committer = GroupCommitter(journal, held.fence)
    m = Metrics()
    d = Dispatcher(journal, committer, rpc, SystemClock(), held.fence, lambda k, i: None, poll_s=0.05,
                   backoff_base_s=0.01, backoff_cap_s=0.02, metrics=m)
    journal.add_commit_listener(d.on_commit)
    remote.scripts = {"refuse": [409]}
    ids = [await queue(journal, remote.url, "/ok"), await queue(journal, remote.url, "/refuse")]
    task = asyncio.create_task(d.run())
    try:
        await wait_settled(journal, ids)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await committer.close()
        await rpc.close()
    f = families(m.render().decode())
    assert f["tidelog_rpc_seconds"].type == "histogram"
    assert sample(f, "tidelog_rpc_seconds", "tidelog_rpc_seconds_count", method="/ok") == 1
    assert sample(f, "tidelog_rpc_seconds", "tidelog_rpc_seconds_bucket", method="/ok", le="+Inf") == 1
    assert sample(f, "tidelog_rpc_seconds", "tidelog_rpc_seconds_sum", method="/ok") > 0
    assert sample(f, "tidelog_rpc_calls", "tidelog_rpc_calls_total", method="/ok", outcome="ok") == 1
    assert sample(f, "tidelog_rpc_calls", "tidelog_rpc_calls_total", method="/refuse",
                  outcome="RemoteError") == 1


async def test_each_group_commit_lands_in_the_commit_histogram(make_journal: Callable[..., Journal]) -> None:
    journal = await open_gauge_journal(make_journal, actor="orch-m")
    await journal.apply([[C("g1"), C("g2")]])
    held = await lease.acquire(journal, "leader", "orch-m", 60)
    assert held is not None
    m = Metrics(process=False)
    committer = GroupCommitter(journal, held.fence, metrics=m)

    async def move(tx: WriteTx) -> None:
        await tx.transition("gauges", "g2", from_state="new", version=1, to_state="on", reason="run")
    try:
        await committer.apply(T("g1", "new", 1, "on"))  # a declarative commit
        await committer.run(move)  # a read-decide-write commit
    finally:
        await committer.close()
    assert committer.commits == 2

    text = m.render().decode()
    assert "# HELP tidelog_commit_seconds Duration of one group commit" in text
    f = families(text)
    assert f["tidelog_commit_seconds"].type == "histogram"
    assert sample(f, "tidelog_commit_seconds", "tidelog_commit_seconds_count") == 2
    assert sample(f, "tidelog_commit_seconds", "tidelog_commit_seconds_sum") > 0
    buckets = {s.labels["le"]: s.value for s in f["tidelog_commit_seconds"].samples
               if s.name == "tidelog_commit_seconds_bucket"}
    assert set(buckets) == {"+Inf" if b == float("inf") else str(b) for b in COMMIT_BUCKETS}
    assert buckets["+Inf"] == 2
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative


async def test_metrics_endpoint_is_the_standard_exposition(api: tuple[str, Orchestrator, StatusServer]) -> None:  # noqa: F811
    base, orch, _ = api
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == CONTENT_TYPE
        text = await r.text()
    f = families(text)
    expected = {"tidelog_reconciles": "counter", "tidelog_reconcile_seconds": "histogram",
                "tidelog_rpc_calls": "counter", "tidelog_rpc_seconds": "histogram",
                "tidelog_commit_seconds": "histogram",
                "tidelog_discovery_probes": "counter", "tidelog_group_commits": "gauge",
                "tidelog_group_commit_writes": "gauge", "tidelog_queue_depth": "gauge", "tidelog_leader": "gauge",
                "tidelog_lease_epoch": "gauge", "tidelog_entities": "gauge"}
    assert {name: f[name].type for name in expected} == expected
    assert sample(f, "tidelog_leader", "tidelog_leader") == 1
    assert sample(f, "tidelog_lease_epoch", "tidelog_lease_epoch") == 1
    assert sample(f, "tidelog_entities", "tidelog_entities", kind="participants", state="healthy") == 1
    assert sample(f, "tidelog_discovery_probes", "tidelog_discovery_probes_total", result="healthy") >= 1
    # The participant's reconciles (a transition to healthy) are in the latency histogram.
    count = sample(f, "tidelog_reconcile_seconds", "tidelog_reconcile_seconds_count", kind="participants")
    assert count >= 1
    assert sample(f, "tidelog_reconcile_seconds", "tidelog_reconcile_seconds_bucket", kind="participants",
                  le="+Inf") == count
    # Those transitions were written by the orchestrator's group committer: its commits are timed.
    commits = sample(f, "tidelog_commit_seconds", "tidelog_commit_seconds_count")
    assert commits >= 1
    assert sample(f, "tidelog_commit_seconds", "tidelog_commit_seconds_bucket", le="+Inf") == commits
    assert "python_info" in f
    assert orch.metrics.registry is not Metrics().registry
