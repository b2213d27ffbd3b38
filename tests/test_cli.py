"""The `kiln` command itself: commands found through the `kiln.commands` entry points, the
compiler working without the service installed, `--version`, `--partitioner`'s help."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import kiln
from kiln.plan import partitioner_names

REPO = Path(__file__).resolve().parents[1]
MODEL = "tests/fixtures/zoo/resnet50.onnx"

# Runs kiln's command line with some top-level packages missing, as on an installation without
# the `service` extra (a finder that fails their import, as a missing package does).
WITHOUT = """
import sys
missing = set(sys.argv[1].split(","))
class Missing:
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in missing):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from kiln.cli import main
sys.exit(main(sys.argv[2:]))
"""


def kiln_cli(*args: str, without: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", WITHOUT, without, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_commands_come_from_the_entry_point_group():
    names = {point.name for point in entry_points(group="kiln.commands")}
    assert {"runtime", "rewrite", "service", "workers"} <= names
    done = kiln_cli("--help")
    assert done.returncode == 0, done.stderr
    for command in ("compile", "run", "verify", "bench", "rules", "serve", "submit", "worker"):
        assert command in done.stdout


def test_the_compiler_works_without_the_service_and_the_workers(tmp_path):
    done = kiln_cli("--help", without="service,workers,fastapi,sqlalchemy,celery")
    assert done.returncode == 0, done.stderr
    assert "compile" in done.stdout and "verify" in done.stdout
    assert "serve" not in done.stdout and "worker" not in done.stdout
    planned = kiln_cli("compile", MODEL, "--profile-db", str(tmp_path / "p.sqlite"),
                       without="service,workers,fastapi,sqlalchemy,celery")
    assert planned.returncode == 0, planned.stderr
    assert "fusion rate" in planned.stdout
    assert "Traceback" not in planned.stderr


def test_a_missing_module_of_kiln_itself_is_not_hidden():
    done = kiln_cli("--help", without="kiln.rewrite.cli")
    assert done.returncode != 0
    assert "No module named 'kiln.rewrite.cli'" in done.stderr


def test_version():
    done = kiln_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"kiln {kiln.__version__}"


def test_partitioner_help_lists_each_partitioner_on_its_own_line():
    done = kiln_cli("compile", "--help")
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stdout.splitlines()]
    for name in partitioner_names():
        described = [line for line in lines if line.startswith(f"{name}: ")]
        assert described and len(described[0]) > len(name) + 10, done.stdout
    assert any("one kernel per op" in line for line in lines)
