"""Issue 13, item 8 and part of 11: the CLI, run as a real process, against journals it cannot use.

Every case here is bad input or an unusable journal, and the README promises exit code 2
and a message naming what is wrong — never a traceback, never a password, never a database
file created where a read-only command was pointed by mistake. The read-only-mount cases
mount a tmpfs of their own (the test machines run as root, where ``chmod`` stops nothing)
and skip, printing why, where mounting is impossible.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from journal import Journal, JournalURL
from tests.engine.cli.test_cli import config_for, tidelog
from tests.support.backends import only_postgresql
from tests.support.databases import migrate, sqlite_url

READ_COMMANDS = ("status", "events", "verify", "replay")
#: A password holding both characters the old redaction pattern stopped at.
PASSWORD = "p/a@ss"
PASSWORD_PARTS = ("p/a", "a@ss", "ss@", "/a@")


def one_line_refusal(res: subprocess.CompletedProcess[str], command: str) -> str:
    """Assert exit code 2, no traceback and exactly one line ``tidelog <command>: ...``; return it."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"tidelog {command}: "), lines[0]
    return lines[0]


# -- a PostgreSQL database that does not exist ------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.parametrize("command", [*READ_COMMANDS, "migrate"])
def test_a_postgres_database_that_does_not_exist_is_named(pg_admin_url: str, tmp_path: Path, command: str) -> None:
    name = f"nope_{secrets.token_hex(4)}"
    url = JournalURL.parse(pg_admin_url).url.set(database=name).render_as_string(hide_password=False)
    line = one_line_refusal(tidelog(command, config=config_for(tmp_path, url)), command)
    assert "journal.url" in line and f'database "{name}" does not exist' in line, line


def test_a_postgres_server_that_does_not_answer_is_named(tmp_path: Path) -> None:
    # Port 1 on the loopback: nothing listens there, the connection is refused at once.
    url = "postgresql+asyncpg://postgres@127.0.0.1:1/journal"
    line = one_line_refusal(tidelog("status", config=config_for(tmp_path, url)), "status")
    assert "journal.url postgresql+asyncpg://postgres@127.0.0.1:1/journal: " in line, line
    assert "refused" in line.lower() or "Connect call failed" in line, line


# -- an unknown query argument in the journal URL -------------------------------------------------

@pytest.mark.parametrize(("url", "argument", "known"), [
    ("sqlite+aiosqlite:///{tmp}/x.db?foo=1", "foo", "known: none"),
    ("sqlite:///{tmp}/x.db?mode=ro", "mode", "known: none"),
    ("postgresql+asyncpg://postgres@127.0.0.1:5432/postgres?bogus=1", "bogus", "ssl"),
    ("postgresql+asyncpg://postgres@127.0.0.1:5432/postgres?passwrd=1", "passwrd", "ssl"),
])
@pytest.mark.parametrize("command", ["status", "migrate"])
def test_an_unknown_query_argument_is_refused_by_name(tmp_path: Path, url: str, argument: str, known: str,
                                                      command: str) -> None:
    cfg = config_for(tmp_path, url.format(tmp=tmp_path))
    res = tidelog(command, config=cfg)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "TypeError" not in res.stderr, res.stderr
    # The configuration is refused, with the key, the argument, the rule and what is known.
    assert f"journal.url: Value error, query argument {argument!r}: not known to a" in res.stderr, res.stderr
    assert known in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [cfg.name], "nothing may be created"


# -- --since / --until near the datetime limits -----------------------------------------------------

@pytest.mark.parametrize(("flag", "value"), [
    ("--since", "0001-01-01T00:00:00+14:00"),
    ("--until", "9999-12-31T23:59:59-14:00"),
    ("--since", "0001-01-01T00:00:00+00:01"),
])
def test_times_beyond_the_datetime_limits_are_refused(journal_url: str, tmp_path: Path, flag: str, value: str) -> None:
    line = one_line_refusal(tidelog("events", flag, value, config=config_for(tmp_path, journal_url)), "events")
    assert f"{flag} {value!r}" in line and "outside the times the journal can hold" in line, line


def test_times_at_the_datetime_limits_are_read(journal_url: str, tmp_path: Path) -> None:
    cfg = config_for(tmp_path, journal_url)
    res = tidelog("events", "--json", "--since", "0001-01-01T05:00:00+05:00", "--until", "9999-12-31T23:59:59+00:00",
                  config=cfg)
    assert res.returncode == 0, res.stderr
    res = tidelog("events", "--since", "9999-12-31T23:59:59Z", config=cfg)
    assert res.returncode == 0 and len(res.stdout.strip().splitlines()) == 1, res.stdout  # the header alone


