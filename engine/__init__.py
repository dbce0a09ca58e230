"""Tidelog's orchestrator, by role: ``runtime`` (the core every workflow runs on), ``workflows``
(one folder per family: discovery, checkpoint, training), ``http`` (the API's app and error shell),
``cli`` (the ``tidelog`` command), ``demos``; ``config`` is the settings model every part reads.
docs/architecture.md draws the layers and the one direction their imports point."""

__all__ = ["cli", "config", "demos", "http", "runtime", "workflows"]
