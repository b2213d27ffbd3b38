"""The agent's main loop against the real service (uvicorn, SQLite and PostgreSQL).

Everything is real: the service's agent routes in their own process with their database, this
machine, a real OpenSSH server on loopback and the stand-in phone (an ADB wire-protocol peer running
aarch64 runners under qemu). Results land as profile entries in the database.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from device_agents import protocol as p
from device_agents.agent import Agent, Device
from device_agents.cli import main
from device_agents.client import AuthError, ServiceClient, ServiceError
from device_agents.config import AgentConfig, ConfigError, load_config
from device_agents.measure import RUNNER_NAME
from service.devices.tables import Device as Device_
from tests.device_agents.live_service import LiveService, mlp_kernels
from tests.device_agents.test_measure import LyingBackend, good_report
from tests.service.stack import create_database, drop_database, postgres_available


def _service(tmp_path, url: str):
    live = LiveService(tmp_path / "service", url)
    live.start()
    return live


@pytest.fixture
def service(tmp_path):
    """The real service on SQLite."""
    live = _service(tmp_path, f"sqlite:///{tmp_path / 'kiln.sqlite'}")
    yield live
    live.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_service(request, tmp_path):
    """The real service on SQLite, then on PostgreSQL."""
    if request.param == "sqlite":
        live = _service(tmp_path, f"sqlite:///{tmp_path / 'kiln.sqlite'}")
        yield live
        live.stop()
        return
    if not postgres_available():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is needed")
    url = create_database()
    live = _service(tmp_path, url)
    try:
        yield live
    finally:
        live.stop()
        live.db.dispose()
        from service.db import _databases

        _databases.pop(url, None)
        drop_database(url)


def config(tmp_path: Path, service: LiveService, *, local: bool = True, sshd=None, phone=None,
           **extra) -> AgentConfig:
    data = {"server": service.url, "token": service.token, "work_dir": str(tmp_path / "agent"),
            "poll_interval": 0.05, "heartbeat_interval": 0.2, "reconnect_interval": 0.5,
            "local": local, "adb_key": str(tmp_path / "adbkey"), **extra}
    if sshd is not None:
        data["ssh"] = [{"name": "ssh-box", "host": "127.0.0.1", "port": sshd.port,
                        "user": sshd.user, "key": str(sshd.key),
                        "known_hosts": str(sshd.known_hosts),
                        "work_dir": str(tmp_path / "ssh-work")}]
    if phone is not None:
        data["adb"] = [{"name": "phone", "host": "127.0.0.1", "port": phone.port,
                        "work_dir": str(phone.data_dir / "kiln")}]
    return AgentConfig.model_validate(data)


async def run_until(agent: Agent, done, timeout: float = 60.0) -> None:
    """Run the agent's loop until `done()` holds."""
    stop = asyncio.Event()

    async def watch():
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()

    watcher = asyncio.create_task(watch())
    await agent.run(stop)
    await watcher
    assert done(), "the agent did not finish in time"


def test_agent_measures_on_every_device(tmp_path, any_service, sshd, phone, host_artifact_path,
                                        arm_artifact_path, host_artifact):
    """Registration, heartbeats, claims and results over HTTP; entries land in the database."""
    service = any_service
    host = [service.add_task(host_artifact_path, "x86_64") for _ in range(3)]
    arm = service.add_task(arm_artifact_path, "aarch64")
    agent = Agent(config(tmp_path, service, sshd=sshd, phone=phone))
    asyncio.run(run_until(agent, service.finished))

    devices = service.devices()
    assert devices["phone"].kind == "phone" and devices["local"].kind in ("cpu", "gpu-host")
    assert devices["phone"].arch == "aarch64" and devices["phone"].emulated
    assert devices["local"].fingerprint == devices["ssh-box"].fingerprint  # one machine, two ways
    assert devices["ssh-box"].address == f"{sshd.user}@127.0.0.1:{sshd.port}"
    assert devices["ssh-box"].transport == "ssh" and devices["phone"].transport == "adb"
    assert all(d.last_heartbeat_at is not None for d in devices.values())
    tasks = service.tasks()
    assert {t.status for t in tasks.values()} == {"done"}
    assert tasks[arm].device_id == devices["phone"].id
    assert {tasks[t].device_id for t in host} <= {devices["local"].id, devices["ssh-box"].id}
    assert all(t.entries == 3 and t.attempts == 1 for t in tasks.values())

    entries = service.entries()
    signatures = {v["signature"] for v in mlp_kernels().values()}
    by_device = {}
    for e in entries:
        by_device.setdefault(e.device_fingerprint, set()).add(e.signature)
        assert e.source == "measured" and e.schedule == "{}" and e.toolchain == "test"
        assert 0 < e.p10_s <= e.median_s <= e.p90_s < 60
        assert e.n == 3 * 2  # runs x repeats: the runner's per-run times
    assert by_device == {devices["local"].fingerprint: signatures,
                         devices["phone"].fingerprint: signatures}


