"""Fixtures shared by every suite: a journal on each backend, real databases only.

- ``backend``: ``"sqlite"`` or ``"postgresql"``; every test that uses a journal
  fixture runs once per backend (``tests.support.backends.only_postgresql``
  narrows a test to one).
- ``journal_url``: a plain URL string of a fresh database at the head
  revision (SQLite: a file under ``tmp_path``; PostgreSQL: a clone of the
  session's migrated template). Usable from another process too.
- ``fresh_url``: a fresh database with no schema at all, for migration tests.
- ``make_journal(**kw)``: ``Journal.open(journal_url, **kw)``, disposed after the test.
- ``journal``: ``make_journal()`` with the real clock.
- ``clock``: a ``FakeClock`` for tests that move time themselves.
- ``pg_admin_url`` / ``postgres_server``: the session's PostgreSQL server.

PostgreSQL cases are skipped, with the reason, when the server does not answer
within two seconds (``TIDELOG_TEST_REQUIRE_POSTGRES=1`` turns that into a failure).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import Journal
from tests.support.backends import BACKENDS
from tests.support.journal_state import FakeClock
from tests.support.databases import (
    PostgresServer,
    migrate,
    postgres_admin_url,
    postgres_required,
    sqlite_url,
)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (probed once); drops all it created at the end."""
    server = PostgresServer(postgres_admin_url())
    server.probe()
    try:
        yield server
    finally:
        if server.unavailable is None:
            server.drop_all()


def _require(server: PostgresServer) -> None:
    if server.unavailable is not None:
        reason = f"PostgreSQL not reachable at {server.redacted}: {server.unavailable}"
        if postgres_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_admin_url(postgres_server: PostgresServer) -> str:
    """The admin URL (for tests that create their own databases); skips without a server."""
    _require(postgres_server)
    return postgres_server.url_for(postgres_server.admin.database or "postgres")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _postgres(request: pytest.FixtureRequest) -> PostgresServer:
    # Looked up lazily, so a run that selects only SQLite cases never probes a server.
    server: PostgresServer = request.getfixturevalue("postgres_server")
    _require(server)
    return server


@pytest.fixture
def journal_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh journal database at the head revision, as a plain URL string."""
    if backend == "sqlite":
        url = sqlite_url(tmp_path / "journal.db")
        migrate(url)
        yield url
        return
    server = _postgres(request)
    name = server.create_migrated()
    try:
        yield server.url_for(name)
    finally:
        server.drop_later(name)


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database with no journal schema (never migrated), as a plain URL string."""
    if backend == "sqlite":
        yield sqlite_url(tmp_path / "fresh.db")
        return
    server = _postgres(request)
    name = server.create_empty()
    try:
        yield server.url_for(name)
    finally:
        server.drop(name)


@pytest.fixture
async def make_journal(journal_url: str) -> AsyncIterator[Callable[..., Journal]]:
    """``make_journal(clock=..., kinds=..., actor=...)`` opens the test's journal; all are disposed."""
    opened: list[Journal] = []

    def make(**kwargs: Any) -> Journal:
        journal = Journal.open(journal_url, **kwargs)
        opened.append(journal)
        return journal

    try:
        yield make
    finally:
        for journal in opened:
            await journal.dispose()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that stands still until a test advances it (``Journal.open(url, clock=clock)``)."""
    return FakeClock()


@pytest.fixture
def journal(make_journal: Callable[..., Journal]) -> Journal:
    return make_journal()


#: The drills that take minutes each, in two lanes of about equal length (measured in the full suite:
#: about 570 s each). ``make test`` runs ``--dist loadgroup``, and :func:`pytest_xdist_make_scheduler`
#: makes each lane one unit of work: a worker runs it whole, in this order, so no more than two drills
#: ever run at once (they time their episodes; three at once on two cores starve them), while the
#: other workers take every other test. Serial order is unaffected but for putting these first.
DRILL_LANES: dict[str, tuple[str, ...]] = {
    "drills-a": (
        "tests/engine/workflows/training/test_crash_points.py::test_every_orchestrator_crash_point_recovers[sqlite]",
        "tests/engine/workflows/training/test_crash_points.py::"
        "test_a_trainer_killed_at_each_point_is_replaced_and_nothing_trains_twice[sqlite]",
        "tests/engine/workflows/training/test_crash_points.py::"
        "test_an_engine_killed_at_each_publication_phase_is_brought_to_the_head[sqlite]",
        "tests/engine/workflows/checkpoint/test_checkpoint_crash_points.py::"
        "test_every_checkpoint_crash_point_recovers[postgresql]",
        "tests/engine/demos/test_demo_training.py::test_the_rl_demo_learns_through_crashes_applying_every_step_once[sqlite]",
        "tests/engine/workflows/training/test_batching_crash_points.py::test_every_batch_crash_point_recovers[postgresql]",
        "tests/engine/workflows/checkpoint/test_rollouts_end_to_end.py::"
        "test_two_hundred_rollouts_survive_two_crashes_of_everything_and_finish_once[postgresql]",
        "tests/engine/workflows/checkpoint/test_rollout_crash_points.py::test_every_rollout_crash_point_recovers[postgresql]",
    ),
    "drills-b": (
        "tests/engine/workflows/training/test_crash_points.py::test_every_orchestrator_crash_point_recovers[postgresql]",
        "tests/engine/demos/test_demo_training.py::"
        "test_the_rl_demo_learns_through_crashes_applying_every_step_once[postgresql]",
        "tests/engine/workflows/checkpoint/test_checkpoint_crash_points.py::test_every_checkpoint_crash_point_recovers[sqlite]",
        "tests/engine/workflows/training/test_batching_crash_points.py::test_every_batch_crash_point_recovers[sqlite]",
        "tests/engine/workflows/checkpoint/test_rollouts_end_to_end.py::"
        "test_two_hundred_rollouts_survive_two_crashes_of_everything_and_finish_once[sqlite]",
        "tests/engine/workflows/checkpoint/test_rollout_crash_points.py::test_every_rollout_crash_point_recovers[sqlite]",
    ),
}


def _lanes() -> tuple[dict[str, int], dict[str, str]]:
    rank, lane_of = {}, {}
    for lane, nodeids in DRILL_LANES.items():
        for nodeid in nodeids:
            rank[nodeid], lane_of[nodeid] = len(rank), lane
    return rank, lane_of


RANK, LANE_OF = _lanes()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the drill lanes as its groups, named here by node id.

    xdist's own loadgroup finds a group by an ``@name`` its workers append to a marked test's node id,
    which has no effect under pytest 9 (every test was sent alone, and three drills ran at once)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DrillLanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return LANE_OF.get(nodeid, nodeid)

    return DrillLanes(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: RANK.get(item.nodeid, len(RANK)))  # stable: the rest keep their order
