"""The code generator's modules import each other without circles (issue 12 §4): the op-facing
API (`kiln.codegen.contexts`) and the op registry sit below the op families, which sit below the
block lowering. Every import counts, including those inside functions."""
from __future__ import annotations

import ast
from pathlib import Path

import kiln

KILN = Path(kiln.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(KILN.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (a `from pkg import name` counts as an import
    of `pkg.name` when that is a module, else of `pkg`)."""
    root = KILN.parent / package.replace(".", "/")
    modules = {_module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                            else node.module for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_code_generator_has_no_import_cycle():
    graph = import_graph("kiln.codegen")
    assert "kiln.codegen.contexts" in graph and graph["kiln.codegen.ops.movement"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