def test_ssh_round_trip_lands_entries(tmp_path, service, sshd, host_artifact_path):
    """The ssh backend alone (the test above may give every host task to the local device)."""
    task = service.add_task(host_artifact_path, "x86_64", runs=2, repeats=1)
    agent = Agent(config(tmp_path, service, local=False, sshd=sshd))
    asyncio.run(run_until(agent, service.finished))
    done = service.tasks()[task]
    ssh = service.devices()["ssh-box"]
    assert (done.status, done.device_id, done.entries) == ("done", ssh.id, 3)
    assert {(e.device_fingerprint, e.n) for e in service.entries()} == {(ssh.fingerprint, 2)}


def test_phone_lost_mid_batch_requeues_its_tasks(tmp_path, service, phone, arm_artifact_path):
    first = service.add_task(arm_artifact_path, "aarch64")
    second = service.add_task(arm_artifact_path, "aarch64")
    phone.vanish_when = lambda command: f"{RUNNER_NAME} -n " in command.replace("'", "")
    agent = Agent(config(tmp_path, service, local=False, phone=phone))
    device = agent.devices[0]

    async def scenario():
        await agent.discover()
        await agent.heartbeat()
        phone_id = device.device_id
        assert await agent.work_once(device) == 0 and phone.vanished.is_set()
        assert device.state == p.DeviceState.offline and "lost" in device.error
        tasks = service.tasks()
        assert {t.status for t in tasks.values()} == {"queued"}  # back in the queue
        assert all(t.device_id is None and t.attempts == 1 for t in tasks.values())
        registered = service.devices()["phone"]
        assert registered.status == "offline" and "lost" in registered.error
        assert not service.entries()

        phone.vanish_when = None
        phone.revive()
        await agent.discover()
        assert device.device_id == phone_id  # registered again under the same id
        assert service.devices()["phone"].status == "online"
        assert await agent.work_once(device) == 2
        await agent.close()

    asyncio.run(scenario())
    tasks = service.tasks()
    assert tasks[first].status == tasks[second].status == "done"
    assert tasks[first].attempts == 2
    assert len(service.entries()) == 3


def test_unknown_devices_register_again(tmp_path, service):
    agent = Agent(config(tmp_path, service))

    async def scenario():
        await agent.discover()
        first = agent.devices[0].device_id
        with service.db.write() as s:  # the service lost its records
            s.execute(Device_.__table__.delete())
        await agent.heartbeat()
        second = agent.devices[0].device_id
        await agent.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert first != second and service.device_id("local") == second


def test_ssh_host_lost_mid_run(tmp_path, service, sshd, host_artifact_path):
    first = service.add_task(host_artifact_path, "x86_64", runs=100_000, repeats=20)
    second = service.add_task(host_artifact_path, "x86_64", runs=100_000, repeats=20)
    killed = threading.Event()

    def kill_when_the_runner_runs():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for pid in sshd.sessions():
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if name == RUNNER_NAME:
                    sshd.kill_all()
                    killed.set()
                    return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_when_the_runner_runs, daemon=True)
    watcher.start()
    agent = Agent(config(tmp_path, service, local=False, sshd=sshd, max_tasks=2))

    async def scenario():
        await agent.discover()
        finished = await agent.work_once(agent.devices[0])
        await agent.close()
        return finished

    finished = asyncio.run(scenario())
    watcher.join()
    assert killed.is_set() and finished == 0
    assert agent.devices[0].state == p.DeviceState.offline
    assert service.devices()["ssh-box"].status == "offline"
    tasks = service.tasks()
    assert {tasks[first].status, tasks[second].status} == {"queued"}
    assert tasks[first].attempts == tasks[second].attempts == 1
    assert not service.entries()


