"""The backend parameters every journal test runs under, and a marker for PostgreSQL-only tests."""

from __future__ import annotations

import pytest

#: Parameters of the ``backend`` fixture: each journal test runs once per backend.
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]

#: Decorate a test that only means something on PostgreSQL (TRUNCATE, SKIP LOCKED, row locks).
only_postgresql = pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True)

#: Decorate a test that only means something on SQLite.
only_sqlite = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
