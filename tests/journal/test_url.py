"""Journal URLs: the spellings accepted, what is refused, and redaction."""

from __future__ import annotations

import pytest

from journal import Journal, JournalURL, UnsupportedJournalURL


@pytest.mark.parametrize("raw, database", [
    ("sqlite:///tidelog.db", "tidelog.db"),
    ("sqlite+aiosqlite:///./tidelog.db", "./tidelog.db"),
    ("sqlite+aiosqlite:////var/lib/tidelog/journal.db", "/var/lib/tidelog/journal.db"),
])
def test_sqlite_spellings(raw: str, database: str) -> None:
    url = JournalURL.parse(raw)
    assert url.backend == "sqlite"
    assert url.url.drivername == "sqlite+aiosqlite"
    assert url.url.database == database


@pytest.mark.parametrize("raw", [
    "postgres://tide:pw@db.example:5433/journal",
    "postgresql://tide:pw@db.example:5433/journal",
    "postgresql+asyncpg://tide:pw@db.example:5433/journal",
])
def test_postgres_spellings(raw: str) -> None:
    url = JournalURL.parse(raw)
    assert url.backend == "postgresql"
    assert url.url.drivername == "postgresql+asyncpg"
    assert (url.url.username, url.url.password, url.url.host, url.url.port, url.url.database) == (
        "tide", "pw", "db.example", 5433, "journal")


@pytest.mark.parametrize("raw, scheme", [
    ("mysql://root:pw@localhost/tidelog", "mysql"),
    ("mysql+aiomysql://root@localhost/tidelog", "mysql+aiomysql"),
    ("postgresql+psycopg2://u@h/db", "postgresql+psycopg2"),
    ("sqlite+pysqlite:///x.db", "sqlite+pysqlite"),
    ("http://example.com/journal", "http"),
    ("not a url", "not a url"),
])
def test_unsupported_scheme_is_named(raw: str, scheme: str) -> None:
    with pytest.raises(UnsupportedJournalURL) as info:
        JournalURL.parse(raw)
    assert info.value.scheme == scheme
    assert repr(scheme) in str(info.value)
    # The message says what would work.
    assert "sqlite+aiosqlite:///" in str(info.value) and "postgresql+asyncpg://" in str(info.value)


def test_unsupported_url_message_never_shows_the_password() -> None:
    with pytest.raises(UnsupportedJournalURL) as info:
        JournalURL.parse("mysql://root:hunter2@localhost/tidelog")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("raw", ["sqlite://", "sqlite:///:memory:", "sqlite+aiosqlite://"])
def test_in_memory_sqlite_is_refused(raw: str) -> None:
    with pytest.raises(UnsupportedJournalURL, match="in-memory"):
        JournalURL.parse(raw)


def test_garbage_with_colon_names_what_precedes_it() -> None:
    with pytest.raises(UnsupportedJournalURL) as info:
        JournalURL.parse("journal:::")
    assert info.value.scheme == "journal"


def test_redacted_hides_the_password() -> None:
    url = JournalURL.parse("postgresql://tide:s3cr%40t@db.example:5432/journal")
    assert url.url.password == "s3cr@t"
    shown = url.redacted()
    assert "s3cr" not in shown
    assert shown == "postgresql+asyncpg://tide:***@db.example:5432/journal"
    # Without a password there is nothing to hide.
    assert JournalURL.parse("sqlite:///x.db").redacted() == "sqlite+aiosqlite:///x.db"


def test_journal_open_parses_and_reports_backend() -> None:
    journal = Journal.open("postgres://u@h/db")  # no connection is made until first use
    assert journal.backend == "postgresql"
    assert journal.url.url.drivername == "postgresql+asyncpg"
    with pytest.raises(UnsupportedJournalURL):
        Journal.open("oracle://u@h/db")
