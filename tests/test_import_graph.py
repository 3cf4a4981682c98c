"""The import graph inside ``runs`` has no circle (issue 22): a module's imports point one way,
so a reader can draw the layers (the record, the engine's rules, the engine, ``runs.remote``,
the services above them) and a lazy import never hides a circle.

Read from the source, not from ``sys.modules``: every ``import`` counts, at module level and
inside functions alike (a function-level import is a circle deferred, not removed); imports
under ``if TYPE_CHECKING:`` do not (they never run). ``from package import name`` is an edge
to ``package.name`` when that is a module, else to the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Edges left in place for now, each with why: the graph without them has no circle, and each
# must still exist (remove it here when the code no longer has it). Add none without a reason.
KNOWN_EDGES = {}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "runs").rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                found.extend(_imports_in(other))
            continue
        found.extend(_imports_in(node))
    return found


def _imports_in(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    here = [node] if isinstance(node, ast.Import | ast.ImportFrom) else []
    return here + _imports(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``runs`` it imports."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets += [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        graph[name] = {
            found
            for target in targets
            if target.split(".")[0] == "runs" and (found := owner(target)) not in (None, name)
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_inside_runs_has_no_circle():
    graph = import_graph()
    for source, target in KNOWN_EDGES:
        graph[source].discard(target)
    found = circles(graph)
    assert not found, "import circles inside runs:\n" + "\n".join(
        " ".join(component)
        + "\n  edges: "
        + ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)
        for component in found
    )


def test_every_known_exception_still_exists():
    graph = import_graph()
    gone = [edge for edge in KNOWN_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not gone, f"no longer imported: remove from KNOWN_EDGES: {gone}"


def test_the_check_finds_a_circle_through_a_function_level_import(tmp_path):
    graph = {"runs.a": {"runs.b"}, "runs.b": {"runs.c"}, "runs.c": {"runs.a"}, "runs.d": set()}
    assert circles(graph) == [["runs.a", "runs.b", "runs.c"]]
    source = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from runs import hidden\n"
        "def f():\n"
        "    from runs import waits\n"
        "    return waits\n"
    )
    assert [ast.unparse(node) for node in _imports(source)] == [
        "from typing import TYPE_CHECKING",
        "from runs import waits",
    ]
