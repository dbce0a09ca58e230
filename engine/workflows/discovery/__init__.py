"""The discovery family: probing every configured participant and recording its kind, instance,
phase and health (``controller``), and its registration: the kind, the configured participants synced
on every election, its routes (``workflow``)."""

__all__ = ["controller", "workflow"]
