"""Devices, profiles, plans and profile jobs against the real service, embedded and scale-out.

One stack per mode (module-scoped): a model is compiled once, then profiled on a real agent's
local device (`kiln-agent --once`) and on the worker's own CPU. Latencies are checked against the
artifact the service returns (its kernels, its memory plan), tenancy against a second tenant.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from io import BytesIO

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_agents import protocol as p
from device_agents.facts import HardwareFacts
from tests.service.stack import (
    REPO,
    EmbeddedStack,
    ScaleOutStack,
    create_database,
    drop_database,
    kiln_cli,
    postgres_available,
    redis_available,
)

PHONE = HardwareFacts(kind="phone", arch="aarch64", abi="arm64-v8a", os="Android 14 (API 34)",
                      device_model="Google Pixel 7", cpu_model="Tensor G2", logical_cores=8,
                      isa=("dotprod", "fp16", "neon"))


def mlp_model() -> onnx.ModelProto:
    """x·W1 + b1 → Relu → ·W2 + b2 → Sigmoid: blocks, edges and yellow lookups to look at."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 8)), ("b2", (8,)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
             helper.make_node("Relu", ["h1"], ["h2"], name="<script>alert(1)</script>"),
             helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="mm2"),
             helper.make_node("Add", ["h3", "b2"], ["h4"], name="add2"),
             helper.make_node("Sigmoid", ["h4"], ["y"], name="sig")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, 16])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [4, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _accounts(url: str) -> tuple[str, str, str]:
    """Keys of the tenants acme and globex and the token of the agent "lab", written straight to
    the stack's database, as the `kiln admin` commands write them (those commands are tested by
    test_cli.py and test_agents_api.py; here, five command processes would only add startup
    time)."""
    from service.db import Database
    from service.devices.service import create_agent
    from service.tenants.service import create_key, create_tenant

    db = Database(url)
    try:
        keys = []
        for tenant in ("acme", "globex"):
            create_tenant(db, tenant)
            keys.append(create_key(db, tenant, "tests"))
        _agent, token = create_agent(db, "lab")
    finally:
        db.engine.dispose()
    return keys[0], keys[1], token


class Farm:
    """A running stack with two tenants, an agent token and one compiled job."""

    def __init__(self, stack, tmp):
        self.stack, self.tmp = stack, tmp
        self.url = stack.url
        self.key, self.other, self.token = _accounts(stack.database_url)
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {self.key}"})
        self.config = tmp / "agent.toml"
        self.config.write_text(f'server = "{self.url}"\ntoken = "{self.token}"\n'
                               f'work_dir = "{tmp / "agent"}"\nlocal_name = "bench-cpu"\n')
        data = BytesIO()
        onnx.save(mlp_model(), data)
        model = self.http.post("/v1/models", content=data.getvalue(),
                               params={"filename": "mlp.onnx"},
                               headers={"Content-Type": "application/octet-stream"}).json()
        job = self.http.post("/v1/jobs", json={"model_id": model["id"]}).json()
        self.job = self.wait_job(job["id"])
        assert self.job["state"] == "succeeded", self.job

    def wait_job(self, job_id: str) -> dict:
        from service.client import KilnClient

        with KilnClient(self.url, self.key) as client:
            return client.wait(job_id, timeout=180)

    def agent_once(self) -> None:
        done = subprocess.run([sys.executable, "-m", "device_agents.cli", "--config",
                               str(self.config), "--once"], cwd=REPO, env=self.stack.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]

    def register_phone(self) -> str:
        body = p.DeviceRegistration(name="pixel-7", transport="adb", address="10.0.0.7:5555",
                                    facts=PHONE, fingerprint=PHONE.fingerprint,
                                    agent_version="test")
        reply = httpx.post(f"{self.url}{p.REGISTER_PATH}", content=body.model_dump_json(),
                           headers={"Authorization": f"Bearer {self.token}",
                                    "Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text
        return reply.json()["device_id"]

    def artifact(self) -> tuple[dict, dict]:
        data = self.http.get(f"/v1/jobs/{self.job['id']}/artifact").content
        with zipfile.ZipFile(BytesIO(data)) as z:
            return json.loads(z.read("manifest.json")), json.loads(z.read("plan.json"))


@pytest.fixture(scope="module", params=["embedded", "scale-out"])
def farm(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        stack = EmbeddedStack(tmp / "stack", concurrency=1)
        url = None
    else:
        if not (postgres_available() and redis_available()):
            pytest.skip("PostgreSQL and Redis on this machine are needed")
        url = create_database()
        stack = ScaleOutStack(tmp / "stack", url, workers=1)
    try:
        stack.start()
        yield Farm(stack, tmp)
    finally:
        stack.stop()
        if url:
            drop_database(url)


def test_devices_filter_by_selector_terms_and_query_parameters(farm):
    phone = farm.register_phone()
    farm.agent_once()  # registers this machine as "bench-cpu"
    devices = farm.http.get("/v1/devices").json()
    by_name = {d["name"]: d for d in devices}
    assert {"pixel-7", "bench-cpu"} <= set(by_name)
    assert by_name["pixel-7"]["facts"]["device_model"] == "Google Pixel 7"
    assert by_name["pixel-7"]["features"] == ["dotprod", "fp16", "neon"]
    assert by_name["pixel-7"]["targets"] == ["aarch64"]  # no OpenCL device in its facts
    assert by_name["bench-cpu"]["agent"] == "lab" and by_name["bench-cpu"]["online"]

    def names(**params):
        reply = farm.http.get("/v1/devices", params=params)
        assert reply.status_code == 200, reply.text
        return {d["name"] for d in reply.json()}

    assert names(kind="phone", arch="aarch64", feature="neon", name="pixel") == {"pixel-7"}
    assert names(device="kind:phone,arch:aarch64,feature:neon,name:PIXEL") == {"pixel-7"}
    assert names(device="kind:phone,feature:sve") == set()
    assert "bench-cpu" in names(device="kind:cpu,transport:local")
    bad = farm.http.get("/v1/devices", params={"device": "chipset:snapdragon"})
    assert bad.status_code == 422 and "chipset" in bad.json()["detail"]
    one = farm.http.get(f"/v1/devices/{phone}").json()
    assert one["name"] == "pixel-7" and one["recent_tasks"] == []
    assert httpx.get(f"{farm.url}/v1/devices").status_code == 401  # the Bearer key only
    spec = httpx.get(f"{farm.url}/v1/openapi.json").json()
    assert {"/v1/devices", "/v1/devices/{device_id}", "/v1/profiles", "/v1/profiles/summary",
            "/v1/jobs/{job_id}/plan", "/v1/jobs/{job_id}/profile",
            "/v1/jobs/{job_id}/profile/{run_id}"} <= set(spec["paths"])
    assert not {p for p in spec["paths"] if not p.startswith("/v1/")}  # pages are not API
    # the farm is shared: another tenant sees the same devices
    other = httpx.get(f"{farm.url}/v1/devices", headers={"Authorization": f"Bearer {farm.other}"})
    assert {d["name"] for d in other.json()} == {d["name"] for d in devices}


def test_plan_graph_matches_the_artifact_and_is_the_tenants_own(farm):
    job_id = farm.job["id"]
    plan = farm.http.get(f"/v1/jobs/{job_id}/plan").json()
    manifest, artifact_plan = farm.artifact()
    # the blocks and their ops are the artifact's
    assert [(b["id"], [o["id"] for o in b["ops"]]) for b in artifact_plan["blocks"]] == \
        [(b["id"], b["ops"]) for b in plan["blocks"]]
    ops = {o["id"]: o for o in plan["ops"]}
    # the plan is of the rewritten graph: MatMul + Add became Gemm
    assert [o["type"] for o in plan["ops"]] == ["Gemm", "Relu", "Gemm", "Sigmoid"]
    assert "<script>alert(1)</script>" in {o["name"] for o in ops.values()}
    for edge in plan["edges"]:  # an edge is internal exactly when both ends share a block
        assert edge["internal"] == (ops[edge["from"]]["block"] == ops[edge["to"]]["block"])
    assert len(plan["edges"]) == 3  # a chain of four ops
    assert plan["decisions"] and all(d["reason"] for d in plan["decisions"])
    report = farm.http.get(f"/v1/jobs/{job_id}/report").json()
    assert "graph" not in report  # the plan lives apart from the report
    assert len(plan["lookups"]) >= report["yellow_lookups"]
    assert {x["source"] for x in plan["lookups"]} <= {"measured", "predicted", "cost-model"}
    other = httpx.get(f"{farm.url}/v1/jobs/{job_id}/plan",
                      headers={"Authorization": f"Bearer {farm.other}"})
    assert other.status_code == 404


def _check_run(run: dict, manifest: dict, runs: int, repeats: int) -> None:
    assert run["state"] == "succeeded", run
    result = run["result"]
    assert [(k["symbol"], k["block"]) for k in result["kernels"]] == \
        [(k["symbol"], k["block"]) for k in manifest["kernels"]]
    for k in result["kernels"]:
        assert 0 < k["p10_s"] <= k["median_s"] <= k["p90_s"] < 1.0
        assert k["n"] == runs * repeats and len(k["signature"]) == 64
    total = result["total"]
    assert 0 < total["min_s"] <= total["median_s"] <= total["max_s"]
    assert result["memory"]["peak_bytes"] == manifest["peak_memory_bytes"]
    # measured by the runner: the planned tensors plus its code and the C runtime, not gigabytes
    assert manifest["peak_memory_bytes"] < result["memory"]["measured_peak_rss_bytes"] < 1 << 30


def test_profile_job_on_an_agent_device_and_on_the_worker_cpu(farm):
    from service.client import KilnClient

    job_id = farm.job["id"]
    manifest, _ = farm.artifact()
    farm.agent_once()  # the local device is online
    client = KilnClient(farm.url, farm.key)
    run = client.profile(job_id, "name:bench-cpu,transport:local", runs=5, warmup=1, repeats=2)
    assert run["via"] == "agent" and run["state"] == "queued"
    farm.agent_once()  # claims and measures it
    run = client.wait_profile(job_id, run["id"], timeout=60)
    _check_run(run, manifest, 5, 2)
    assert run["result"]["device"]["name"] == "bench-cpu"

    worker = client.profile(job_id, "transport:worker", runs=4, warmup=0, repeats=1)
    assert worker["via"] == "worker"
    worker = client.wait_profile(job_id, worker["id"], timeout=120)
    _check_run(worker, manifest, 4, 1)
    assert worker["result"]["device"]["transport"] == "worker"
    listed = farm.http.get(f"/v1/jobs/{job_id}/profile").json()
    assert [r["id"] for r in listed[:2]] == [worker["id"], run["id"]]

    nowhere = farm.http.post(f"/v1/jobs/{job_id}/profile", json={"device": "kind:phone,os:ios"})
    assert nowhere.status_code == 202  # host target: the worker is asked, and says no
    failed = client.wait_profile(job_id, nowhere.json()["id"], timeout=60)
    assert failed["state"] == "failed" and "kind:phone,os:ios" in failed["error"]
    bad = farm.http.post(f"/v1/jobs/{job_id}/profile", json={"device": "colour:red"})
    assert bad.status_code == 422 and "colour" in bad.json()["detail"]

    # the kiln CLI prints the table
    out = kiln_cli({**farm.stack.env, "KILN_URL": farm.url, "KILN_API_KEY": farm.key},
                   "profile", job_id, "--device", "transport:worker", "--runs", "3",
                   "--repeats", "1", "--wait")
    assert manifest["kernels"][0]["symbol"] in out and "end to end: median" in out
    assert "peak resident memory (measured, the runner process):" in out

    # the kernels became profile entries of both device classes, linked to the tenant's job
    entries = farm.http.get("/v1/profiles", params={"job": job_id, "limit": 1000}).json()
    signatures = {k["signature"] for k in run["result"]["kernels"]}
    found = {(e["signature"], tuple(e["devices"])) for e in entries["entries"]}
    assert {sig for sig, _ in found} >= signatures
    by_device = farm.http.get("/v1/profiles", params={"device": "name:bench-cpu"}).json()
    assert by_device["total"] >= len(signatures)
    assert all("bench-cpu" in e["devices"] for e in by_device["entries"])
    measured = farm.http.get("/v1/profiles", params={"op_type": "Gemm"}).json()
    assert measured["entries"] and all("Gemm" in e["op_types"] for e in measured["entries"])
    other = httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.other}"})
    shared = other.get("/v1/profiles", params={"device": "name:bench-cpu"}).json()
    assert shared["total"] == by_device["total"]  # the library is shared …
    assert all(e["jobs"] == [] for e in shared["entries"])  # … its links to jobs are not
    assert other.get("/v1/profiles", params={"job": job_id}).status_code == 404
    assert other.get(f"/v1/jobs/{job_id}/profile").status_code == 404

    summary = farm.http.get("/v1/profiles/summary").json()
    assert summary["entries"] >= len(signatures)  # this machine: one device class, two names
    assert summary["lookups"]["lookups"] >= len(farm.http.get(
        f"/v1/jobs/{job_id}/plan").json()["lookups"])
    here = [d for d in summary["per_device"] if "bench-cpu" in d["devices"]]
    assert here and here[0]["entries"] >= len(signatures)
    assert any(name.startswith("worker-") for name in here[0]["devices"])
    device = farm.http.get(f"/v1/devices/{run['result']['device']['id']}").json()
    assert any(t["status"] == "done" for t in device["recent_tasks"])


def test_a_profile_key_is_the_kernel_schedule_without_its_stage_descriptions(tmp_path):
    """A kernel of many stages has a long record in plan.json; the profile key is its schedule,
    which stays within what the profiling database stores."""
    from service.profiles.runs import artifact_kernels
    from service.profiles.tables import MAX_SCHEDULE_CHARS

    stages = [{"stage": f"contraction MatMul (op{i}), packed GEMM", "form": "packed", "kc": 48}
              for i in range(40)]
    record = {"target": "host", "arch": "x86_64", "gemm_mc": 96, "stages": stages}
    path = tmp_path / "a.kiln"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("manifest.json", json.dumps({"kernels": [{"symbol": "k0", "block": "b0"}]}))
        archive.writestr("plan.json", json.dumps({"kernels": [{"block": "b0", "schedule": record}]}))
    _, kernels = artifact_kernels(path)
    assert json.loads(kernels[0]["schedule"]) == {"target": "host", "arch": "x86_64", "gemm_mc": 96}
    assert len(kernels[0]["schedule"]) <= MAX_SCHEDULE_CHARS
