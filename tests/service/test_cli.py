"""The service's command line against a real `kiln serve` (embedded: SQLite, file broker):
`kiln admin` keys, `kiln submit`, `jobs`, `status`, `cancel`, `download`, `serve --detach`."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.service.stack import REPO, EmbeddedStack

ZOO = REPO / "tests" / "fixtures" / "zoo"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    stack = EmbeddedStack(tmp_path_factory.mktemp("cli"), concurrency=1)
    try:
        yield stack.start()
    finally:
        stack.stop()


def kiln(stack, *args: str, timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env={**stack.env, **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_keys_are_listed_without_secrets_and_revoked_keys_get_401(served):
    key = served.create_key("acme")
    prefix = key.split("_")[1]
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{served.url}/v1/jobs", headers=headers).status_code == 200
    listed = kiln(served, "admin", "list-keys")
    assert listed.returncode == 0, listed.stderr
    assert prefix in listed.stdout and "acme" in listed.stdout and "tests" in listed.stdout
    assert key not in listed.stdout and key.rsplit("_", 1)[1] not in listed.stdout
    assert "default" in listed.stdout  # the key `kiln serve` made, of the default tenant
    only = kiln(served, "admin", "list-keys", "--tenant", "acme").stdout
    assert prefix in only and "default" not in only

    revoked = kiln(served, "admin", "revoke-key", prefix)
    assert revoked.returncode == 0 and prefix in revoked.stdout, revoked.stderr
    response = httpx.get(f"{served.url}/v1/jobs", headers=headers)
    assert response.status_code == 401 and "revoked" in response.json()["detail"]
    assert "revoked" in kiln(served, "admin", "list-keys", "--tenant", "acme").stdout
    unknown = kiln(served, "admin", "revoke-key", "nosuchkey")
    assert unknown.returncode == 2 and "no API key" in unknown.stderr
    # the local key still works
    assert httpx.get(f"{served.url}/v1/jobs", headers={
        "Authorization": f"Bearer {served.api_key}"}).status_code == 200
