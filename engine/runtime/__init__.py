"""The core every workflow runs on: the reconciler (``reconciler``, ``workqueue``), group commit and
read (``committer``, ``groupread``), the outbox's dispatcher and its RPC client (``dispatcher``,
``rpc``), the leader loop (``leader``), injectable time (``clock``), named crash hooks (``crash``),
``metrics``, ``logs``, and the :class:`~engine.runtime.service.Orchestrator` that wires them
(``service``). Nothing here knows a workflow family but ``service``, which builds them."""

__all__ = ["clock", "committer", "crash", "dispatcher", "groupread", "leader", "logs", "metrics", "reconciler", "rpc", "service", "workqueue"]
