"""Fixtures of the reference-participant tests: real processes, killed when the test ends."""

from tests.support.workflows import controller, procs  # noqa: F401 - pytest fixtures, shared here
