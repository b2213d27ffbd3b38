"""The agent routes in-process (TestClient) on SQLite and PostgreSQL: tokens, refusals, claims.

The agent's own side runs against the real service process in tests/device_agents/test_agent.py.
"""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from device_agents import protocol as p
from device_agents.facts import HardwareFacts
from service.app import create_app
from service.db import database, utcnow
from service.devices import service as devices
from service.devices.tables import Agent, Device, MeasurementTask
from service.migrate import upgrade
from service.profiles.tables import ProfileEntry
from service.settings import Settings
from tests.service.stack import kiln_cli

SIG = ["a" * 64, "b" * 64]
FACTS = HardwareFacts(kind="cpu", arch="x86_64", abi="x86_64", os="Linux 6", cpu_model="Test CPU",
                      logical_cores=4, isa=("avx2", "fma", "sse2"))


@pytest.fixture
def agents(database_url, tmp_path):
    """(client, db, token, settings) with one agent, on SQLite and PostgreSQL."""
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url)
    upgrade(database_url)
    db = database(database_url)
    _agent, token = devices.create_agent(db, "lab-1")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client, db, token, settings


def register(client, name="local", facts=FACTS) -> str:
    body = p.DeviceRegistration(name=name, transport="local", facts=facts,
                                fingerprint=facts.fingerprint, agent_version="test")
    reply = client.post(p.REGISTER_PATH, json=json.loads(body.model_dump_json()))
    assert reply.status_code == 200, reply.text
    return reply.json()["device_id"]


def add_task(db, arch="x86_64", **extra) -> str:
    kernels = {"b0": {"signature": SIG[0], "schedule": "{}"},
               "b1": {"signature": SIG[1], "schedule": '{"tile":8}'}}
    return devices.create_task(db, artifact_path="probes/x.kiln", artifact_sha256="0" * 64,
                               arch=arch, kernels=kernels, **extra)


def result(task, device, samples=(1e-5, 2e-5, 3e-5), **change) -> dict:
    body = {"task_id": task, "device_id": device, "status": "ok", "runs": 3,
            "totals": [{"median_s": 2e-4, "p10_s": 1e-4, "p90_s": 3e-4, "min_s": 1e-4,
                        "max_s": 4e-4}],
            "kernels": [{"symbol": f"k{i}_x", "block": f"b{i}", "samples_s": [samples[1]],
                         "run_samples_s": list(samples)} for i in range(2)]}
    return body | change


def count(db, table) -> int:
    with db.read() as s:
        return len(s.scalars(select(table)).all())


def test_tokens_are_stored_hashed_and_a_wrong_one_is_refused(agents):
    client, db, token, _ = agents
    with db.read() as s:
        stored = s.scalars(select(Agent)).one()
    assert token not in json.dumps([stored.token_hash, stored.token_prefix, stored.name])
    assert stored.token_hash == devices.hash_token(token)
    body = p.DeviceRegistration(name="x", transport="local", facts=FACTS,
                                fingerprint=FACTS.fingerprint, agent_version="t").model_dump_json()
    json_headers = {"Content-Type": "application/json"}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Bearer {token}x"},
                    {"Authorization": "Bearer " + token.replace(token[-4:], "AAAA")}):
        for path, payload in ((p.REGISTER_PATH, body), (p.HEARTBEAT_PATH, "{}"),
                              (p.CLAIM_PATH, "{}"), (p.RESULTS_PATH, "{}"),
                              (p.RELEASE_PATH, "{}")):
            reply = client.post(path, content=payload, headers=headers | json_headers)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.headers["content-type"].startswith("application/problem+json")
            assert "agent token" in reply.json()["detail"]
    assert count(db, Device) == 0  # nothing stored
    devices.revoke_agent(db, "lab-1")
    assert client.post(p.REGISTER_PATH, content=body, headers=json_headers).status_code == 401


