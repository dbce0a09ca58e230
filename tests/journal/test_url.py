"""Journal URLs: the spellings accepted, what is refused, and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from journal import (
    InvalidJournalURL,
    Journal,
    JournalNotFound,
    JournalURL,
    ReadOnlyJournal,
    UnsupportedJournalURL,
)


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


# -- issue 13: query arguments, passwords holding '/' and '@', read-only opening -------------------

@pytest.mark.parametrize("raw, argument, known", [
    ("sqlite+aiosqlite:///x.db?foo=1", "foo", "none"),
    ("sqlite:///x.db?timeout=5", "timeout", "none"),
    ("postgresql+asyncpg://u@h/db?bogus=1", "bogus", "command_timeout, host, passfile, prepared_statement_cache_size, "
                                                    "ssl, target_session_attrs"),
    ("postgres://u@h/db?application_name=x", "application_name", "ssl"),
])
def test_an_unknown_query_argument_is_named_with_the_known_ones(raw: str, argument: str, known: str) -> None:
    with pytest.raises(InvalidJournalURL) as info:
        JournalURL.parse(raw)
    assert isinstance(info.value, UnsupportedJournalURL), "config validation catches UnsupportedJournalURL"
    assert str(info.value).startswith(f"journal.url: query argument {argument!r}: not known to a ")
    assert known in str(info.value).split("(known: ", 1)[1]


def test_a_query_argument_value_is_never_shown_when_the_argument_is_unknown() -> None:
    with pytest.raises(InvalidJournalURL) as info:
        JournalURL.parse("postgresql+asyncpg://u@h/db?password=hunter2")
    assert "hunter2" not in str(info.value) and "'password'" in str(info.value)


@pytest.mark.parametrize("raw, rule", [
    ("postgresql+asyncpg://u@h/db?ssl=yes", "ssl='yes': must be one of disable, allow, prefer, require"),
    ("postgresql+asyncpg://u@h/db?command_timeout=0", "command_timeout='0': must be a positive, finite number"),
    ("postgresql+asyncpg://u@h/db?command_timeout=inf", "command_timeout='inf': must be a positive, finite number"),
    ("postgresql+asyncpg://u@h/db?prepared_statement_cache_size=-1", "must be an integer of at least 0"),
    ("postgresql+asyncpg://u@h/db?target_session_attrs=master", "must be one of any, primary"),
    ("postgresql+asyncpg://u@h/db?ssl=require&ssl=disable", "'ssl': given more than once"),
])
def test_a_known_query_argument_with_a_bad_value_names_the_rule(raw: str, rule: str) -> None:
    with pytest.raises(InvalidJournalURL, match="^journal.url: query argument ") as info:
        JournalURL.parse(raw)
    assert rule in str(info.value)


def test_known_query_arguments_are_kept() -> None:
    url = JournalURL.parse("postgresql://u@/db?host=/run/postgresql&ssl=require&command_timeout=30"
                           "&target_session_attrs=read-write&prepared_statement_cache_size=0")
    assert dict(url.url.query) == {"host": "/run/postgresql", "ssl": "require", "command_timeout": "30",
                                   "target_session_attrs": "read-write", "prepared_statement_cache_size": "0"}


@pytest.mark.parametrize("raw, password, shown", [
    ("postgresql+asyncpg://user:p/a@ss@host/db", "p/a@ss", "postgresql+asyncpg://user:***@host/db"),
    ("postgresql://user:p@ss:word@db.example:5433/journal", "p@ss:word",
     "postgresql+asyncpg://user:***@db.example:5433/journal"),
    ("postgresql://user:a/b/c@h:5432/j?ssl=require", "a/b/c", "postgresql+asyncpg://user:***@h:5432/j?ssl=require"),
    ("postgresql://user:s3cr%40t@h/j", "s3cr@t", "postgresql+asyncpg://user:***@h/j"),
    ("postgresql://user:p%3Fq@h/j", "p?q", "postgresql+asyncpg://user:***@h/j"),
    ("postgresql://user:@@h/j", "@", "postgresql+asyncpg://user:***@h/j"),
])
def test_a_password_runs_to_the_last_at_before_the_host(raw: str, password: str, shown: str) -> None:
    url = JournalURL.parse(raw)
    assert url.url.password == password
    assert url.redacted() == shown
    # The full URL round-trips (Alembic's env.py parses it again).
    again = JournalURL.parse(url.url.render_as_string(hide_password=False))
    assert again.url == url.url


def test_redacted_never_shows_any_part_of_a_password_with_slash_and_at() -> None:
    url = JournalURL.parse("postgresql+asyncpg://user:p/a@ss@host/db")
    assert url.redacted() == "postgresql+asyncpg://user:***@host/db"
    assert url.scrub("connect to user:p/a@ss failed (p%2Fa%40ss)") == "connect to user:*** failed (***)"


def test_a_host_holding_an_at_is_refused_without_showing_it() -> None:
    # A '?' in the password ends it early (the query starts there): the rest would be taken for the host.
    with pytest.raises(InvalidJournalURL) as info:
        JournalURL.parse("postgresql://user:p?x@y@h/db")
    assert "journal.url: host: contains '@'" in str(info.value)
    assert "p?x" not in str(info.value) and "x@y" not in str(info.value)


def test_a_sqlite_path_holding_an_at_is_a_path() -> None:
    url = JournalURL.parse("sqlite+aiosqlite:////data/user@host/journal.db")
    assert url.url.database == "/data/user@host/journal.db" and url.redacted().endswith("/data/user@host/journal.db")


def test_config_redaction_hides_a_password_with_slash_and_at() -> None:
    from engine.config import _USERINFO

    def hide(value: str) -> str:
        return _USERINFO.sub(r"\1***@", value)

    assert hide("postgresql+asyncpg://user:p/a@ss@host/db") == "postgresql+asyncpg://***@host/db"
    assert hide("http://user:pw@x:1") == "http://***@x:1"
    assert hide("mysql://u:p a/b@c@h/db") == "mysql://***@h/db"
    assert hide("sqlite:////data/u@h/j.db") == "sqlite:////data/u@h/j.db"


async def test_read_only_open_refuses_a_missing_sqlite_file_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    with pytest.raises(JournalNotFound, match=f"no journal at {path} \\(no such file\\)"):
        Journal.open(f"sqlite:///{path}", read_only=True)
    assert list(tmp_path.iterdir()) == []


async def test_a_read_only_journal_refuses_writes(journal_url: str) -> None:
    journal = Journal.open(journal_url, read_only=True)
    try:
        async with journal.read() as conn:
            assert (await conn.execute(sa.text("SELECT count(*) FROM participants"))).scalar() == 0
        with pytest.raises(ReadOnlyJournal):
            async with journal.write() as tx:
                await tx.create("participants", "env-0", reason="configured", values={"url": "http://h:1"})
        with pytest.raises(sa.exc.DBAPIError, match="(?i)read-only|readonly"):
            async with journal.engine.begin() as conn:
                await conn.execute(sa.text("DELETE FROM participants"))
    finally:
        await journal.dispose()
