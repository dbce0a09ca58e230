"""The ``tidelog`` command line, run as a real subprocess against real journals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from journal import Journal, audit, schema
from tests.support.zygote import shared



def tidelog(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [] if config is None else ["--config", str(config)]
    return shared().call("engine.cli", cmd + list(args), timeout=60)


def config_for(tmp_path: Path, url: str, **extra: object) -> Path:
    path = tmp_path / "tidelog.yaml"
    path.write_text(yaml.safe_dump({"journal": {"url": url}, "logging": {"level": "WARNING"}, **extra}))
    return path


def test_serve_refuses_an_unmigrated_journal_then_migrate_fixes_it(fresh_url: str, tmp_path: Path) -> None:
    cfg = config_for(tmp_path, fresh_url)
    res = tidelog("serve", config=cfg)
    assert res.returncode == 2
    assert "never migrated" in res.stderr and "run `tidelog migrate`" in res.stderr
    for cmd in ("status", "events", "verify"):
        res = tidelog(cmd, config=cfg)
        assert res.returncode == 2 and "tidelog migrate" in res.stderr, cmd
    res = tidelog("migrate", config=cfg)
    assert res.returncode == 0, res.stderr
    assert f"at revision {schema.head_revision()}" in res.stdout
    res = tidelog("status", "--json", config=cfg)
    assert res.returncode == 0 and json.loads(res.stdout)["lease"] is None


async def test_events_and_verify(journal_url: str, tmp_path: Path) -> None:
    journal = Journal.open(journal_url)
    try:
        async with journal.write() as tx:
            await tx.create("participants", "env-0", reason="configured", values={"url": "http://h:1"})
            await tx.create("participants", "env-1", reason="configured", values={"url": "http://h:2"})
        async with journal.write() as tx:
            await tx.transition("participants", "env-0", from_state="pending", version=1, to_state="healthy",
                                reason="status ok", changes={"kind": "environment", "phase": "idle"})
    finally:
        await journal.dispose()
    cfg = config_for(tmp_path, journal_url)

    res = tidelog("events", "--json", "--kind", "participants", "--entity", "env-0", config=cfg)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(e["from_state"], e["to_state"]) for e in lines] == [(None, "pending"), ("pending", "healthy")]
    res = tidelog("events", "--state", "healthy", config=cfg)
    assert res.returncode == 0 and "pending -> healthy" in res.stdout and "env-1" not in res.stdout
    res = tidelog("events", "--limit", "0", config=cfg)
    assert res.returncode == 2 and "--limit" in res.stderr and "between 1 and 1000" in res.stderr
    res = tidelog("events", "--since", "last tuesday", config=cfg)
    assert res.returncode == 2 and "--since" in res.stderr

    res = tidelog("verify", config=cfg)
    assert res.returncode == 0 and "every row matches" in res.stdout

    # Fault injection: change a row behind the journal's back; verify must name it.
    journal = Journal.open(journal_url)
    try:
        async with journal.engine.begin() as conn:
            await conn.execute(sa.text("UPDATE participants SET state = 'unreachable' WHERE id = 'env-1'"))
        assert len(await audit.verify(journal)) == 1
    finally:
        await journal.dispose()
    res = tidelog("verify", config=cfg)
    assert res.returncode == 1
    assert "MISMATCH participants env-1: state is 'unreachable', events say 'pending'" in res.stdout


def test_status_table(journal_url: str, tmp_path: Path) -> None:
    res = tidelog("status", config=config_for(tmp_path, journal_url))
    assert res.returncode == 0 and "leader   none" in res.stdout and "participants" in res.stdout


@pytest.mark.parametrize(("text", "needle"), [
    ("journal: [1, 2]\n", "journal: Input should be a valid dictionary"),
    ("journal:\n  url: mysql://root@localhost/x\n", "scheme 'mysql' is not supported"),
    ("journal:\n  url: 12\n", "journal.url"),
    ("orchestrator:\n  lease_ttl_s: 1\n  lease_renew_s: 5\n", "must be below lease_ttl_s"),
    ("participants:\n  - name: a\n    url: ftp://x\n", "participants.0.url"),
    ("participants:\n  - {name: a, url: 'http://x'}\n  - {name: a, url: 'http://y'}\n", "appears twice"),
    ("colour: blue\n", "colour: Extra inputs are not permitted"),
    ("participants:\n  - {name: a, url: 'http://user:pw@x:1'}\n", "must not carry credentials"),
    ("journal: {url: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("rollouts:\n  max_in_flight: 300\n", "rollouts.max_in_flight (300) exceeds rpc.data_pool (256)"),
    ("rollouts:\n  per_environment: 0\n", "rollouts.per_environment"),
])
def test_bad_config_is_named_and_changes_nothing(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    res = tidelog("migrate", config=cfg)
    assert res.returncode == 2
    assert str(cfg) in res.stderr and needle in res.stderr, res.stderr
    assert ":pw@" not in res.stderr, "a password in a URL must never be echoed"
    assert list(tmp_path.iterdir()) == [cfg], "a refused config must not create a journal"


def test_missing_config_file(tmp_path: Path) -> None:
    res = tidelog("status", config=tmp_path / "nope.yaml")
    assert res.returncode == 2 and "cannot read config" in res.stderr


def test_token_is_not_a_command_line_option() -> None:
    res = tidelog("serve", "--token", "abc")
    assert res.returncode == 2 and "unrecognized arguments: --token" in res.stderr
