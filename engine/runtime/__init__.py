"""The core every workflow runs on: the reconciler (``reconciler``, ``workqueue``), group commit and
read (``committer``, ``groupread``), the outbox's dispatcher and its RPC client (``dispatcher``,
``rpc``) over one HTTP exchange (``transport``), the leader loop (``leader``), injectable time
(``clock``), named crash hooks (``crash``), the restart policy of managed recovery (``restarts``),
``metrics``, ``logs``, the workflow registration seam
(``workflow``), and the :class:`~engine.runtime.service.Orchestrator` that wires them (``service``).
Nothing here names a workflow family: each registers itself through ``workflow``, and ``service``
builds whatever is registered (it imports :mod:`engine.workflows` so the built-in ones are)."""

__all__ = ["clock", "committer", "crash", "dispatcher", "groupread", "leader", "logs", "metrics", "reconciler",
           "restarts", "rpc", "service", "transport", "workflow", "workqueue"]
