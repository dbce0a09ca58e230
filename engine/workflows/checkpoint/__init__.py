"""The checkpoint family: ``checkpoint`` (its scope and rollout set from the journal's rollouts:
``scope``; tries under a new id: ``retries``), ``restore`` and ``retirement`` controllers (retire and
forget), the family's operator-facing rules (``rules``), the fan-out they share (``fanout``,
``open_calls``), the checkpoint roots and safe file reads (``confined``), the publisher's files
(``publish_files``), row and stage names (``names``); the rollouts they act on: submission
(``rollout_tasks``), the rollout machine (``rollouts``) and batched forgetting (``forgetting``); its
routes (``api``, ``rollouts_api``), its commands (``cli``, ``rollouts_cli``) and its registration
(``workflow``). docs/checkpointing.md and docs/rollouts.md are the reference."""

__all__ = ["api", "checkpoint", "cli", "confined", "fanout", "forgetting", "names", "open_calls", "publish_files",
           "restore", "retirement", "retries", "rollout_tasks", "rollouts", "rollouts_api", "rollouts_cli", "rules",
           "scope", "workflow"]
