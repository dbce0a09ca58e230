"""The discovery family: probing every configured participant and recording its kind, instance,
phase and health (``controller``)."""

__all__ = ["controller"]
