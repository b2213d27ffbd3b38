"""docker-compose.yml and deploy/kubernetes: well-formed, and every Kiln command in them parses."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli import build_parser

yaml = pytest.importorskip("yaml")
REPO = Path(__file__).resolve().parents[2]


def kiln_commands() -> list[tuple[str, list[str]]]:
    found = []
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if service.get("image") == "kiln:latest":
            found.append((f"compose {name}", service["command"]))
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            pod = spec.get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                if container["image"] == "kiln":
                    found.append((f"{path.name} {container['name']}", container["args"]))
    return found


def test_compose_has_the_scale_out_services():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert {"api", "worker", "postgres", "redis"} <= set(compose["services"])
    env = compose["x-kiln"]["environment"]
    assert env["KILN_DATABASE_URL"].startswith("postgresql://")
    assert env["KILN_BROKER_URL"].startswith("redis://")


def test_every_kiln_command_parses():
    commands = kiln_commands()
    assert {c[1][0] for c in commands} >= {"api", "worker", "admin"}
    parser = build_parser()
    for where, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `kiln {' '.join(argv)}` does not parse")
