"""End to end over real HTTP: real uvicorn, real Celery workers, real compiles, `kiln verify`.

Embedded mode (`kiln serve`: SQLite and the file broker) and scale-out mode (uvicorn and two
`celery worker` processes on PostgreSQL and Redis of this machine).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kiln.cli import main as kiln_main
from service.client import KilnClient, ServiceError
from tests.service.stack import (REPO, EmbeddedStack, ScaleOutStack, create_database,
                                 drop_database, postgres_available, redis_available)

ZOO = REPO / "tests" / "fixtures" / "zoo"
MODELS = ["tinybert", "resnet50", "lstm", "gpt2"]
JOBS = 20
JOB_TIMEOUT = 600


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    stack = EmbeddedStack(tmp_path_factory.mktemp("embedded"), concurrency=2)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def scaleout(tmp_path_factory):
    if not (postgres_available() and redis_available()):
        pytest.skip("PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) are needed")
    url = create_database()
    stack = ScaleOutStack(tmp_path_factory.mktemp("scaleout"), url, workers=2)
    try:
        stack.start()
        stack.api_key = stack.create_key("acme")
        yield stack
    finally:
        stack.stop()
        drop_database(url)


def storage(stack) -> Path:
    return Path(stack.env["KILN_DATA_DIR"]) / "storage"


def compile_one(url: str, key: str, model: str, out: Path) -> tuple[dict, Path]:
    with KilnClient(url, key) as client:
        uploaded = client.upload_model(ZOO / f"{model}.onnx")
        job = client.submit(uploaded["id"], target="host")
        assert job["state"] in ("queued", "running", "succeeded")
        job = client.wait(job["id"], timeout=JOB_TIMEOUT)
        if job["state"] == "succeeded":
            client.download_artifact(job["id"], out)
        return job, ZOO / f"{model}.onnx"


def check_concurrent_jobs(stack, tmp_path: Path) -> None:
    models = [MODELS[i % len(MODELS)] for i in range(JOBS)]
    with ThreadPoolExecutor(JOBS) as pool:
        futures = [pool.submit(compile_one, stack.url, stack.api_key, m, tmp_path / f"{i}.kiln")
                   for i, m in enumerate(models)]
        results = [f.result() for f in futures]
    failed = [(job["id"], job["state"], job["error"]) for job, _ in results
              if job["state"] != "succeeded"]
    assert not failed, failed
    assert len({job["id"] for job, _ in results}) == JOBS
    for i, (job, model) in enumerate(results):
        assert job["progress"] == 100 and job["artifact"]["size_bytes"] > 0
        assert {"load", "frontend", "plan", "codegen", "build"} <= set(job["stage_seconds"])
        assert kiln_main(["verify", str(tmp_path / f"{i}.kiln"), str(model)]) == 0
    # the same bytes were uploaded five times each and are stored once
    assert len(list((storage(stack) / "models").iterdir())) == len(MODELS)
    with KilnClient(stack.url, stack.api_key) as client:
        assert len({m["id"] for m in client.http.get("/v1/models").json()}) == len(MODELS)
    artifacts = sorted(p.stem for p in (storage(stack) / "artifacts").glob("*.kiln"))
    assert set(job["id"] for job, _ in results) <= set(artifacts)


def test_embedded_twenty_concurrent_jobs(embedded, tmp_path):
    check_concurrent_jobs(embedded, tmp_path)


def test_scaleout_twenty_concurrent_jobs(scaleout, tmp_path):
    check_concurrent_jobs(scaleout, tmp_path)
    workers = {j["worker"] for j in _db_jobs(scaleout)}
    assert len(workers) == 2, f"both workers should have compiled jobs, got {workers}"


def _db_jobs(stack) -> list[dict]:
    from sqlalchemy import create_engine, text

    from service.db import normalize_url

    engine = create_engine(normalize_url(stack.env["KILN_DATABASE_URL"]))
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(text("SELECT * FROM jobs"))]
    engine.dispose()
    return rows


def _artifact_rows(stack, job_id: str) -> int:
    from sqlalchemy import create_engine, text

    from service.db import normalize_url

    url = stack.env.get("KILN_DATABASE_URL") or \
        f"sqlite:///{Path(stack.env['KILN_DATA_DIR']) / 'kiln.sqlite'}"
    engine = create_engine(normalize_url(url))
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM artifacts WHERE job_id = :j"),
                         {"j": job_id}).scalar()
    engine.dispose()
    return n


def _submit_and_wait_running(client: KilnClient, model: str) -> dict:
    uploaded = client.upload_model(ZOO / f"{model}.onnx")
    job = client.submit(uploaded["id"], partitioner="fixed")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = client.job(job["id"])
        if job["state"] == "running":
            return job
        assert job["state"] == "queued", job
        time.sleep(0.02)
    raise TimeoutError("the job never started")


def _check_completed_once(stack, client: KilnClient, job_id: str, tmp_path: Path, model: str):
    job = client.wait(job_id, timeout=JOB_TIMEOUT)
    assert job["state"] == "succeeded", job
    assert job["attempts"] == 2, "the killed run and the one that finished"
    assert _artifact_rows(stack, job_id) == 1
    assert [p.name for p in (storage(stack) / "artifacts").glob(f"{job_id}*")] == [f"{job_id}.kiln"]
    assert not list((storage(stack) / "tmp").glob(f"build-{job_id}-*"))
    out = client.download_artifact(job_id, tmp_path / "out.kiln")
    assert kiln_main(["verify", str(out), str(ZOO / f"{model}.onnx")]) == 0


def test_scaleout_worker_sigkill_mid_compile(scaleout, tmp_path):
    with KilnClient(scaleout.url, scaleout.api_key) as client:
        job = _submit_and_wait_running(client, "mobilenetv2")
        victim = "worker" + job["worker"].split("@")[0].removeprefix("w")
        scaleout.kill(victim)  # SIGKILL to the worker and its pool process
        assert client.job(job["id"])["state"] == "running"
        try:
            _check_completed_once(scaleout, client, job["id"], tmp_path, "mobilenetv2")
            finished_by = {j["id"]: j["worker"] for j in _db_jobs(scaleout)}[job["id"]]
            assert finished_by != job["worker"]
        finally:
            scaleout.start_worker(int(victim.removeprefix("worker")))


def test_embedded_worker_sigkill_restarts(embedded, tmp_path):
    with KilnClient(embedded.url, embedded.api_key) as client:
        job = _submit_and_wait_running(client, "efficientnet-b0")
        for pid in embedded.worker_pids():  # the worker and its pool; `kiln serve` restarts it
            # the worker first: killed after its compile child, it could see the child die and
            # give the job back, its retry then held by a dead worker (and the job queued until
            # the reaper's resend, 15 minutes on)
            for victim in [pid, *_children(pid)]:
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _check_completed_once(embedded, client, job["id"], tmp_path, "efficientnet-b0")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_cancel_queued_and_running(embedded):
    with KilnClient(embedded.url, embedded.api_key) as client:
        model = client.upload_model(ZOO / "albert.onnx")
        jobs = [client.submit(model["id"], partitioner=p) for p in ("none", "fixed", "dnnfusion")]
        cancelled = [client.cancel(j["id"]) for j in jobs]
        assert all(j["state"] == "cancelled" for j in cancelled)
        assert client.cancel(jobs[0]["id"])["state"] == "cancelled"  # again: harmless
        time.sleep(2)
        for j in jobs:
            final = client.job(j["id"])
            assert final["state"] == "cancelled" and final["artifact"] is None
            with pytest.raises(ServiceError) as err:
                client.report(j["id"])
            assert err.value.status == 409
        done = client.wait(client.submit(model["id"])["id"], timeout=JOB_TIMEOUT)
        with pytest.raises(ServiceError) as err:
            client.cancel(done["id"])
        assert err.value.status == 409 and "already succeeded" in err.value.detail


def test_tenants_and_keys_over_http(scaleout):
    other_key = scaleout.create_key("globex")
    with KilnClient(scaleout.url, scaleout.api_key) as acme, \
            KilnClient(scaleout.url, other_key) as globex:
        model = acme.upload_model(ZOO / "lstm.onnx")
        job = acme.wait(acme.submit(model["id"])["id"], timeout=JOB_TIMEOUT)
        for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/artifact",
                     f"/v1/jobs/{job['id']}/report", f"/v1/jobs/{job['id']}/events",
                     f"/v1/models/{model['id']}"):
            response = globex.http.get(path)
            assert response.status_code == 404, path
            assert response.headers["content-type"] == "application/problem+json"
            assert "no " in response.json()["detail"]
        assert globex.http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
        with pytest.raises(ServiceError) as err:
            globex.submit(model["id"])
        assert err.value.status == 404
        assert globex.jobs() == [] and job["id"] in {j["id"] for j in acme.jobs()}
    for headers in ({}, {"Authorization": "Bearer kiln_nope_nope"},
                    {"X-API-Key": scaleout.api_key + "x"}):
        response = httpx.get(f"{scaleout.url}/v1/jobs", headers=headers)
        assert response.status_code == 401
        assert response.headers["content-type"] == "application/problem+json"
        assert "API key" in response.json()["detail"]


def test_kiln_submit_wait_downloads_and_prints_report(embedded, tmp_path):
    out = tmp_path / "tiny.kiln"
    env = {**os.environ, "KILN_URL": embedded.url, "KILN_API_KEY": embedded.api_key}
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "submit",
                           str(ZOO / "tinybert.onnx"), "--target", "host", "--wait", "-o",
                           str(out)], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "100% succeeded" in done.stderr
    assert "fusion rate" in done.stdout.lower() or "kernels" in done.stdout.lower()
    assert f"wrote {out}" in done.stdout
    assert kiln_main(["verify", str(out), str(ZOO / "tinybert.onnx")]) == 0
    bad = subprocess.run([sys.executable, "-m", "kiln.cli", "submit", str(ZOO / "tinybert.onnx"),
                          "--target", "riscv"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown target 'riscv'" in bad.stderr


def test_openapi_documents_the_api(embedded):
    spec = httpx.get(f"{embedded.url}/v1/openapi.json").json()
    assert {"/v1/models", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/artifact",
            "/v1/jobs/{job_id}/report"} <= set(spec["paths"])
    assert "application/octet-stream" in \
        spec["paths"]["/v1/models"]["post"]["requestBody"]["content"]


def test_kiln_api_and_kiln_worker_commands(scaleout):
    """The scale-out commands themselves: another `kiln api` and `kiln worker` join the service."""
    from tests.service.stack import free_port

    port = free_port()
    scaleout.spawn("kiln-api", [sys.executable, "-m", "kiln.cli", "api", "--port", str(port)])
    scaleout.spawn("kiln-worker", [sys.executable, "-m", "kiln.cli", "worker", "--name",
                                   "extra@%h"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/v1/health", timeout=2).json()["database"] == "postgresql":
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, scaleout.log("kiln-api")
        time.sleep(0.3)
    while "ready" not in scaleout.log("kiln-worker"):
        assert time.monotonic() < deadline, scaleout.log("kiln-worker")
        time.sleep(0.3)
    with KilnClient(url, scaleout.api_key) as client:
        model = client.upload_model(ZOO / "resnet50.onnx")
        jobs = [client.submit(model["id"], partitioner=p) for p in ("none", "fixed", "dnnfusion")]
        for job in jobs:
            assert client.wait(job["id"], timeout=JOB_TIMEOUT)["state"] == "succeeded"
    scaleout.kill("kiln-worker", signal.SIGTERM)
    scaleout.kill("kiln-api", signal.SIGTERM)


def test_readme_main_command_serve_detach_submit_stop(tmp_path):
    """`kiln serve --detach && kiln submit … --wait`, then `kiln serve --stop` ends everything."""
    from tests.service.stack import FAST, free_port

    env = {**os.environ, **FAST, "KILN_DATA_DIR": str(tmp_path / "data"),
           "KILN_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    for name in ("KILN_URL", "KILN_API_KEY", "KILN_DATABASE_URL", "KILN_BROKER_URL"):
        env.pop(name, None)

    def kiln(*args, timeout=300):
        return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout)

    started = kiln("serve", "--detach")
    try:
        assert started.returncode == 0, started.stderr
        assert "running at" in started.stdout
        pid = int((tmp_path / "data" / "serve.pid").read_text())
        workers = _children(pid)
        assert workers, "kiln serve started no worker"
        done = kiln("submit", str(ZOO / "tinybert.onnx"), "--target", "host", "--wait")
        assert done.returncode == 0, done.stderr
        assert "kernels" in done.stdout and (tmp_path / "tinybert.kiln").is_file()
        assert kiln("serve", "--detach").stdout.startswith("kiln serve: already running")
    finally:
        stopped = kiln("serve", "--stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in [pid, *workers]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in [pid, *workers])


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
