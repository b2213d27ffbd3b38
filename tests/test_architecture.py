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
