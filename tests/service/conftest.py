"""Fixtures of the service tests: an in-process app on a fresh SQLite (or PostgreSQL) database."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pathlib import Path

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

from service.app import create_app
from service.db import database
from service.migrate import upgrade
from service.settings import Settings
from service.tenants.service import create_key, create_tenant
from tests.service.stack import create_database, drop_database, postgres_available


class RecordingDispatcher:
    """Stands in for the broker in API tests: remembers what would have been queued."""

    def __init__(self):
        self.enqueued: list[str] = []
        self.revoked: list[str] = []
        self.fail = False

    def enqueue(self, job_id: str) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.enqueued.append(job_id)

    def enqueue_profile(self, run_id: str) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.enqueued.append(f"profile-{run_id}")

    def revoke(self, job_id: str) -> None:
        self.revoked.append(job_id)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'kiln.sqlite'}"
        return
    if not postgres_available():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is needed")
    url = create_database()
    try:
        yield url
    finally:
        from service.db import _databases

        db = _databases.pop(url, None)
        if db is not None:
            db.dispose()
        drop_database(url)


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", max_upload_bytes=1 << 20)


@contextmanager
def two_tenant_app(settings, **client_options) -> Iterator[tuple]:
    """(TestClient, database, keys by tenant, dispatcher): the app on a fresh database with the
    tenants acme and globex, queueing into a RecordingDispatcher."""
    upgrade(settings.database_url)
    db = database(settings.database_url)
    keys = {}
    for name in ("acme", "globex"):
        create_tenant(db, name)
        keys[name] = create_key(db, name)
    app = create_app(settings)
    app.state.dispatcher = RecordingDispatcher()
    with TestClient(app, raise_server_exceptions=False, **client_options) as client:
        yield client, db, keys, app.state.dispatcher


@pytest.fixture
def api(settings):
    """(TestClient, settings, dispatcher, keys by tenant) on a fresh SQLite database."""
    with two_tenant_app(settings) as (client, _db, keys, dispatcher):
        client.headers["Authorization"] = f"Bearer {keys['acme']}"
        yield client, settings, dispatcher, keys


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def add_model(op_type: str = "Relu", symbolic: bool = False) -> onnx.ModelProto:
    dims = ["batch", 4] if symbolic else [2, 4]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    node = helper.make_node(op_type, ["x"], ["y"], name="n0")
    graph = helper.make_graph([node], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def external_data_model(location: str) -> onnx.ModelProto:
    """x + w, with w's bytes in an external file at `location`."""
    w = numpy_helper.from_array(np.ones((2, 4), np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "32")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def finish_job(settings: Settings, job_id: str, artifact: bytes = b"kiln artifact") -> Path:
    """Run a queued job to success through the worker's own lifecycle; return its artifact."""
    from service.jobs import lifecycle
    from service.storage import Storage, file_sha256

    db, storage = database(settings.database_url), Storage(settings.storage_root)
    claim = lifecycle.claim(db, job_id, "test-worker", stale_after=60, max_attempts=3)
    built = storage.temp_dir("built-") / "model.kiln"
    built.write_bytes(artifact)
    assert lifecycle.succeed(db, storage, claim, built, {"model": "m"}, {"build": 0.1},
                             file_sha256(built))
    return storage.resolve(storage.artifact_relpath(job_id))
