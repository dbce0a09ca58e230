"""The package structure holds: no import cycles in ``journal``, ``engine`` or ``workers``, counting
imports inside functions too (they hide a cycle; they do not break it) but not those under
``if TYPE_CHECKING:`` (annotations only: nothing is imported at run time); and ``engine/``'s top
level holds its packages only (``config`` is the settings every part reads)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("journal", "engine", "workers")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module: str) -> set[str]:
    """Every module name ``path`` imports (absolute; relative imports resolved)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for stmt in node.body for n in ast.walk(stmt)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = set()
        for name in imported(path, module):
            while name and name not in files:
                name = name.rpartition(".")[0]
            # A module's own package (its __init__) runs first anyway; that edge is not a cycle.
            if name and name != module and not module.startswith(name + "."):
                deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_there_are_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_cycle_hidden_in_a_function() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_engine_top_level_holds_packages_and_config_only() -> None:
    engine = ROOT / "engine"
    modules = sorted(p.name for p in engine.glob("*.py"))
    assert modules == ["__init__.py"], modules
    packages = sorted(p.name for p in engine.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == ["cli", "config", "demos", "http", "runtime", "workflows"], packages


def _imports_of(package: str) -> dict[str, set[str]]:
    """Every module under ``package`` and the names it imports at run time (absolute)."""
    out = {}
    for path in (ROOT / package.replace(".", "/")).rglob("*.py"):
        module = module_name(path)
        out[module] = imported(path, module)
    return out


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_dependency_rule_of_docs_architecture_holds() -> None:
    broken: list[str] = []
    # journal: durable state only.
    for module, names in _imports_of("journal").items():
        for name in names:
            if _under(name, ("aiohttp", "ray", "torch", "engine", "workers")):
                broken.append(f"{module} imports {name}")
    # workers never imports the orchestrator.
    for module, names in _imports_of("workers").items():
        broken += [f"{module} imports {name}" for name in names if _under(name, ("engine",))]
    # engine reaches workers only through the protocol, the clients it drives and atomic writes
    # (the demos start and use the reference stack: they may use more).
    allowed = ("workers.protocol", "workers.executor", "workers.inference", "workers.http_limits", "workers.files",
               "workers.services", "workers.health")
    for module, names in _imports_of("engine").items():
        if module.startswith("engine.demos"):
            continue
        broken += [f"{module} imports {name}" for name in names
                   if _under(name, ("workers",)) and name != "workers" and not _under(name, allowed)]
    # The runtime core imports no family, no HTTP app and no CLI; only the service (the
    # composition root) loads the registered families.
    for module, names in _imports_of("engine.runtime").items():
        if module == "engine.runtime.service":
            continue
        broken += [f"{module} imports {name}" for name in names
                   if _under(name, ("engine.workflows", "engine.http", "engine.cli", "engine.demos"))]
    # A family imports neither the composition roots nor another family.
    for module, names in _imports_of("engine.workflows").items():
        family = module.split(".")[2] if module.count(".") >= 2 else None
        for name in names:
            if _under(name, ("engine.runtime.service", "engine.http.app", "engine.cli.commands", "engine.demos")):
                broken.append(f"{module} imports {name}")
            elif family and name.startswith("engine.workflows.") and name.split(".")[2] != family:
                broken.append(f"{module} imports another family: {name}")
    assert not broken, "\n".join(sorted(broken))
