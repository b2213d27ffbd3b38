"""What a job shows while it waits and runs (issue 14, item 14): its place in the queue, and
progress within a long stage as the worker records it; `kiln submit --wait` draws both."""
from __future__ import annotations

import json


from service.client import describe_progress
from service.db import database
from service.jobs import lifecycle
from tests.service.conftest import add_model


def _job(client, model_id: str) -> dict:
    response = client.post("/v1/jobs", json={"model_id": model_id})
    assert response.status_code == 202, response.text
    return response.json()


def test_queue_position_and_step_in_job_status(api):
    client, settings, _, keys = api
    model = client.post("/v1/models", content=add_model().SerializeToString(),
                        params={"filename": "relu.onnx"},
                        headers={"Content-Type": "application/octet-stream"}).json()
    first, second = _job(client, model["id"]), _job(client, model["id"])
    client.headers["Authorization"] = f"Bearer {keys['globex']}"  # another tenant's job counts
    other = client.post("/v1/models", content=add_model("Sigmoid").SerializeToString(),
                        params={"filename": "sig.onnx"},
                        headers={"Content-Type": "application/octet-stream"}).json()
    third = _job(client, other["id"])
    client.headers["Authorization"] = f"Bearer {keys['acme']}"
    shown = [client.get(f"/v1/jobs/{j['id']}").json() for j in (first, second)]
    assert [j["queue_position"] for j in shown] == [1, 2]
    assert describe_progress(shown[0]) == "queued (next)"
    assert describe_progress(shown[1]) == "queued (1 job ahead)"

    db = database(settings.database_url)
    claim = lifecycle.claim(db, first["id"], "w1", 30, 3)
    assert lifecycle.record_stage(db, first["id"], claim.attempt, "plan", {"load": 0.1})
    assert lifecycle.record_progress(db, first["id"], claim.attempt, "plan", 12, 38,
                                     "measuring kernel fused_matmul_add")
    running = client.get(f"/v1/jobs/{first['id']}").json()
    assert running["queue_position"] is None
    assert running["step"] == {"done": 12, "total": 38, "text": "measuring kernel fused_matmul_add"}
    assert running["progress"] == 30 + 4 * 12 // 38
    assert describe_progress(running) == "running plan: measuring kernel fused_matmul_add (12/38)"
    assert client.get(f"/v1/jobs/{second['id']}").json()["queue_position"] == 1
    assert third["id"] not in {j["id"] for j in client.get("/v1/jobs").json()}

    assert lifecycle.record_progress(db, first["id"], claim.attempt, "plan", 40, 0, "latency")
    assert describe_progress(client.get(f"/v1/jobs/{first['id']}").json()) == \
        "running plan: latency (40)"  # no total known ahead: a count

    with client.stream("GET", f"/v1/jobs/{second['id']}/events") as events:  # the SSE shows it
        for line in events.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["queue_position"] == 1
                break


def test_step_text_is_bounded(api):
    client, settings, _, _ = api
    model = client.post("/v1/models", content=add_model().SerializeToString(),
                        params={"filename": "relu.onnx"},
                        headers={"Content-Type": "application/octet-stream"}).json()
    job = _job(client, model["id"])
    db = database(settings.database_url)
    claim = lifecycle.claim(db, job["id"], "w1", 30, 3)
    assert lifecycle.record_progress(db, job["id"], claim.attempt, "tune", 50, 3, "k" * 1000)
    shown = client.get(f"/v1/jobs/{job['id']}").json()
    assert shown["step"] == {"done": 3, "total": 3, "text": "k" * lifecycle.STEP_TEXT_MAX}
    assert shown["progress"] == 44  # tune's last step: just below codegen's 45