def test_oversized_bodies_are_refused_unread(agents):
    client, db, _token, _ = agents
    huge = {"Content-Type": "application/json", "Content-Length": str(65 << 20)}
    reply = client.post(p.RESULTS_PATH, content=b"{}", headers=huge)
    assert reply.status_code == 413 and "at most" in reply.json()["detail"]


def test_registration_is_keyed_by_agent_and_name(agents):
    client, db, _token, _ = agents
    first = register(client)
    assert register(client) == first
    other = FACTS.model_copy(update={"cpu_model": "Other CPU"})
    assert register(client, facts=other) == first  # facts updated in place
    with db.read() as s:
        device = s.get(Device, first)
    assert device.fingerprint == other.fingerprint and device.status == "online"
    bad = json.loads(p.DeviceRegistration(name="y", transport="local", facts=FACTS,
                                          fingerprint=FACTS.fingerprint,
                                          agent_version="t").model_dump_json())
    bad["fingerprint"] = "f" * 64
    reply = client.post(p.REGISTER_PATH, json=bad)
    assert reply.status_code == 422 and "fingerprint does not match" in reply.json()["detail"]
    # Another agent cannot see or use this agent's devices.
    _other, token2 = devices.create_agent(db, "lab-2")
    reply = client.post(p.CLAIM_PATH, json={"device_id": first},
                        headers={"Authorization": f"Bearer {token2}"})
    assert reply.status_code == 404
    beat = client.post(p.HEARTBEAT_PATH, headers={"Authorization": f"Bearer {token2}"},
                       json={"agent_version": "t", "devices": [
                           {"device_id": first, "status": "offline"}]})
    assert beat.json()["unknown_device_ids"] == [first]
    with db.read() as s:
        assert s.get(Device, first).status == "online"


def test_claim_result_and_entries(agents):
    client, db, _token, _ = agents
    device = register(client)
    arm = add_task(db, arch="aarch64")
    task = add_task(db)
    reply = client.post(p.CLAIM_PATH, json={"device_id": device, "max_tasks": 4}).json()
    assert [t["task_id"] for t in reply["tasks"]] == [task]  # not the aarch64 one
    assert reply["tasks"][0]["artifact_url"] == f"/v1/agents/tasks/{task}/artifact"
    assert client.post(p.CLAIM_PATH, json={"device_id": device}).json()["tasks"] == []

    # Refused results store nothing and leave the task claimed.
    for change, status, message in [
        ({"kernels": [{"symbol": "k0", "block": "b0", "samples_s": [-1.0]}]}, 422, "greater than 0"),
        ({"kernels": [{"symbol": "k0", "block": "b9", "samples_s": [1e-5]}]}, 422, "unknown blocks"),
        ({"kernels": [{"symbol": "k0", "block": "b0", "samples_s": [1e-5],
                       "run_samples_s": [1e-5] * 1001}]}, 422, "at most 1000"),
        ({"kernels": [{"symbol": "k0", "block": "b0", "samples_s": [120.0]}]}, 422, "less than 60"),
        ({"task_id": arm}, 409, "not claimed by device"),
    ]:
        reply = client.post(p.RESULTS_PATH, json=result(task, device, **change))
        assert reply.status_code == status, reply.text
        assert message in reply.json()["detail"]
    nan = json.dumps(result(task, device)).replace("1e-05", "NaN", 1)
    assert client.post(p.RESULTS_PATH, content=nan,
                       headers={"Content-Type": "application/json"}).status_code == 422
    assert count(db, ProfileEntry) == 0

    reply = client.post(p.RESULTS_PATH, json=result(task, device))
    assert reply.status_code == 200, reply.text
    with db.read() as s:
        entries = {e.signature: e for e in s.scalars(select(ProfileEntry))}
        stored = s.get(MeasurementTask, task)
    assert stored.status == "done" and stored.entries == 2
    assert entries[SIG[1]].schedule == '{"tile":8}'
    e = entries[SIG[0]]
    assert (e.n, e.source, e.device_fingerprint) == (3, "measured", FACTS.fingerprint)
    assert e.p10_s == pytest.approx(1.2e-5) and e.median_s == pytest.approx(2e-5)
    assert e.p90_s == pytest.approx(2.8e-5)
    assert client.post(p.RESULTS_PATH, json=result(task, device)).status_code == 409  # once


