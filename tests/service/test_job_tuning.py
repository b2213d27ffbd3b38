"""Jobs that ask for schedule tuning (`tune`, `tune_budget_s`) on SQLite and PostgreSQL.

The worker runs the real compiler and the real tuner (kiln.tune) on the tiny BERT with a budget
of a few seconds; its measurements must land in the service's profile database. Profile misses of
the planner are answered by the cost model here (measure_local=False), so every profile entry
these tests find was written by the tuner.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import select

from service.db import database
from service.jobs import service as jobs
from service.jobs.schemas import JobCreate, job_out
from service.jobs.tables import Job
from service.migrate import upgrade
from service.models.tables import ModelRecord
from service.profiles.measure import local_facts
from service.profiles.tables import ProfileEntry
from service.settings import Settings
from service.storage import Storage
from service.tenants.service import create_tenant
from tests.runtime.handmade import mlp
from workers.compile import run_job
from workers.profile_store import DatabaseProfileStore

TINYBERT = Path(__file__).resolve().parents[1] / "fixtures" / "zoo" / "tinybert.onnx"
BUDGET_S = 10.0  # 3 s measured nothing when the machine was loaded (building the candidates ate it)


@pytest.fixture
def env(database_url, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url,
                        heartbeat_seconds=0.2, stale_after_seconds=30, measure_local=False)
    upgrade(database_url)
    db = database(database_url)
    storage = Storage(settings.storage_root)
    tenant = create_tenant(db, "acme")
    data = TINYBERT.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    source = tmp_path / TINYBERT.name
    source.write_bytes(data)
    storage.install_model(source, sha)
    with db.write() as s:
        model = ModelRecord(tenant_id=tenant.id, sha256=sha, size_bytes=len(data),
                            filename=TINYBERT.name, opset=14,
                            inputs=[{"name": n, "dtype": "int64", "shape": [1, 16]}
                                    for n in ("input_ids", "attention_mask")])
        s.add(model)
    return settings, db, storage, tenant.id, model.id


def profile_entries(db) -> list[ProfileEntry]:
    with db.read() as s:
        return list(s.scalars(select(ProfileEntry)))


def test_a_tuned_job_records_the_tuners_measurements(env):
    settings, db, _, tenant, model_id = env
    assert profile_entries(db) == []
    job = jobs.create(db, tenant, JobCreate(model_id=model_id, tune="quick",
                                            tune_budget_s=BUDGET_S))
    assert run_job(settings, db, job.id, "w1") == "succeeded"
    with db.read() as s:
        row = s.get(Job, job.id)
    assert (row.state, row.tune, row.tune_budget_s) == ("succeeded", "quick", BUDGET_S)
    shown = job_out(row)
    assert (shown.tune, shown.tune_budget_s) == ("quick", BUDGET_S)
    assert "tune" in row.stage_seconds

    tuning = row.report["tuning"]
    assert tuning["mode"] == "quick" and tuning["budget_s"] == BUDGET_S
    assert tuning["measured"] >= 1, tuning

    # Every measured kernel is a profile entry of this machine, keyed by the tuner's schedule
    # (its overrides plus the kernel's source hash and the thread count).
    entries = profile_entries(db)
    assert len(entries) == tuning["measured"]
    here = local_facts().fingerprint
    for entry in entries:
        assert entry.device_fingerprint == here and entry.source == "measured"
        assert '"kernel":' in entry.schedule and '"threads":' in entry.schedule
        assert entry.n >= 1 and entry.median_s > 0
    tuned_groups = {g["signature"] for g in tuning["groups"] if g["measured"]}
    assert {e.signature[:16] for e in entries} == tuned_groups


def test_an_untuned_job_measures_nothing(env):
    settings, db, _, tenant, model_id = env
    job = jobs.create(db, tenant, JobCreate(model_id=model_id))
    assert run_job(settings, db, job.id, "w1") == "succeeded"
    with db.read() as s:
        row = s.get(Job, job.id)
    assert (row.tune, row.tune_budget_s) == ("reuse", None)
    assert "tuning" not in row.report  # the default reuses tuned schedules; there were none
    assert profile_entries(db) == []


def test_tuning_measurements_belong_to_this_machine_whatever_the_target(env):
    """kiln.tune measures on the worker's CPU: a tuned x86_64 (or aarch64) compile records under
    this machine's fingerprint, even with no agent device of that architecture online."""
    settings, db, storage, _, _ = env
    graph = mlp().plan.graph
    for target, seconds in (("x86_64", 3e-6), ("aarch64", 1e-6)):
        store = DatabaseProfileStore(db, storage, settings, target)
        assert store.fingerprint is None  # no agent device of that architecture is online
        store.record(graph, ["op0"], [seconds], schedule={"kernel": target, "threads": 1})
    assert {e.device_fingerprint for e in profile_entries(db)} == {local_facts().fingerprint}
    for target in ("host", "x86_64"):
        store = DatabaseProfileStore(db, storage, settings, target)
        assert [s["kernel"] for s, _ in store.schedules(graph, ["op0"])] == ["aarch64", "x86_64"]