# -- read-only commands never create a journal ------------------------------------------------------

@pytest.mark.parametrize("command", READ_COMMANDS)
def test_a_read_command_at_a_mistyped_sqlite_path_creates_nothing(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "jornal.db"
    cfg = config_for(tmp_path, sqlite_url(missing))
    line = one_line_refusal(tidelog(command, config=cfg), command)
    assert f"no journal at {missing}" in line, line
    assert not missing.exists() and sorted(p.name for p in tmp_path.iterdir()) == [cfg.name]


def test_a_read_command_at_a_directory_creates_nothing(tmp_path: Path) -> None:
    (tmp_path / "journal.db").mkdir()
    line = one_line_refusal(tidelog("status", config=config_for(tmp_path, sqlite_url(tmp_path / "journal.db"))),
                            "status")
    assert f"no journal at {tmp_path / 'journal.db'} (not a regular file)" in line, line


def test_migrate_still_creates_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "new" / "journal.db"
    path.parent.mkdir()
    cfg = config_for(tmp_path, sqlite_url(path))
    res = tidelog("migrate", config=cfg)
    assert res.returncode == 0 and path.is_file(), res.stderr
    res = tidelog("status", "--json", config=cfg)
    assert res.returncode == 0 and json.loads(res.stdout)["lease"] is None, res.stderr


# -- reading a journal on a read-only mount ---------------------------------------------------------

def _mount(*args: str) -> str | None:
    """Run ``mount ARGS``; the reason it failed, or None."""
    try:
        res = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    return None if res.returncode == 0 else f"mount {' '.join(args)} failed: {res.stderr.strip() or res.returncode}"


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``(writable, read_only)``: a small tmpfs this test mounts, and a read-only bind mount of it.

    Skips, printing why, where mounting is impossible (not root, no mount namespace rights).
    """
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    why = _mount("-t", "tmpfs", "-o", "size=32m", "tmpfs", str(src))
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(f"cannot mount a tmpfs for the read-only-mount case: {why}")
    try:
        why = _mount("--bind", "-o", "ro", str(src), str(ro))
        if why is None and os.access(ro, os.W_OK):
            why = _mount("-o", "remount,bind,ro", str(ro))
        if why is not None or os.access(ro, os.W_OK):
            print(f"skipping: {why or 'the bind mount stayed writable'}")
            pytest.skip(f"cannot make a read-only bind mount: {why or 'it stayed writable'}")
        try:
            yield src, ro
        finally:
            _umount(ro)
    finally:
        _umount(src)


async def _fill(url: str) -> None:
    journal = Journal.open(url)
    try:
        async with journal.write() as tx:
            await tx.create("participants", "env-0", reason="configured", values={"url": "http://h:1"})
        async with journal.write() as tx:
            await tx.transition("participants", "env-0", from_state="pending", version=1, to_state="healthy",
                                reason="status ok", changes={"kind": "environment", "phase": "idle"})
    finally:
        await journal.dispose()


def _check_reads(cfg: Path) -> None:
    res = tidelog("status", "--json", config=cfg)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["entities"]["participants"] == {"healthy": 1}
    res = tidelog("events", "--json", "--kind", "participants", config=cfg)
    assert res.returncode == 0, res.stderr
    assert [json.loads(line)["to_state"] for line in res.stdout.splitlines()] == ["pending", "healthy"]
    res = tidelog("verify", config=cfg)
    assert res.returncode == 0 and "every row matches" in res.stdout, res.stderr
    res = tidelog("replay", config=cfg)
    assert res.returncode == 0, res.stderr


async def test_read_commands_read_a_journal_on_a_read_only_mount(mounts: tuple[Path, Path], tmp_path: Path) -> None:
    src, ro = mounts
    url = sqlite_url(src / "journal.db")
    migrate(url)
    await _fill(url)
    assert sorted(p.name for p in src.iterdir()) == ["journal.db"], "a clean close leaves no -wal or -shm"
    os.chmod(src / "journal.db", 0o444)
    os.chmod(src, 0o555)
    cfg = config_for(tmp_path, sqlite_url(ro / "journal.db"))
    _check_reads(cfg)
    assert sorted(p.name for p in src.iterdir()) == ["journal.db"]
    # A write command is refused there with a message, not a traceback.
    res = tidelog("serve", config=cfg)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr


async def test_read_commands_see_what_is_only_in_the_write_ahead_log_on_a_read_only_mount(
        mounts: tuple[Path, Path], tmp_path: Path) -> None:
    """A writer still holds the journal (its last commits only in ``-wal``): the reader must see them."""
    src, ro = mounts
    url = sqlite_url(src / "journal.db")
    migrate(url)
    await _fill(url)
    holder = sqlite3.connect(src / "journal.db", isolation_level=None)
    try:
        holder.execute("PRAGMA wal_autocheckpoint=0")
        holder.execute("SELECT count(*) FROM participants").fetchone()  # holds the -shm: no checkpoint on close
        journal = Journal.open(url)
        try:
            async with journal.write() as tx:
                await tx.create("participants", "env-1", reason="configured", values={"url": "http://h:2"})
        finally:
            await journal.dispose()
        assert (src / "journal.db-wal").stat().st_size > 0
        cfg = config_for(tmp_path, sqlite_url(ro / "journal.db"))
        res = tidelog("status", "--json", config=cfg)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["entities"]["participants"] == {"healthy": 1, "pending": 1}
        res = tidelog("events", "--json", "--entity", "env-1", "--kind", "participants", config=cfg)
        assert res.returncode == 0 and len(res.stdout.splitlines()) == 1, (res.stdout, res.stderr)
        res = tidelog("verify", config=cfg)
        assert res.returncode == 0 and "every row matches" in res.stdout, res.stderr
    finally:
        holder.close()


# -- a password holding '/' and '@' -----------------------------------------------------------------

def _with_password(url: str) -> str:
    parsed = JournalURL.parse(url).url
    assert parsed.password is None, "the test server is expected to use trust auth"
    return url.replace(f"://{parsed.username}@", f"://{parsed.username}:{PASSWORD}@", 1)


def assert_no_password(*texts: str) -> None:
    for text in texts:
        for part in PASSWORD_PARTS:
            assert part not in text, f"part of the password ({part!r}) shown: {text}"


@only_postgresql
def test_status_and_migrate_never_show_a_password_with_slash_and_at(journal_url: str, tmp_path: Path) -> None:
    url = _with_password(journal_url)
    cfg = config_for(tmp_path, url)
    res = tidelog("status", config=cfg)
    assert res.returncode == 0, res.stderr
    assert "postgres:***@127.0.0.1" in res.stdout or "postgres:***@localhost" in res.stdout, res.stdout
    assert_no_password(res.stdout, res.stderr)
    res = tidelog("status", "--json", config=cfg)
    assert res.returncode == 0 and ":***@" in json.loads(res.stdout)["journal"], res.stdout
    assert_no_password(res.stdout, res.stderr)
    # The logs too: migrate at INFO logs Alembic's progress to stderr.
    cfg = config_for(tmp_path, url, logging={"level": "DEBUG"})
    res = tidelog("migrate", config=cfg)
    assert res.returncode == 0, res.stderr
    assert_no_password(res.stdout, res.stderr)


@pytest.mark.postgres
def test_an_error_never_shows_a_password_with_slash_and_at(pg_admin_url: str, tmp_path: Path) -> None:
    url = _with_password(JournalURL.parse(pg_admin_url).url.set(database=f"nope_{secrets.token_hex(4)}")
                         .render_as_string(hide_password=False))
    for command in ("status", "migrate"):
        line = one_line_refusal(tidelog(command, config=config_for(tmp_path, url)), command)
        assert "does not exist" in line and ":***@" in line, line
        assert_no_password(line)


@pytest.mark.parametrize("text", [
    f"journal:\n  url: 'mysql://root:{PASSWORD}@localhost/tidelog'\n",
    f"journal:\n  url: 'postgresql+asyncpg://root:{PASSWORD}@localhost/tidelog?ssl=yes'\n",
    f"journal:\n  url: 'postgresql+asyncpg://root:{PASSWORD}@localhost/tidelog?bogus=1'\n",
])
def test_a_config_error_never_shows_a_password_with_slash_and_at(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    res = tidelog("status", config=cfg)
    assert res.returncode == 2 and "invalid configuration" in res.stderr, res.stderr
    assert "://***@" in res.stderr, res.stderr
    assert_no_password(res.stderr)


def test_a_file_that_is_not_a_journal_is_named(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"not a database, just sixteen-plus bytes of text\n" * 40)
    line = one_line_refusal(tidelog("verify", config=config_for(tmp_path, sqlite_url(path))), "verify")
    assert f"cannot read the journal at {path}: file is not a database" in line, line
    assert path.read_bytes().startswith(b"not a database"), "a read command must not touch the file"


def test_serve_on_a_port_in_use_names_the_api_keys_not_the_journal(journal_url: str, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = config_for(tmp_path, journal_url, api={"host": "127.0.0.1", "port": port}, logging={"level": "ERROR"})
        line = one_line_refusal(tidelog("serve", config=cfg), "serve")
    assert line.startswith(f"tidelog serve: api.host/api.port 127.0.0.1:{port}: cannot listen there: "), line
    assert "journal.url" not in line
