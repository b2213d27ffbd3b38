"""Property-based test of the OpenAPI spec (schemathesis): no request to a user or agent route gets
a 5xx. The app runs in-process on a real SQLite database with real models, jobs, an artifact and a
registered device; generated ids are sometimes replaced by those real ones so that the handlers
behind the 404s are reached too. Fixed seed (derandomize) and a bounded example count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from device_agents import protocol as p
from service.app import create_app
from service.db import database, utcnow
from service.devices import service as devices
from service.jobs.tables import SUCCEEDED, Artifact, Job
from service.migrate import upgrade
from service.settings import Settings
from service.storage import Storage
from service.tenants.service import create_key, create_tenant
from tests.service.conftest import RecordingDispatcher
from tests.service.test_agents_api import FACTS, add_task

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
EXAMPLES = 30


@pytest.fixture(scope="module")
def service_state(tmp_path_factory):
    """(app, user key, agent token, real ids by path parameter name)."""
    from fastapi.testclient import TestClient

    settings = Settings(data_dir=tmp_path_factory.mktemp("fuzz") / "data", max_upload_bytes=1 << 20,
                        rate_limit_per_second=0)  # every generated request must reach its route
    upgrade(settings.database_url)
    db = database(settings.database_url)
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    _agent, token = devices.create_agent(db, "lab-1")
    app = create_app(settings)
    app.state.dispatcher = RecordingDispatcher()
    with TestClient(app) as client:
        user = {"Authorization": f"Bearer {key}"}
        model = client.post("/v1/models", content=(ZOO / "tinybert.onnx").read_bytes(),
                            headers=user | {"Content-Type": "application/octet-stream"}).json()
        queued = client.post("/v1/jobs", json={"model_id": model["id"]}, headers=user).json()
        done = client.post("/v1/jobs", json={"model_id": model["id"]}, headers=user).json()
        registration = p.DeviceRegistration(name="local", transport="local", facts=FACTS,
                                            fingerprint=FACTS.fingerprint, agent_version="test")
        device = client.post(p.REGISTER_PATH, json=json.loads(registration.model_dump_json()),
                             headers={"Authorization": f"Bearer {token}"}).json()["device_id"]
    _succeed(db, Storage(settings.storage_root), done["id"])
    task = add_task(db)
    ids = {"model_id": [model["id"]], "job_id": [queued["id"], done["id"]], "task_id": [task],
           "device_id": [device]}
    return app, key, token, ids


def _succeed(db, storage: Storage, job_id: str) -> None:
    """Make a job succeeded with a stored artifact, as a worker would."""
    path = storage.resolve(storage.artifact_relpath(job_id))
    path.write_bytes(b"artifact")
    with db.write() as s:
        job = s.get(Job, job_id)
        job.state, job.progress, job.finished_at, job.report = SUCCEEDED, 100, utcnow(), {}
        s.add(Artifact(job_id=job_id, tenant_id=job.tenant_id, path=storage.artifact_relpath(job_id),
                       sha256="0" * 64, size_bytes=8))


@pytest.fixture(scope="module")
def api_schema(service_state):
    app, _key, _token, ids = service_state
    schema = schemathesis.openapi.from_asgi("/v1/openapi.json", app)

    @schema.hook
    def flatmap_path_parameters(context, parameters):
        real = {name: ids[name] for name in parameters or {} if name in ids}
        if not real:
            return st.just(parameters)
        return st.one_of(st.just(parameters), st.fixed_dictionaries(
            {name: st.sampled_from(real[name]) if name in real else st.just(value)
             for name, value in parameters.items()}))

    @schema.hook
    def flatmap_body(context, body):
        if isinstance(body, dict) and "model_id" in body:
            return st.sampled_from([body, body | {"model_id": ids["model_id"][0]}])
        if isinstance(body, dict) and "device_id" in body:
            return st.sampled_from([body, body | {"device_id": ids["device_id"][0]}])
        return st.just(body)

    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case, service_state):
    _app, key, token, _ids = service_state
    secret = token if case.path.startswith(p.PREFIX) else key
    response = case.call(headers={"Authorization": f"Bearer {secret}"})
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
        f"{case.as_curl_command()}")
