"""A workflow family defined in this file alone, added through the registration seam and driven
through a real ``tidelog serve``, its HTTP API and its CLI, on both journal backends: the proof that
adding a workflow is one folder plus its migration (docs/architecture.md, "Adding a workflow").

The family, ``countdowns``: a row is created ``running`` at stage 0 and its controller moves it one
stage per reconcile (a self-edge) until ``countdowns.stages`` stages have passed, then ``done``.
What it declares, and nothing else in the product names it:

- its kind (table + machine); the table is made by :func:`migrate`, standing in for its migration;
- its controller, built from its own settings section ``countdowns`` (``stages``, 1..3);
- an election step: the ``boot`` row is created on every election unless it exists;
- its routes, ``POST /v1/countdowns`` ``{"id"}`` (token and leader, through the shared shell) and
  ``GET /v1/countdowns/{id}``;
- its command, ``tidelog countdown ID``, which starts one and follows it with progress lines whose
  stage names the family declares.

``tidelog serve`` and the CLI load it from the config (``workflows: ["<this module>:WORKFLOW"]``);
this process registers it only inside :func:`registered_countdowns`, so no other test sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from engine.cli.client import client_for, follow, workflow_command
from engine.config import ConfigError, Settings, load
from engine.http.shell import ApiError, Body, Handler, read_body, row_json, typed
from engine.runtime.crash import hook_names
from engine.runtime.reconciler import BaseController, Context, Result
from engine.runtime.workflow import Command, Deps, Parts, Workflow, register, registered, unregister
from journal import EntityKind, Journal, StateMachine, WriteTx
from journal.models import entity_columns
from tests.support.served import AUTH, TOKEN, serve_process
from tests.support.zygote import shared

KIND = "countdowns"
STAGES = ("ignition", "liftoff", "orbit")
ENTRY = f"{__name__}:WORKFLOW"

metadata = sa.MetaData()
table = sa.Table(KIND, metadata, *entity_columns(),
                 sa.Column("stage", sa.Integer, nullable=False, default=0),
                 sa.Column("detail", sa.Text, nullable=True))
MACHINE = StateMachine.build(KIND, initial=["running"], edges={"running": ["running", "done"]},
                             terminal=["done"])


class CountdownSettings(BaseModel):
    """The ``countdowns`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stages: int = Field(default=3, ge=1, le=len(STAGES))


class CountdownController(BaseController):
    kind = KIND

    def __init__(self, stages: int) -> None:
        self.stages = stages

    async def reconcile(self, ctx: Context, entity_id: str) -> Result:
        row = await ctx.get(KIND, entity_id)
        if row is None or row.state != "running":
            return Result()
        last = row["stage"] + 1 >= self.stages

        async def step(tx: WriteTx) -> None:
            await tx.transition(KIND, entity_id, from_state="running", version=row.version,
                                to_state="done" if last else "running",
                                reason="counted down" if last else f"stage {row['stage']} passed",
                                changes={} if last else {"stage": row["stage"] + 1})

        await ctx.write(step)
        return Result()


def build(deps: Deps) -> Parts:
    settings: CountdownSettings = deps.settings.section(KIND)

    async def boot(tx: WriteTx) -> None:
        await tx.create(KIND, "boot", reason="elected", if_absent=True)

    return Parts(controllers=[CountdownController(settings.stages)], on_elected=[boot])


class StartCountdown(Body):
    id: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")


def routes(app: web.Application, orch: Any, mutating: Callable[[Handler], Handler]) -> None:
    async def start(request: web.Request) -> web.Response:
        body = await read_body(request, StartCountdown)

        async def write(tx: WriteTx) -> None:
            await tx.create(KIND, body.id, reason="requested")

        await orch.committer.run(write)
        return web.json_response({"id": body.id}, status=202)

    async def get(request: web.Request) -> web.Response:
        entity_id = request.match_info["id"]
        async with orch.journal.read() as conn:
            row = (await conn.execute(sa.select(table).where(table.c.id == entity_id))).first()
        if row is None:
            raise ApiError(404, "not_found", f"no countdown {entity_id!r}")
        return web.json_response(row_json(row._mapping))

    app.router.add_post("/v1/countdowns", mutating(typed(start)))
    app.router.add_get("/v1/countdowns/{id}", typed(get))


def commands(sub: Any) -> Mapping[str, Command]:
    c = workflow_command(sub, "countdown", "start a countdown and follow it")
    c.add_argument("id")

    def countdown(settings: Settings, args: argparse.Namespace) -> int:
        client = client_for(settings, args)
        client.post("/v1/countdowns", {"id": args.id})
        return follow(client, args, KIND, args.id)

    return {"countdown": countdown}


WORKFLOW = Workflow(KIND, kinds=(EntityKind(KIND, table, MACHINE),), build=build, routes=routes,
                    commands=commands, settings=CountdownSettings, stage_names={KIND: STAGES})


async def migrate(url: str) -> None:
    """The family's migration: its table on a journal at the product's head revision."""
    journal = Journal.open(url)
    try:
        async with journal.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await journal.dispose()


@pytest.fixture
def registered_countdowns() -> Iterator[Workflow]:
    register(WORKFLOW)
    try:
        yield WORKFLOW
    finally:
        unregister(WORKFLOW.name)


def tidelog(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIDELOG_CONTROL_TOKEN": TOKEN}
    return shared().call("engine.cli", ["--config", str(config), *args], env=env, timeout=120)


async def wait_done(s: aiohttp.ClientSession, base: str, entity_id: str) -> dict[str, Any]:
    for _ in range(400):
        async with s.get(f"{base}/v1/countdowns/{entity_id}") as r:
            if r.status == 200:
                body: dict[str, Any] = await r.json()
                if body["state"] == "done":
                    return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"countdown {entity_id} did not finish")


async def test_a_workflow_defined_here_runs_through_serve_the_api_and_the_cli(journal_url: str,
                                                                              tmp_path: Path) -> None:
    await migrate(journal_url)
    async with serve_process(journal_url, tmp_path, workflows=[ENTRY], countdowns={"stages": 2}) as served:
        config = tmp_path / "tidelog.yaml"
        async with aiohttp.ClientSession() as s:
            # The election step ran: the boot row was created and counted down.
            assert (await wait_done(s, served.base, "boot"))["stage"] == 1
            # Through the API: the shared guard refuses a missing token and the shell a bad body...
            async with s.post(f"{served.base}/v1/countdowns", json={"id": "api-1"}) as r:
                assert r.status == 401
            async with s.post(f"{served.base}/v1/countdowns", json={"id": "Not Valid"}, headers=AUTH) as r:
                assert r.status == 422 and (await r.json())["error"]["field"] == "id"
            async with s.post(f"{served.base}/v1/countdowns", json={"id": "api-1"}, headers=AUTH) as r:
                assert r.status == 202
            done = await wait_done(s, served.base, "api-1")
            # ...and the section's ``stages: 2`` is what the controller counted.
            assert done["stage"] == 1
            async with s.get(f"{served.base}/v1/events", params={"kind": KIND, "entity": "api-1"}) as r:
                events = (await r.json())["events"]
            assert [e["to_state"] for e in events] == ["running", "running", "done"]
            async with s.get(f"{served.base}/v1/status") as r:
                assert (await r.json())["entities"][KIND] == {"done": 2}

        # Through the CLI, a separate process that loads the family from the same config.
        cli = await asyncio.to_thread(tidelog, config, "countdown", "cli-1")
        assert cli.returncode == 0, cli.stderr
        lines = cli.stdout.splitlines()
        assert lines[0].startswith("running stage 1/3 (ignition) ")
        assert lines[1].startswith("running stage 2/3 (liftoff) ")
        assert lines[2].startswith("done ")
        assert lines[3].startswith("countdown cli-1: done")
        assert "orbit" not in cli.stdout  # stages: 2
        shown = await asyncio.to_thread(tidelog, config, "events", "--kind", KIND, "--entity", "cli-1", "--json")
        assert shown.returncode == 0, shown.stderr
        assert [json.loads(line)["to_state"] for line in shown.stdout.splitlines()] == ["running", "running", "done"]
        verified = await asyncio.to_thread(tidelog, config, "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_bad_section_or_entry_stops_serve_with_the_key_named(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    base = {"journal": {"url": f"sqlite+aiosqlite:///{db}"}, "workflows": [ENTRY]}
    cases = [({"countdowns": {"stages": 4}}, "countdowns.stages: Input should be less than or equal to 3 (got 4)"),
             ({"countdowns": {"stage": 1}}, "countdowns.stage: Extra inputs are not permitted"),
             ({"workflows": [f"{__name__}:NOPE"]}, f"{__name__} has no Workflow named 'NOPE'"),
             ({"workflows": ["no_such_module_here"]}, "cannot import 'no_such_module_here'"),
             ({"workflows": ["not a module"]}, "is not a module path")]
    for extra, expected in cases:
        config = tmp_path / "bad.yaml"
        config.write_text(yaml.safe_dump({**base, **extra}))
        result = tidelog(config, "serve")
        assert result.returncode == 2, (extra, result.stdout, result.stderr)
        assert expected in result.stderr, (extra, result.stderr)
    assert not db.exists()  # refused before anything was opened


def test_unregistered_its_section_is_an_unknown_key() -> None:
    with pytest.raises(Exception, match="countdowns"):
        Settings.model_validate({"countdowns": {"stages": 1}})


def test_registered_it_is_seen_by_every_enumeration(registered_countdowns: Workflow, tmp_path: Path) -> None:
    assert registered()[-1] is WORKFLOW
    # Its crash points are enumerated with the built-in ones.
    hooks = hook_names()
    assert {"countdowns:created:running", "countdowns:running->running", "countdowns:running->done"} <= set(hooks)
    assert "checkpoints:created:preparing" in hooks
    # Its section is validated by its model and read back; defaults when the file has none.
    assert Settings.model_validate({"countdowns": {"stages": 1}}).section(KIND) == CountdownSettings(stages=1)
    assert Settings().section(KIND) == CountdownSettings()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"countdowns": {"stages": 0}}))
    with pytest.raises(ConfigError, match=r"countdowns\.stages: Input should be greater than or equal to 1"):
        load(config)
    # A second family may not take its name, its kind or its section.
    for clash in (Workflow(KIND), Workflow("other", kinds=WORKFLOW.kinds),
                  Workflow("other", settings=CountdownSettings, section=KIND)):
        with pytest.raises(ValueError, match="countdowns"):
            register(clash)
