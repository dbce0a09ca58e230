"""Helpers shared by the test suites (journal and engine): databases, clocks, snapshots."""
