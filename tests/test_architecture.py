"""The import contracts of pyproject.toml's [tool.importlinter] (import-linter), and what an
import graph does not see: kiln does not name the packages above it even in a string (an
`importlib.import_module("service.cli")` is an import all the same)."""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ABOVE_KILN = re.compile(r"^(service|workers|device_agents)$|(?<![\w.])(service|workers|device_agents)\.\w")


LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', limit_to_contracts=(sys.argv[1],),"
        " no_cache=True, no_logo=True))")


@pytest.mark.parametrize("contract", ["kiln-alone", "kiln-layers", "acyclic"])
def test_import_contract(contract):
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is missing: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-c", LINT, contract], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kiln_does_not_name_the_service_workers_or_agents_in_strings_or_type_imports():
    """The contracts leave out `if TYPE_CHECKING:` imports (they never run); kiln may not name
    the packages above it there either."""
    found = []
    for path in sorted((REPO / "kiln").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts = [line.strip() for line in node.value.strip().splitlines()] or [""]
            elif isinstance(node, ast.Import):
                texts = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                texts = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {text}" for text in texts
                      if ABOVE_KILN.search(text)]
    assert found == []


def _module_cycles(graph, ignored) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, None)]
        while work:
            module, edges = work.pop()
            if edges is None:
                index[module] = low[module] = len(index)
                stack.append(module)
                on_stack.add(module)
                edges = iter(sorted(m for m in graph.find_modules_directly_imported_by(module)
                                    if not ignored(module, m)))
            for child in edges:
                if child not in index:
                    work += [(module, edges), (child, None)]
                    break
                if child in on_stack:
                    low[module] = min(low[module], index[child])
            else:
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def _allowed(importer: str, imported: str) -> bool:
    """The SQLAlchemy table registry (service.db loads every domain's tables), and a package
    importing its own modules (kiln.plan registers its partitioners, kiln.ops its table): a
    package and its descendants are no siblings, as for import-linter's acyclic_siblings, which
    finds the cycles between sibling packages (the `acyclic` contract) that this test leaves out."""
    if importer == "service.db" and imported.startswith("service.") and imported.endswith(".tables"):
        return True
    return imported.startswith(importer + ".")


def test_no_module_import_cycles():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("kiln", "service", "workers", "device_agents", cache_dir=None,
                               exclude_type_checking_imports=True)  # they never run
    assert _module_cycles(graph, _allowed) == []
