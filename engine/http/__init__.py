"""The orchestrator's HTTP API: the aiohttp app and its read routes (``app``), the one error shell
every route shares (``shell``), query-parameter parsing with no HTTP in it (``query``), and the one
paging lister every family's ``GET /v1/<rows>`` uses (``listing``)."""

__all__ = ["app", "listing", "query", "shell"]
