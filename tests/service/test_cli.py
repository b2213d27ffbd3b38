"""The service's command line against a real `kiln serve` (embedded: SQLite, file broker):
`kiln admin` keys, `kiln submit`, `jobs`, `status`, `cancel`, `download`, `serve --detach`."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.service.stack import FAST, REPO, EmbeddedStack, free_port

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


def _imposter(port: int) -> ThreadingHTTPServer:
    """Another program on the port, answering 200 to everything (as a second `kiln serve` or any
    web server would answer a readiness check)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_serve_detach_on_a_busy_port_fails_and_the_stop_hint_names_the_data_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env |= {**FAST, "PYTHONPATH": str(REPO)}

    def kiln_here(*args):
        return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=180)

    port = free_port()
    imposter = _imposter(port)
    try:
        busy = kiln_here("serve", "--detach", "--port", str(port), "--data-dir",
                         str(tmp_path / "busy"))
    finally:
        imposter.shutdown()
        imposter.server_close()
    assert busy.returncode != 0, busy.stdout
    assert f"port {port}" in busy.stderr and "in use" in busy.stderr, busy.stderr
    assert "running" not in busy.stdout
    assert not (tmp_path / "busy" / "serve.pid").exists()

    data = tmp_path / "mine"
    started = kiln_here("serve", "--detach", "--port", str(free_port()), "--data-dir", str(data))
    try:
        assert started.returncode == 0, started.stderr
        assert f"kiln serve --stop --data-dir {data}" in started.stdout, started.stdout
    finally:
        stopped = kiln_here("serve", "--stop", "--data-dir", str(data))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout


@pytest.mark.parametrize("command, flag, old, dest", [
    ("serve", "--compile-processes", "--workers", "compile_processes"),
    ("worker", "--compile-processes", "--concurrency", "concurrency"),
    ("api", "--api-processes", "--processes", "api_processes"),
])
def test_process_count_flags_follow_one_scheme(command, flag, old, dest):
    """--compile-processes for compile processes wherever they run, --api-processes for API
    ones; the old spellings still work but are no longer shown."""
    from kiln.cli import build_parser

    parser = build_parser()
    help_text = subprocess.run([sys.executable, "-m", "kiln.cli", command, "--help"], cwd=REPO,
                               capture_output=True, text=True).stdout
    assert flag in help_text and old not in help_text
    assert getattr(parser.parse_args([command, flag, "3"]), dest) == 3
    assert getattr(parser.parse_args([command, old, "4"]), dest) == 4
