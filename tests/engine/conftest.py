"""Fixtures every engine test may use: reference participant processes and a controller's calls."""

from tests.support.workflows import controller, procs  # noqa: F401 - pytest fixtures, shared here
