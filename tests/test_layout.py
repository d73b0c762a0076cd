"""The house rules of DESIGN.md's target shape, checked on the source tree.

Every import inside client/ and server/ is relative; the import graph has no cycle (type-only
imports count: a cycle closed by `if TYPE_CHECKING:` is still a tangle for a reader); each floor
imports only the floors below it; the server reaches the client only through client/protocol/;
docs/ARCHITECTURE.md names only modules that exist.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> import path (pyproject's package-dir).
PACKAGE_DIRS = {"client": "rollserve.client", "server": "rollserve.server"}
V1 = "rollserve.v1"

# Floors, bottom first: a module may import its own floor's modules or a lower floor's.
SERVER_FLOORS = [
    "algorithms",
    "config",
    "models",
    "state",
    "capture_guard",
    "generation",
    "experience",
    "weights",
    "engine",
    "continuous",
    "serving",
]
CLIENT_FLOORS = ["protocol", "weights"]  # the modules at client/'s top level sit above both


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    relative: bool
    type_only: bool
    where: str  # file:line


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module that defines `name` (a module, or a name inside one)."""
    while name and name not in MODULES and name != V1:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports() -> Iterator[Import]:
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        type_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                names = [(alias.name, False) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                names = [(f"{origin}.{alias.name}", node.level > 0) for alias in node.names]
            else:
                continue
            for name, relative in names:
                if not name.startswith("rollserve."):
                    continue
                target = _owner(name)
                if target and target != module:
                    yield Import(module, target, relative, node.lineno in type_only, where)


IMPORTS = list(_imports())


def _floor(module: str, floors: list[str], package: str) -> int:
    """Index of the module's floor; top-level modules of the package sit above every floor."""
    rest = module.removeprefix(package + ".").split(".")[0] if module != package else ""
    return floors.index(rest) if rest in floors else len(floors)


def test_every_import_inside_the_project_is_relative() -> None:
    absolute = [i.where for i in IMPORTS if not i.relative]
    assert absolute == [], "absolute rollserve imports inside client/ or server/"


def test_the_import_graph_has_no_cycle_even_through_type_only_imports() -> None:
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        # A package's __init__ re-exports its modules: the arrow into it stands for them.
        edges.setdefault(i.source, set()).add(i.target)
    cycles = _cycles(edges)
    assert cycles == [], f"import cycles: {cycles}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
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


@pytest.mark.parametrize(
    ("package", "floors"),
    [("rollserve.server", SERVER_FLOORS), ("rollserve.client", CLIENT_FLOORS)],
)
def test_no_arrow_runs_up_a_floor(package: str, floors: list[str]) -> None:
    upward = [
        f"{i.where}: {i.source} -> {i.target}"
        for i in IMPORTS
        if i.source.startswith(package + ".")
        and i.target.startswith(package + ".")
        and _floor(i.target, floors, package) > _floor(i.source, floors, package)
    ]
    assert upward == []


def test_the_server_reaches_the_client_only_through_its_protocol() -> None:
    reached = sorted(
        f"{i.where}: {i.target}"
        for i in IMPORTS
        if i.source.startswith("rollserve.server")
        and i.target.startswith("rollserve.client")
        and not i.target.startswith("rollserve.client.protocol")
    )
    assert reached == []


def test_every_package_is_connected() -> None:
    """No package stands apart: each one imports or is imported by another package."""
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}

    def package_of(module: str) -> str:
        return module if module in packages else module.rpartition(".")[0]

    linked = {
        side
        for i in IMPORTS
        if package_of(i.source) != package_of(i.target)
        for side in (package_of(i.source), package_of(i.target))
    }
    assert sorted(packages - linked - {"rollserve.client", "rollserve.server"}) == []


def test_the_architecture_page_names_only_files_that_exist() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:client|server|protos|tests|bench|examples)/[\w/.]+\.\w+)`", text))
    named |= {
        path.replace(".", "/")
        .replace("rollserve/client", "client")
        .replace("rollserve/server", "server")
        for path in re.findall(r"`(rollserve\.(?:client|server)(?:\.\w+)+)`", text)
    }
    missing = [
        name
        for name in sorted(named)
        if not (ROOT / name).exists()
        and not (ROOT / f"{name}.py").exists()
        and not (ROOT / name.rpartition("/")[0]).with_suffix(".py").exists()
    ]
    assert named, "the page names no files: the pattern is stale"
    assert missing == []
