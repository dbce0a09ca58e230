"""The orchestrator's HTTP API: the aiohttp app and its read routes (``app``), the one error shell
every route shares (``shell``), and query-parameter parsing with no HTTP in it (``query``)."""

__all__ = ["app", "query", "shell"]