def test_a_silent_device_goes_offline_and_its_lease_returns(tmp_path, service,
                                                           host_artifact_path):
    """Missed heartbeats: the service itself takes the device offline and requeues its work."""
    from datetime import timedelta

    from service.db import utcnow
    from service.devices import service as devices

    task = service.add_task(host_artifact_path, "x86_64")
    agent = Agent(config(tmp_path, service))

    async def scenario():
        await agent.discover()
        reply = await agent.client.claim(p.ClaimRequest(device_id=agent.devices[0].device_id))
        await agent.close()
        return reply

    assert [t.task_id for t in asyncio.run(scenario()).tasks] == [task]
    assert service.tasks()[task].status == "claimed"
    assert devices.reap(service.db, offline_after_s=60) == []  # heartbeats are recent
    later = utcnow() + timedelta(seconds=61)
    assert devices.reap(service.db, offline_after_s=60, now=later) == [task]
    assert service.tasks()[task].status == "queued"
    assert service.devices()["local"].status == "offline"


def test_tasks_that_cannot_be_measured_are_reported_failed(tmp_path, service, phone,
                                                           host_artifact_path, host_artifact):
    wrong = service.add_task(host_artifact_path, "aarch64")  # an x86 artifact queued for phones
    lying = service.add_task(host_artifact_path, "x86_64", runs=3)
    report = json.dumps(good_report(host_artifact.manifest, runs=3)).replace(
        '"median_ns": 600', '"median_ns": -600', 1)
    cfg = config(tmp_path, service, local=False, phone=phone)
    liar = Device("liar", "local", "", lambda: LyingBackend(tmp_path / "liar", report=report))
    agent = Agent(cfg)
    agent.devices.append(liar)
    asyncio.run(run_until(agent, service.finished))
    tasks = service.tasks()
    assert {t.status for t in tasks.values()} == {"failed"}
    assert "built for x86_64" in tasks[wrong].error
    assert "-600" in tasks[lying].error and "latencies must be finite, > 0" in tasks[lying].error
    assert not service.entries()


def test_a_refused_token_stops_the_agent(tmp_path, service, capsys):
    cfg = config(tmp_path, service).model_copy(update={"token": "kagent_0123456789ab_wrong"})
    with pytest.raises(AuthError, match="401"):
        asyncio.run(Agent(cfg).run(once=True))
    path = tmp_path / "agent.toml"
    path.write_text(f'server = "{service.url}"\ntoken = "wrong"\nwork_dir = "w"\n')
    assert main(["--config", str(path), "--once"]) == 1
    assert "refused this agent's token" in capsys.readouterr().err
    assert not service.devices()  # nothing was stored


def test_cli_once_registers_and_measures(tmp_path, service, host_artifact_path):
    task = service.add_task(host_artifact_path, "x86_64")
    (tmp_path / "token").write_text(service.token + "\n")
    path = tmp_path / "agent.toml"
    path.write_text(f'server = "{service.url}"\ntoken_file = "token"\nwork_dir = "w"\n'
                    f'poll_interval = 0.1\n')
    assert main(["--config", str(path), "--once", "--log-level", "WARNING"]) == 0
    assert service.tasks()[task].status == "done"
    assert (tmp_path / "w" / "cache" / "downloads").is_dir()
    assert len(service.entries()) == 3


def agent_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`kiln-agent` as a process: its real logging set-up, stderr as an operator sees it."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "device_agents.cli", *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
                          text=True, timeout=300)


def test_cli_logs_each_measurement_and_not_each_http_request(tmp_path, service,
                                                             host_artifact_path):
    task = service.add_task(host_artifact_path, "x86_64")
    (tmp_path / "token").write_text(service.token + "\n")
    (tmp_path / "agent.toml").write_text(f'server = "{service.url}"\ntoken_file = "token"\n'
                                         f'work_dir = "w"\npoll_interval = 0.1\n')
    done = agent_cli(tmp_path, "--config", "agent.toml", "--once")
    assert done.returncode == 0, done.stderr
    assert service.tasks()[task].status == "done"
    assert "HTTP Request" not in done.stderr
    measured = [line for line in done.stderr.splitlines() if f"task {task} measured" in line]
    assert len(measured) == 1, done.stderr
    assert "local:" in measured[0] and "3 kernel(s)" in measured[0]
    assert re.search(r"k\d+_\w+ [\d.]+ (ns|µs|ms|s)\b", measured[0])
    assert "whole run" in measured[0]


