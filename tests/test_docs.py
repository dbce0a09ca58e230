"""The docs stay true: diagrams match the machines, the example config matches the settings."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel

import engine.workflows  # noqa: F401 - registers the built-in families (their sections)
from engine.config import Settings, load
from engine.runtime import workflow
from journal import builtin_kinds

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_show_every_builtin_machine() -> None:
    text = "".join((ROOT / "docs" / name).read_text() for name in ("architecture.md", "checkpointing.md",
                                                                              "rollouts.md", "training.md",
                                                                              "deployment.md"))
    for kind in builtin_kinds():
        assert f"```mermaid\n{kind.machine.mermaid()}\n```" in text, f"diagram of {kind.name} is out of date"


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        if field.exclude:
            continue  # not a key of the file (Settings.sections is filled from workflows' own keys)
        key = field.alias or name  # the file's spelling (``class`` for ``TrainerSettingsModel.class_``)
        out.add(prefix + key)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= _keys(ann, f"{prefix}{key}.")
    return out


def _flatten(data: dict[str, object], prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
    return out


def test_example_config_is_valid_and_documents_every_key() -> None:
    path = ROOT / "config.example.yaml"
    settings = load(path)
    assert settings == Settings()  # the example shows the defaults
    documented = _flatten(yaml.safe_load(path.read_text()))
    # A registered family's own section (``deployment``) is a key of the file too.
    sections = {k for w in workflow.registered() if w.settings is not None and not w.builtin_section
                for k in {w.section_key or w.name} | _keys(w.settings, f"{w.section_key or w.name}.")}
    assert _keys(Settings) | sections == documented


def test_readme_gives_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make run" in text and "make test" in text


def _python_block(markdown: Path, heading: str) -> str:
    text = markdown.read_text()
    section = text[text.index(heading):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("\n```", start)]


def test_the_participant_example_runs(tmp_path: Path) -> None:
    import subprocess
    import sys
    script = tmp_path / "example.py"
    script.write_text(_python_block(ROOT / "docs" / "participants.md", "## 9. A complete example"))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "committed: ['r1']" in done.stdout and "restored: ['r1-a1'] result: 5" in done.stdout


_RECIPE_HARNESS = '''
import asyncio
import sys

from engine.config import Settings
from engine.runtime.crash import hook_names
from engine.runtime.service import Orchestrator
from engine.runtime.workflow import registered
from journal import Journal
from tests.support.databases import migrate, sqlite_url


async def main(path: str) -> None:
    url = sqlite_url(__import__("pathlib").Path(path))
    migrate(url)
    journal = Journal.open(url)
    async with journal.engine.begin() as conn:  # the family's migration
        await conn.run_sync(table.metadata.create_all)
    await journal.dispose()
    settings = Settings.model_validate({
        "journal": {"url": url}, "greetings": {"salutation": "hi"}, "logging": {"level": "WARNING"},
        "orchestrator": {"lease_ttl_s": 2, "lease_renew_s": 0.5, "shutdown_grace_s": 1}})
    orch = Orchestrator(settings)
    await orch.start()
    try:
        for _ in range(200):
            if orch.is_leader and orch.working():
                break
            await asyncio.sleep(0.05)

        async def create(tx):
            await tx.create("greetings", "g1", reason="asked")

        await orch.committer.run(create)
        for _ in range(200):
            async with orch.journal.read() as conn:
                row = (await conn.execute(table.select().where(table.c.id == "g1"))).first()
            if row is not None and row.state == "greeted":
                print("greeted:", row.text)
                break
            await asyncio.sleep(0.05)
    finally:
        await orch.stop()


assert WORKFLOW in registered()
assert "greetings:new->greeted" in hook_names()
asyncio.run(main(sys.argv[1]))
'''


def test_the_adding_a_workflow_recipe_runs(tmp_path: Path) -> None:
    """docs/architecture.md's smallest family, as printed, registered and run by a real orchestrator."""
    import subprocess
    import sys
    script = tmp_path / "recipe.py"
    script.write_text(_python_block(ROOT / "docs" / "architecture.md", "## 7. Adding a workflow") + "\n"
                      + _RECIPE_HARNESS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "j.db")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                       "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "greeted: hi, g1"


def test_the_architecture_tree_names_every_engine_package_and_family() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("```\njournal/"):]
    tree = tree[:tree.index("\n```")]
    engine = ROOT / "engine"
    packages = sorted(p.name for p in engine.rglob("*") if p.is_dir() and (p / "__init__.py").exists())
    missing = [name for name in packages if f"{name}/" not in tree]
    assert not missing, f"docs/architecture.md's tree lacks {missing}"
    # Every built-in family has its registration module, and the recipe's section names it.
    families = sorted(p.parent.name for p in (engine / "workflows").glob("*/workflow.py"))
    assert families == ["checkpoint", "deployment", "discovery", "training"], families
    assert "`workflow.py`" in text[text.index("## 7. Adding a workflow"):]
