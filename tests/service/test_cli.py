"""The service's command line against a real `kiln serve` (embedded: SQLite, file broker):
`kiln admin` keys, `kiln submit`, `jobs`, `status`, `cancel`, `download`, `serve --detach`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
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


def _local(stack) -> dict:
    """The environment of a user on the service's machine: no URL, no key given."""
    return {k: v for k, v in stack.env.items() if k not in ("KILN_URL", "KILN_API_KEY")}


def _kiln_as_user(stack, *args: str, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=_local(stack), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_submit_finds_the_local_key_whatever_the_spelling_of_the_local_url(served):
    model = str(ZOO / "resnet50.onnx")
    for url in (f"http://localhost:{served.port}", f"http://127.0.0.1:{served.port}/",
                f"HTTP://LocalHost:{served.port}/"):
        done = _kiln_as_user(served, "submit", model, "--url", url)
        assert done.returncode == 0, (url, done.stderr)
        assert len(done.stdout.strip()) == 32
        _kiln_as_user(served, "cancel", done.stdout.strip())
    remote = _kiln_as_user(served, "submit", model, "--url", f"http://kiln.example:{served.port}")
    assert remote.returncode != 0 and "no API key" in remote.stderr  # never sent elsewhere


def test_an_unreachable_service_is_one_clear_line(served, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("submit", str(ZOO / "resnet50.onnx")), ("jobs",), ("status", "0" * 32)):
        done = _kiln_as_user(served, *args, "--url", url, "--api-key", "kiln_abc_def")
        assert done.returncode != 0
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert "cannot reach" in done.stderr and url in done.stderr, done.stderr


def test_jobs_status_cancel_and_download(served, tmp_path):
    submitted = _kiln_as_user(served, "submit", str(ZOO / "lstm.onnx"))
    job = submitted.stdout.strip()
    waited = _kiln_as_user(served, "status", job, "--wait")
    assert waited.returncode == 0, waited.stderr
    assert "succeeded" in waited.stdout and job in waited.stdout
    listed = _kiln_as_user(served, "jobs")
    assert listed.returncode == 0 and job in listed.stdout and "succeeded" in listed.stdout
    assert "lstm.onnx" in listed.stdout
    out = tmp_path / "lstm.kiln"
    fetched = _kiln_as_user(served, "download", job, "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    with httpx.Client(base_url=served.url,
                      headers={"Authorization": f"Bearer {served.api_key}"}) as client:
        assert out.read_bytes() == client.get(f"/v1/jobs/{job}/artifact").content
    late = _kiln_as_user(served, "cancel", job)
    assert late.returncode != 0 and "already succeeded" in late.stderr
    assert "Traceback" not in late.stderr
    missing = _kiln_as_user(served, "status", "f" * 32)
    assert missing.returncode != 0 and "no job" in missing.stderr
    # one compile process: a job tuning for minutes keeps it busy, so the next one waits
    busy = _kiln_as_user(served, "submit", str(ZOO / "mobilenetv2.onnx"), "--tune", "full",
                         "--tune-budget", "600").stdout.strip()
    queued = _kiln_as_user(served, "submit", str(ZOO / "bert-base.onnx")).stdout.strip()
    cancelled = _kiln_as_user(served, "cancel", queued)
    assert cancelled.returncode == 0 and f"job {queued}: cancelled" in cancelled.stdout
    _kiln_as_user(served, "cancel", busy)


def test_ctrl_c_during_submit_wait_says_how_to_follow_or_cancel_the_job(served, tmp_path):
    # tuning for minutes: a plain compile of a model the service built before can finish before
    # the signal comes
    process = subprocess.Popen([sys.executable, "-m", "kiln.cli", "submit",
                                str(ZOO / "mobilenetv2.onnx"), "--tune", "full", "--tune-budget",
                                "600", "--wait", "-o", str(tmp_path / "m.kiln")],
                               env=_local(served), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stderr.readline()  # "job <id> queued: …"
    job = line.split()[1]
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"kiln status {job} --wait" in err and f"kiln cancel {job}" in err
    state = _kiln_as_user(served, "status", job)
    assert state.returncode in (0, 1) and job in state.stdout  # the job lives on
    _kiln_as_user(served, "cancel", job)
