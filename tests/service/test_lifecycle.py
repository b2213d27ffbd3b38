"""The worker side of jobs on SQLite and PostgreSQL: claims, fencing, idempotence, outcomes.

`run_job` is what the Celery task runs; here it is called directly, with the real compiler
unless a test replaces compile_artifact to control timing or failure.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError

from kiln import pipeline
from service.db import database, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.schemas import JobCreate
from service.jobs.tables import Artifact, Job
from service.migrate import upgrade
from service.models.tables import ModelRecord
from service.settings import Settings
from service.storage import Storage
from service.tenants.service import create_tenant
from workers.compile import run_job

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"


@pytest.fixture
def env(database_url, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url,
                        heartbeat_seconds=0.2, stale_after_seconds=30,
                        measure_local=False)  # profiling: tests/device_agents/test_profile_store.py
    upgrade(database_url)
    db = database(database_url)
    storage = Storage(settings.storage_root)
    tenant = create_tenant(db, "acme")
    import hashlib

    data = (ZOO / "lstm.onnx").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    source = tmp_path / "lstm.onnx"
    source.write_bytes(data)
    storage.install_model(source, sha)
    with db.write() as s:
        model = ModelRecord(tenant_id=tenant.id, sha256=sha, size_bytes=len(data),
                            filename="lstm.onnx", opset=14,
                            inputs=[{"name": "x", "dtype": "float32", "shape": [16, 1, 16]}])
        s.add(model)

    def new_job(**options) -> str:
        job = jobs.create(db, tenant.id, JobCreate(model_id=model.id))
        if options:  # set directly: what the API would refuse is what the compiler must refuse
            with db.write() as s:
                s.execute(update(Job).where(Job.id == job.id).values(**options))
        return job.id

    return settings, db, storage, tenant.id, new_job


def job_row(db, job_id) -> Job:
    with db.read() as s:
        return s.get(Job, job_id)


def artifact_rows(db, job_id) -> int:
    with db.read() as s:
        return s.scalar(select(func.count()).select_from(Artifact).where(Artifact.job_id == job_id))


def test_runs_once_and_twice_is_harmless(env):
    settings, db, storage, _, new_job = env
    job_id = new_job(partitioner="fixed")
    assert run_job(settings, db, job_id, "w1") == "succeeded"
    assert run_job(settings, db, job_id, "w2") == "skipped"  # a re-delivered message
    job = job_row(db, job_id)
    assert (job.state, job.progress, job.attempts, job.worker) == ("succeeded", 100, 1, "w1")
    assert {"load", "frontend", "plan", "codegen", "build"} <= set(job.stage_seconds)
    assert job.report["kernels"] > 0 and job.report["model"] == "lstm"
    assert artifact_rows(db, job_id) == 1
    assert [p.name for p in (storage.root / "artifacts").iterdir()] == [f"{job_id}.kiln"]
    assert not any(storage.tmp.iterdir())


def test_concurrent_deliveries_compile_once(env):
    settings, db, storage, _, new_job = env
    job_id = new_job()
    outcomes = []
    threads = [threading.Thread(target=lambda w=w: outcomes.append(run_job(settings, db, job_id, w)))
               for w in ("w1", "w2", "w3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["skipped", "skipped", "succeeded"]
    assert artifact_rows(db, job_id) == 1 and job_row(db, job_id).attempts == 1


def test_compile_error_fails_with_the_compilers_message(env):
    settings, db, storage, _, new_job = env
    bad_partitioner = new_job(partitioner="nonesuch")
    assert run_job(settings, db, bad_partitioner, "w1") == "failed"
    job = job_row(db, bad_partitioner)
    assert job.state == "failed" and "unknown partitioner 'nonesuch'" in job.error
    bad_shape = new_job(shapes={"x": [16, 1, 17]})
    assert run_job(settings, db, bad_shape, "w1") == "failed"
    assert "axis 2 is fixed to 16" in job_row(db, bad_shape).error
    assert artifact_rows(db, bad_shape) == 0 and not any(storage.tmp.iterdir())


def fake_compiler(monkeypatch, body):
    def compile_artifact(model_path, out_path, options, store, on_stage=None):
        return body(Path(out_path), on_stage)
    monkeypatch.setattr(pipeline, "compile_artifact", compile_artifact)


def test_stage_seconds_come_from_on_stage(env, monkeypatch):
    settings, db, _, _, new_job = env
    seen = []

    def body(out: Path, on_stage):
        for stage, seconds in (("load", 0.05), ("frontend", 0.3), ("plan", 0.1)):
            on_stage(stage)
            seen.append(job_row(db, job_id).progress)
            time.sleep(seconds)
        out.write_bytes(b"artifact")
        return {"kernels": 1}

    fake_compiler(monkeypatch, body)
    job_id = new_job()
    assert run_job(settings, db, job_id, "w1") == "succeeded"
    job = job_row(db, job_id)
    assert seen == [0, 5, 30]
    assert job.stage_seconds["frontend"] == pytest.approx(0.3, abs=0.1)
    assert job.stage_seconds["load"] == pytest.approx(0.05, abs=0.05)
    assert job.report == {"kernels": 1} and job.stage == "plan"


def test_cancel_stops_a_running_job_at_its_next_stage(env, monkeypatch):
    settings, db, storage, tenant, new_job = env

    def body(out: Path, on_stage):
        on_stage("load")
        jobs.cancel(db, tenant, job_id)
        on_stage("frontend")
        raise AssertionError("not reached")

    fake_compiler(monkeypatch, body)
    job_id = new_job()
    assert run_job(settings, db, job_id, "w1") == "aborted"
    job = job_row(db, job_id)
    assert job.state == "cancelled" and artifact_rows(db, job_id) == 0
    assert run_job(settings, db, job_id, "w1") == "skipped"
    assert not any(storage.tmp.iterdir())


def test_internal_error_fails_the_job(env, monkeypatch):
    settings, db, _, _, new_job = env

    def body(out, on_stage):
        raise ZeroDivisionError("oops")

    fake_compiler(monkeypatch, body)
    job_id = new_job()
    assert run_job(settings, db, job_id, "w1") == "failed"
    assert job_row(db, job_id).error == "internal compiler error: ZeroDivisionError: oops"


def test_transient_failure_gives_the_job_back(env, monkeypatch):
    settings, db, _, _, new_job = env

    def body(out, on_stage):
        raise OperationalError("SELECT 1", {}, Exception("connection lost"))

    fake_compiler(monkeypatch, body)
    job_id = new_job()
    with pytest.raises(OperationalError):
        run_job(settings, db, job_id, "w1")
    job = job_row(db, job_id)
    assert job.state == "queued" and job.worker is None and job.attempts == 1


def test_a_silent_run_is_requeued_and_fenced_out(env):
    settings, db, storage, _, new_job = env
    job_id = new_job()
    first = lifecycle.claim(db, job_id, "w1", 30, 3)
    assert first is not None and first.attempt == 1
    assert lifecycle.claim(db, job_id, "w2", 30, 3) is None  # held by a live run
    assert lifecycle.requeue_stale(db, 30, 3) == []
    with db.write() as s:  # w1 went silent
        s.execute(update(Job).where(Job.id == job_id)
                  .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    assert lifecycle.requeue_stale(db, 30, 3) == [job_id]
    assert lifecycle.requeue_stale(db, 30, 3) == []  # only once
    assert job_row(db, job_id).state == "queued"
    assert run_job(settings, db, job_id, "w2") == "succeeded"
    # the old run wakes up: every write it tries is refused
    assert not lifecycle.heartbeat(db, job_id, first.attempt)
    assert not lifecycle.record_stage(db, job_id, first.attempt, "build", {})
    stray = storage.tmp / "stray.kiln"
    stray.write_bytes(b"old")
    assert not lifecycle.succeed(db, storage, first, stray, {}, {}, "0" * 64)
    assert not lifecycle.fail(db, first, "late", {})
    job = job_row(db, job_id)
    assert (job.state, job.attempts, job.worker) == ("succeeded", 2, "w2")
    assert artifact_rows(db, job_id) == 1
    assert (storage.root / "artifacts" / f"{job_id}.kiln").read_bytes() != b"old"


def test_a_job_whose_workers_keep_dying_fails(env):
    settings, db, _, _, new_job = env
    job_id = new_job()
    for attempt in range(1, 4):
        assert lifecycle.claim(db, job_id, f"w{attempt}", 30, 3).attempt == attempt
        with db.write() as s:
            s.execute(update(Job).where(Job.id == job_id)
                      .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
        lifecycle.requeue_stale(db, 30, 3)
    job = job_row(db, job_id)
    assert job.state == "failed" and "started 3 times" in job.error


def test_a_long_queued_job_gets_its_message_again(env):
    settings, db, _, _, new_job = env
    job_id = new_job()
    assert lifecycle.resend_queued(db, 60) == []
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id)
                  .values(enqueued_at=utcnow() - timedelta(seconds=120)))
    assert lifecycle.resend_queued(db, 60) == [job_id]
    assert lifecycle.resend_queued(db, 60) == []  # once per period


def test_the_task_retries_transient_failures_with_backoff(env, monkeypatch):
    settings, db, _, _, new_job = env
    from workers import tasks
    from workers.app import app

    monkeypatch.setattr(app, "kiln_settings", settings)
    monkeypatch.setattr(tasks, "_db", lambda: db)
    real_run_job, calls = tasks.run_job, []

    def flaky(settings, db, job_id, worker):
        calls.append(job_id)
        if len(calls) < 3:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        return real_run_job(settings, db, job_id, worker)

    monkeypatch.setattr(tasks, "run_job", flaky)
    job_id = new_job(partitioner="none")
    assert tasks.compile_job.apply(args=[job_id]).get() == "succeeded"
    assert len(calls) == 3 and job_row(db, job_id).state == "succeeded"

    def down(settings, db, job_id, worker):
        calls.append(job_id)
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(tasks, "run_job", down)
    calls.clear()
    job_id = new_job()
    result = tasks.compile_job.apply(args=[job_id])
    assert result.failed() and len(calls) == tasks.compile_job.max_retries + 1
    job = job_row(db, job_id)
    assert job.state == "failed" and "gave up after" in job.error and "connection refused" in job.error
