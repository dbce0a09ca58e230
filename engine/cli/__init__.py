"""The ``tidelog`` command line: the entry point and the journal commands (``commands``, whose
``main`` the ``tidelog`` script runs), the API client with its progress display (``progress``), what
API-backed commands share (``client``), and ``replay``. Workflow families add their own commands
(``engine.workflows.<family>.cli``, built on ``client``); this package's ``__init__`` imports nothing,
so a family's commands can import ``client`` without loading the entry point."""

__all__ = ["client", "commands", "progress", "replay"]