def test_release_heartbeat_and_lease_expiry(agents):
    client, db, _token, settings = agents
    device = register(client)
    tasks = [add_task(db) for _ in range(3)]
    claimed = client.post(p.CLAIM_PATH, json={"device_id": device, "max_tasks": 3}).json()
    assert sorted(t["task_id"] for t in claimed["tasks"]) == sorted(tasks)
    reply = client.post(p.RELEASE_PATH, json={"device_id": device, "task_ids": [tasks[0], "nope"],
                                              "reason": "stopping"}).json()
    assert reply["released"] == [tasks[0]]
    # A heartbeat listing a task extends its lease; the unlisted one expires.
    client.post(p.HEARTBEAT_PATH, json={"agent_version": "t", "devices": [
        {"device_id": device, "status": "busy", "task_ids": [tasks[1]]}]})
    later = utcnow() + timedelta(seconds=settings.agent_lease_seconds - 1)
    with db.write() as s:
        s.get(MeasurementTask, tasks[2]).lease_expires_at = utcnow() - timedelta(seconds=1)
    assert devices.reap(db, offline_after_s=3600, now=later) == [tasks[2]]
    # Reported offline: its remaining task returns to the queue.
    client.post(p.HEARTBEAT_PATH, json={"agent_version": "t", "devices": [
        {"device_id": device, "status": "offline", "error": "usb unplugged"}]})
    with db.read() as s:
        states = {t.id: (t.status, t.attempts) for t in s.scalars(select(MeasurementTask))}
        assert s.get(Device, device).error == "usb unplugged"
    assert states == {t: ("queued", 1) for t in tasks}
    assert client.post(p.CLAIM_PATH, json={"device_id": device}).status_code == 409
    register(client)  # back online
    for _ in range(2):  # max_attempts 3: the third loss fails the task
        assert client.post(p.CLAIM_PATH, json={"device_id": device, "max_tasks": 3}).json()["tasks"]
        client.post(p.RELEASE_PATH, json={"device_id": device, "task_ids": tasks})
    with db.read() as s:
        assert {t.status for t in s.scalars(select(MeasurementTask))} == {"failed"}


def test_concurrent_claims_hand_out_each_task_once(agents):
    client, db, token, settings = agents
    ids = [register(client, name=f"d{i}") for i in range(4)]
    tasks = {add_task(db) for _ in range(40)}
    got: list[str] = []
    lock = threading.Lock()

    def claimer(device_id):
        while True:
            claimed = devices.claim(db, devices.agent_for_token(db, token), device_id, 3, 60, 600)
            if not claimed:
                return
            with lock:
                got.extend(t.id for t in claimed)

    threads = [threading.Thread(target=claimer, args=(d,)) for d in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(tasks)  # every task once, none twice


def test_cli_creates_and_revokes_agents(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'kiln.sqlite'}"
    env = {**__import__("os").environ, "KILN_DATABASE_URL": database_url,
           "KILN_DATA_DIR": str(tmp_path)}
    token = kiln_cli(env, "admin", "create-agent", "phone-lab").strip()
    assert token.startswith("kagent_")
    db = database(database_url)
    assert devices.agent_for_token(db, token) is not None
    out = kiln_cli(env, "admin", "create-agent", "gpu-lab", "--token-file",
                   str(tmp_path / "tok"))
    assert "written to" in out and (tmp_path / "tok").stat().st_mode & 0o777 == 0o600
    with pytest.raises(RuntimeError, match="exists already"):
        kiln_cli(env, "admin", "create-agent", "phone-lab")
    kiln_cli(env, "admin", "revoke-agent", "phone-lab")
    assert devices.agent_for_token(db, token) is None