def test_cli_once_fails_when_no_device_can_be_reached(tmp_path, service):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "agent.toml").write_text(
        f'server = "{service.url}"\ntoken = "{service.token}"\nwork_dir = "w"\nlocal = false\n'
        f'adb_key = "adbkey"\n[[adb]]\nname = "phone"\nhost = "127.0.0.1"\nport = {port}\n')
    done = agent_cli(tmp_path, "--config", "agent.toml", "--once")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln-agent: no device could be reached (phone: cannot connect")


def test_cli_facts(tmp_path, capsys):
    path = tmp_path / "agent.toml"
    path.write_text('server = "http://127.0.0.1:9"\ntoken = "x"\nwork_dir = "w"\n')
    assert main(["--config", str(path), "--facts"]) == 0
    facts = json.loads(capsys.readouterr().out)["local"]
    assert facts["kind"] in ("cpu", "gpu-host") and len(facts["fingerprint"]) == 64


def test_config_files(tmp_path, monkeypatch):
    path = tmp_path / "agent.toml"
    path.write_text("""server = "http://kiln:8000"
token_file = "secrets/token"
[[ssh]]
name = "gpu"
host = "10.0.0.5"
user = "kiln"
key = "keys/id"
known_hosts = "/etc/ssh/known"
[[adb]]
name = "pixel"
host = "192.168.1.2"
""")
    cfg = load_config(path)
    assert cfg.token_file == tmp_path / "secrets" / "token"
    assert cfg.ssh[0].key == tmp_path / "keys" / "id"
    assert cfg.adb[0].port == 5555 and cfg.adb[0].work_dir == "/data/local/tmp/kiln"
    with pytest.raises(ConfigError, match="cannot read token_file"):
        cfg.agent_token()
    monkeypatch.setenv("KILN_AGENT_TOKEN", "from-env")
    assert cfg.model_copy(update={"token_file": None}).agent_token() == "from-env"

    path.write_text('server = "http://kiln"\n[[ssh]]\nname = "x"\nhost = "h"\nuser = "u"\n'
                    'key = "k"\n')
    with pytest.raises(ConfigError, match="known_hosts"):
        load_config(path)
    path.write_text('server = "http://kiln"\n[[adb]]\nname = "local"\nhost = "h"\n')
    with pytest.raises(ConfigError, match="repeated: local"):
        load_config(path)
    path.write_text('server = "kiln"\n')
    with pytest.raises(ConfigError, match="server"):
        load_config(path)


def test_the_token_goes_to_the_service_only():
    client = ServiceClient("http://kiln.internal:8000/base", "kagent_x_y")
    assert str(client.artifact_url("/v1/agents/artifacts/7")) == (
        "http://kiln.internal:8000/v1/agents/artifacts/7")
    assert str(client.artifact_url("artifacts/7")) == "http://kiln.internal:8000/base/artifacts/7"
    for url in ("http://evil.example/a.kiln", "https://kiln.internal:8000/a", "//evil/a"):
        with pytest.raises(ServiceError, match="not on the service"):
            client.artifact_url(url)
    asyncio.run(client.close())


def test_protocol_refuses_bad_results():
    base = {"task_id": "t1", "device_id": "d1", "status": "ok", "runs": 5,
            "totals": [{"median_s": 2e-6, "p10_s": 1e-6, "p90_s": 3e-6, "min_s": 1e-6,
                        "max_s": 4e-6}]}
    ok = p.ResultUpload.model_validate(
        base | {"kernels": [{"symbol": "k0_add", "block": "b0", "samples_s": [1e-6]}]})
    assert ok.kernels[0].samples_s == [1e-6]
    for kernels, message in [
        ([{"symbol": "k0", "block": "b0", "samples_s": [float("nan")]}], "finite"),
        ([{"symbol": "k0", "block": "b0", "samples_s": [-1.0]}], "greater than 0"),
        ([{"symbol": "k0", "block": "b0", "samples_s": [120.0]}], "less than 60"),
        ([{"symbol": "k0", "block": "b0", "samples_s": [1e-6, 1e-6]}], "sample count"),
        ([{"symbol": "k0; rm -rf /", "block": "b0", "samples_s": [1e-6]}], "pattern"),
    ]:
        with pytest.raises(ValueError, match=message):
            p.ResultUpload.model_validate(base | {"kernels": kernels})
    with pytest.raises(ValueError, match="needs an error"):
        p.ResultUpload(task_id="t", device_id="d", status="failed")


def test_usb_discovery_never_fails_the_agent(tmp_path, service):
    """Without adb-shell's USB extra (or USB access) discovery finds nothing and goes on."""
    agent = Agent(config(tmp_path, service, local=False, adb_usb={"enabled": True}))

    async def scenario():
        await agent.discover()
        await agent.heartbeat()
        await agent.close()

    asyncio.run(scenario())
    assert all(d.transport == "adb" and d.address.startswith("usb:") for d in agent.devices)
