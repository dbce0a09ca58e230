"""The ``tidelog`` command line: the entry point (:func:`main`), the journal commands, the API
client with its progress display, and replay. Workflow families add their own commands
(``engine.workflows.<family>.cli``)."""

from engine.cli.commands import main

__all__ = ["main"]
