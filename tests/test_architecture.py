"""The import contracts of pyproject.toml's [tool.importlinter] (import-linter), and the one rule
an import graph cannot see: kiln does not name the packages above it even in a string (an
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


def test_kiln_does_not_name_the_service_workers_or_agents_in_strings():
    found = []
    for path in sorted((REPO / "kiln").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for line in node.value.strip().splitlines() or [""]:
                    if ABOVE_KILN.search(line.strip()):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {line.strip()}")
    assert found == []
