"""The API in-process (real SQLite, real frontend validation; the broker is recorded)."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from sqlalchemy import func, select

from kiln.frontend import MAX_TENSOR_ELEMENTS

from service.db import database
from service.jobs.tables import Job
from service.models.tables import ModelRecord
from tests.service.conftest import add_model, external_data_model, save

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
PROBLEM = "application/problem+json"


def upload(client, data, filename: str = "m.onnx", headers: dict | None = None):
    return client.post("/v1/models", content=data, params={"filename": filename},
                       headers={"Content-Type": "application/octet-stream", **(headers or {})})


def stored_nothing(settings) -> None:
    storage = settings.storage_root
    assert not any((storage / "models").iterdir()), "no model file may be stored"
    assert not any((storage / "tmp").iterdir()), "no temporary file may be left"
    assert not any((storage / "artifacts").iterdir())
    with database(settings.database_url).read() as s:
        assert s.scalar(select(func.count()).select_from(ModelRecord)) == 0
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def refused(response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["status"] == status and body["title"]
    for word in words:
        assert word in body["detail"], body["detail"]


def test_upload_validates_and_stores_once(api):
    client, settings, _, keys = api
    data = (ZOO / "tinybert.onnx").read_bytes()
    first = upload(client, data, "tinybert.onnx")
    assert first.status_code == 201
    model = first.json()
    assert model["filename"] == "tinybert.onnx" and model["size_bytes"] == len(data)
    assert model["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": [1, 16]}
    again = upload(client, data, "copy.onnx")
    assert again.status_code == 200 and again.json()["id"] == model["id"]
    other = upload(client, data, headers={"Authorization": f"Bearer {keys['globex']}"})
    assert other.status_code == 201 and other.json()["id"] != model["id"]
    files = list((settings.storage_root / "models").rglob("*.onnx"))
    assert len(files) == 1 and files[0].read_bytes() == data
    assert not any((settings.storage_root / "tmp").iterdir())


def test_not_onnx(api):
    client, settings, _, _ = api
    refused(upload(client, b"hello, this is not a model" * 10), 422, "not a valid ONNX model")
    stored_nothing(settings)


def test_truncated_file(api):
    client, settings, _, _ = api
    data = (ZOO / "tinybert.onnx").read_bytes()
    refused(upload(client, data[: len(data) // 2]), 422, "m.onnx")
    stored_nothing(settings)


def test_over_the_size_limit(api):
    client, settings, _, _ = api
    data = (ZOO / "tinybert.onnx").read_bytes()
    assert len(data) > settings.max_upload_bytes / 4
    big = data * 3  # over the 1 MiB limit of the fixture
    refused(upload(client, big), 413, "size limit", str(settings.max_upload_bytes))

    def chunks():  # no Content-Length: refused while streaming
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    refused(upload(client, chunks()), 413, "size limit")
    stored_nothing(settings)


def test_external_data_escaping_its_folder(api, tmp_path):
    client, settings, _, _ = api
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 64)
    for location in ("../../secret.bin", str(secret)):
        data = save(external_data_model(location), tmp_path / "m.onnx").read_bytes()
        refused(upload(client, data), 422, "points outside the model's folder")
    data = save(external_data_model("weights.bin"), tmp_path / "m.onnx").read_bytes()
    refused(upload(client, data), 422, "weights.bin", "missing")
    stored_nothing(settings)


def test_unknown_op(api, tmp_path):
    client, settings, _, _ = api
    data = save(add_model("FrobnicateAll"), tmp_path / "m.onnx").read_bytes()
    refused(upload(client, data), 422, "unsupported operators", "FrobnicateAll")
    stored_nothing(settings)


def test_form_and_empty_uploads(api):
    client, settings, _, _ = api
    response = client.post("/v1/models", files={"file": ("m.onnx", b"abc")})
    refused(response, 415, "raw request body")
    refused(upload(client, b""), 422, "empty")
    stored_nothing(settings)


@pytest.mark.parametrize("headers, words", [
    ({"Authorization": ""}, ("missing API key",)),
    ({"Authorization": "Bearer kiln_0123456789ab_wrong"}, ("invalid",)),
    ({"Authorization": "Basic dXNlcjpwYXNz"}, ("missing API key",)),
    ({"Authorization": "", "X-API-Key": "not-a-key"}, ("invalid",)),
])
def test_missing_or_wrong_key(api, headers, words):
    client, settings, _, _ = api
    data = (ZOO / "lstm.onnx").read_bytes()
    for response in (upload(client, data, headers=headers),
                     client.get("/v1/jobs", headers=headers),
                     client.post("/v1/jobs", json={"model_id": "x"}, headers=headers)):
        refused(response, 401, *words)
        assert response.headers["www-authenticate"].startswith("Bearer")
    stored_nothing(settings)


def test_key_in_x_api_key_header(api):
    client, _, _, keys = api
    response = client.get("/v1/jobs", headers={"Authorization": "", "X-API-Key": keys["acme"]})
    assert response.status_code == 200 and response.json() == []


def test_keys_are_stored_hashed(api):
    from service.tenants.tables import ApiKey

    _, settings, _, keys = api
    with database(settings.database_url).read() as s:
        rows = [(k.prefix, k.key_hash) for k in s.scalars(select(ApiKey))]
    assert len(rows) == 2
    stored = " ".join(f"{p} {h}" for p, h in rows)
    for key in keys.values():
        assert key not in stored and key.split("_", 2)[2] not in stored


def _model_id(client, name: str = "tinybert") -> str:
    return upload(client, (ZOO / f"{name}.onnx").read_bytes(), f"{name}.onnx").json()["id"]


def test_create_job_queues_it(api):
    client, _, dispatcher, _ = api
    model_id = _model_id(client)
    response = client.post("/v1/jobs", json={"model_id": model_id, "target": "aarch64",
                                             "partitioner": "fixed"})
    assert response.status_code == 202
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued" and job["progress"] == 0 and job["target"] == "aarch64"
    assert dispatcher.enqueued == [job["id"]]
    assert client.get(f"/v1/jobs/{job['id']}").json()["partitioner"] == "fixed"
    assert [j["id"] for j in client.get("/v1/jobs", params={"state": "queued"}).json()] == [job["id"]]
    assert client.get("/v1/jobs", params={"state": "failed"}).json() == []


@pytest.mark.parametrize("body, words", [
    ({"target": "riscv"}, ("target", "unknown target 'riscv'", "host, x86_64, aarch64")),
    ({"partitioner": "magic"}, ("partitioner", "unknown partitioner 'magic'", "dnnfusion")),
    ({"shapes": {"nope": [1, 2]}}, ("no input 'nope'",)),
    ({"shapes": {"input_ids": [1]}}, ("rank 2",)),
    ({"shapes": {"input_ids": [1, 17]}}, ("fixed at 16",)),
    ({"shapes": {"input_ids": [0, 16]}}, ("must be positive",)),
    ({"colour": "blue"}, ("colour",)),
    ({"tune": "turbo"}, ("tune", "unknown tuning mode 'turbo'", "off, reuse, quick, full")),
    ({"tune": "quick", "tune_budget_s": 0}, ("tune_budget_s", "positive", "not 0")),
    ({"tune": "quick", "tune_budget_s": -5}, ("tune_budget_s", "positive", "not -5")),
    ({"tune": "quick", "tune_budget_s": 3601}, ("tune_budget_s", "at most 3600", "3601")),
    ({"tune": "quick", "tune_budget_s": True}, ("tune_budget_s", "not True")),
    ({"tune": "quick", "tune_budget_s": "soon"}, ("tune_budget_s", "number")),
])
def test_invalid_job_options(api, body, words):
    client, settings, dispatcher, _ = api
    model_id = _model_id(client)
    refused(client.post("/v1/jobs", json={"model_id": model_id} | body), 422, *words)
    assert dispatcher.enqueued == []
    with database(settings.database_url).read() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_create_job_with_tuning(api):
    client, settings, dispatcher, _ = api
    model_id = _model_id(client)
    plain = client.post("/v1/jobs", json={"model_id": model_id}).json()
    assert (plain["tune"], plain["tune_budget_s"]) == ("reuse", None)
    response = client.post("/v1/jobs", json={"model_id": model_id, "tune": "quick",
                                             "tune_budget_s": 2.5})
    assert response.status_code == 202, response.text
    job = response.json()
    assert (job["tune"], job["tune_budget_s"]) == ("quick", 2.5)
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert (got["tune"], got["tune_budget_s"]) == ("quick", 2.5)
    listed = {j["id"]: (j["tune"], j["tune_budget_s"]) for j in client.get("/v1/jobs").json()}
    assert listed == {plain["id"]: ("reuse", None), job["id"]: ("quick", 2.5)}
    with database(settings.database_url).read() as s:
        row = s.get(Job, job["id"])
        assert (row.tune, row.tune_budget_s) == ("quick", 2.5)
    assert dispatcher.enqueued == [plain["id"], job["id"]]


def test_kiln_submit_and_the_client_send_tuning(api, monkeypatch, capsys):
    from kiln.cli import main
    from service.cli import jobs as cli
    from service.client import KilnClient

    client, _, _, _ = api
    kiln_client = KilnClient("http://testserver", None, http=client)
    monkeypatch.setattr(kiln_client, "close", lambda: None)  # the fixture closes the TestClient
    monkeypatch.setattr(cli, "client_from", lambda args: kiln_client)
    assert main(["submit", str(ZOO / "tinybert.onnx"), "--tune", "quick",
                 "--tune-budget", "30"]) == 0
    out, err = capsys.readouterr()
    assert "tune quick" in err
    job = kiln_client.job(out.strip())
    assert (job["tune"], job["tune_budget_s"]) == ("quick", 30.0)
    job = kiln_client.submit(job["model_id"], tune="full", tune_budget_s=7)
    assert (job["tune"], job["tune_budget_s"]) == ("full", 7.0)
    assert (kiln_client.submit(job["model_id"])["tune"]) == "reuse"


def test_symbolic_dimensions_need_shapes(api, tmp_path):
    client, _, dispatcher, _ = api
    data = save(add_model("Relu", symbolic=True), tmp_path / "m.onnx").read_bytes()
    model = upload(client, data).json()
    assert model["inputs"][0]["shape"] == ["batch", 4]
    refused(client.post("/v1/jobs", json={"model_id": model["id"]}), 422, "'batch'", "shapes")
    ok = client.post("/v1/jobs", json={"model_id": model["id"], "shapes": {"x": [3, 4]}})
    assert ok.status_code == 202 and dispatcher.enqueued == [ok.json()["id"]]


def test_another_tenants_things_are_not_found(api):
    client, _, dispatcher, keys = api
    model_id = _model_id(client)
    job_id = client.post("/v1/jobs", json={"model_id": model_id}).json()["id"]
    other = {"Authorization": f"Bearer {keys['globex']}"}
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/artifact", f"/v1/jobs/{job_id}/report",
                 f"/v1/jobs/{job_id}/events", f"/v1/models/{model_id}"):
        refused(client.get(path, headers=other), 404, "no ")
    refused(client.post(f"/v1/jobs/{job_id}/cancel", headers=other), 404, job_id)
    refused(client.post("/v1/jobs", json={"model_id": model_id}, headers=other), 404, model_id)
    assert client.get("/v1/jobs", headers=other).json() == []
    assert client.get("/v1/models", headers=other).json() == []
    assert client.get(f"/v1/jobs/{job_id}").status_code == 200
    assert dispatcher.revoked == []


def test_cancel_and_not_ready_results(api):
    client, _, dispatcher, _ = api
    job_id = client.post("/v1/jobs", json={"model_id": _model_id(client)}).json()["id"]
    refused(client.get(f"/v1/jobs/{job_id}/artifact"), 409, "queued")
    refused(client.get(f"/v1/jobs/{job_id}/report"), 409, "queued")
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 202 and response.json()["state"] == "cancelled"
    assert dispatcher.revoked == [job_id]
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    assert dispatcher.revoked == [job_id]
    events = client.get(f"/v1/jobs/{job_id}/events")
    assert events.headers["content-type"].startswith("text/event-stream")
    assert "event: job" in events.text and "event: end" in events.text


def test_broker_down_leaves_no_job(api):
    client, settings, dispatcher, _ = api
    model_id = _model_id(client)
    dispatcher.fail = True
    refused(client.post("/v1/jobs", json={"model_id": model_id}), 503, "broker")
    with database(settings.database_url).read() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_unknown_routes_are_problems(api):
    client, _, _, _ = api
    refused(client.get("/v1/nothing"), 404, "Not Found")
    refused(client.delete("/v1/jobs"), 405, "Method Not Allowed")
    refused(client.get("/v1/jobs/nope"), 404, "nope")


def test_offsets_past_64_bits_are_refused(api):
    client, _, _, _ = api
    for path in ("/v1/jobs", "/v1/models"):
        assert client.get(path, params={"offset": 2**63 - 1}).json() == []
        for offset in (2**63, 10**30):
            refused(client.get(path, params={"offset": offset}), 422, "offset")


def test_an_artifact_missing_from_storage_is_gone(api):
    from tests.service.conftest import finish_job

    client, settings, _, _ = api
    job_id = client.post("/v1/jobs", json={"model_id": _model_id(client)}).json()["id"]
    stored = finish_job(settings, job_id, b"compiled")
    assert client.get(f"/v1/jobs/{job_id}/artifact").content == b"compiled"
    stored.unlink()
    refused(client.get(f"/v1/jobs/{job_id}/artifact"), 410, job_id, "no longer stored")
    assert client.get(f"/v1/jobs/{job_id}/report").status_code == 200
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded"


def test_profiling_a_missing_or_damaged_artifact_says_so(api):
    """The OpenAPI fuzz test found a 500: POST /v1/jobs/{id}/profile opened the stored artifact
    as a zip without checking it is there and readable."""
    from tests.service.conftest import finish_job

    client, settings, _, _ = api
    job_id = client.post("/v1/jobs", json={"model_id": _model_id(client)}).json()["id"]
    stored = finish_job(settings, job_id, b"not a kiln archive")
    refused(client.post(f"/v1/jobs/{job_id}/profile", json={}), 409, job_id, "cannot be read")
    stored.unlink()
    refused(client.post(f"/v1/jobs/{job_id}/profile", json={}), 410, job_id, "no longer stored")


def _with_input_dims(dims: list) -> onnx.ModelProto:
    model = add_model("Relu")
    for value in (model.graph.input[0], model.graph.output[0]):
        del value.type.tensor_type.shape.dim[:]
        for d in dims:
            value.type.tensor_type.shape.dim.add().dim_value = d
    return model


@pytest.mark.parametrize("dims, words", [
    ([-5, 4], ("'x'", "-5", "positive")),
    ([0, 4], ("'x'", "0", "positive")),
    ([1 << 20, 1 << 20], ("'x'", "elements", str(MAX_TENSOR_ELEMENTS))),
])
def test_inputs_with_impossible_declared_dims_are_refused(api, tmp_path, dims, words):
    client, settings, _, _ = api
    data = save(_with_input_dims(dims), tmp_path / "m.onnx").read_bytes()
    refused(upload(client, data), 422, *words)
    stored_nothing(settings)


def test_external_data_is_refused_at_upload(api, tmp_path):
    """An upload is one file: external data never reaches the worker, even data in the model's
    own file or under keys onnx does not know."""
    client, settings, _, _ = api
    itself = external_data_model("m.onnx")
    refused(upload(client, save(itself, tmp_path / "m.onnx").read_bytes()), 422, "'w'",
            "external")
    unknown = external_data_model("m.onnx")
    entry = unknown.graph.initializer[0].external_data.add()
    entry.key, entry.value = "colour", "blue"
    refused(upload(client, save(unknown, tmp_path / "m.onnx").read_bytes()), 422, "external")
    stored_nothing(settings)


def test_job_shapes_are_bounded_like_the_compiler(api, tmp_path):
    client, settings, dispatcher, _ = api
    model_id = upload(client, save(add_model("Relu", symbolic=True), tmp_path / "m.onnx")
                      .read_bytes()).json()["id"]
    for batch in (10**30, MAX_TENSOR_ELEMENTS):
        refused(client.post("/v1/jobs", json={"model_id": model_id, "shapes": {"x": [batch, 4]}}),
                422, "'x'", str(MAX_TENSOR_ELEMENTS))
    assert dispatcher.enqueued == []
    ok = client.post("/v1/jobs", json={"model_id": model_id, "shapes": {"x": [3, 4]}})
    assert ok.status_code == 202


def test_a_stored_negative_dimension_is_not_called_symbolic(api, tmp_path):
    """A model recorded before uploads checked their dims: the job is refused as invalid."""
    client, settings, _, _ = api
    model_id = _model_id(client)
    with database(settings.database_url).write() as s:
        s.get(ModelRecord, model_id).inputs = [{"name": "input_ids", "dtype": "int64",
                                                "shape": [-5, 16]}]
    response = client.post("/v1/jobs", json={"model_id": model_id})
    refused(response, 422, "'input_ids'", "-5", "invalid")
    assert "symbolic" not in response.json()["detail"]


def test_idempotency_key_makes_one_job_per_key_and_tenant(api):
    client, _, dispatcher, keys = api
    model_id = _model_id(client)
    body = {"model_id": model_id, "partitioner": "fixed"}
    once = {"Idempotency-Key": "build-42"}
    replies = [client.post("/v1/jobs", json=body, headers=once) for _ in range(4)]
    assert all(r.status_code == 202 for r in replies), replies[-1].text
    assert len({r.json()["id"] for r in replies}) == 1
    assert dispatcher.enqueued == [replies[0].json()["id"]]
    assert replies[-1].headers["Idempotent-Replayed"] == "true"
    refused(client.post("/v1/jobs", json=body | {"partitioner": "none"}, headers=once), 422,
            "Idempotency-Key", "build-42")
    globex = {"Authorization": f"Bearer {keys['globex']}"}
    other_model = upload(client, (ZOO / "tinybert.onnx").read_bytes(), headers=globex).json()["id"]
    theirs = client.post("/v1/jobs", json={"model_id": other_model}, headers=globex | once)
    assert theirs.status_code == 202 and theirs.json()["id"] != replies[0].json()["id"]
    plain = [client.post("/v1/jobs", json=body).json()["id"] for _ in range(2)]
    assert len(set(plain)) == 2 and len(dispatcher.enqueued) == 4
    refused(client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "x" * 201}), 422,
            "Idempotency-Key")
