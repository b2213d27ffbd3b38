"""The agent's main loop against a real HTTP server speaking the agent contract.

The server is tests/device_agents/fake_service.py — a test double, because the service's agent
routes are not written yet (part B of issue 7) — while the devices are real: this machine, a real
OpenSSH server on loopback and the stand-in phone (an ADB wire-protocol peer running aarch64
runners under qemu).
"""
from __future__ import annotations

import asyncio
import json
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
from tests.device_agents.fake_service import FakeService
from tests.device_agents.test_measure import LyingBackend, good_report

TOKEN = "agent-token-0123456789"


@pytest.fixture
def service():
    fake = FakeService(TOKEN)
    fake.start()
    yield fake
    fake.stop()


def config(tmp_path: Path, service: FakeService, *, local: bool = True, sshd=None, phone=None,
           **extra) -> AgentConfig:
    data = {"server": service.url, "token": TOKEN, "work_dir": str(tmp_path / "agent"),
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


def test_agent_measures_on_every_device(tmp_path, service, sshd, phone, host_artifact_path,
                                        arm_artifact_path, host_artifact):
    for i in (1, 2, 3):
        service.add_task(f"host-{i}", host_artifact_path, "x86_64")
    service.add_task("arm-1", arm_artifact_path, "aarch64")
    agent = Agent(config(tmp_path, service, sshd=sshd, phone=phone))
    asyncio.run(run_until(agent, service.finished))

    kinds = {d.name: d.facts.kind for d in service.devices.values()}
    assert kinds["phone"] == "phone" and kinds["local"] in ("cpu", "gpu-host")
    local, ssh = (service.devices[service.device_id(n)] for n in ("local", "ssh-box"))
    assert local.fingerprint == ssh.fingerprint  # the same machine, seen two ways
    assert ssh.address == f"{sshd.user}@127.0.0.1:{sshd.port}"
    assert {r.status for r in service.results} == {"ok"}
    symbols = [k["symbol"] for k in host_artifact.manifest["kernels"]]
    for result in service.results:
        assert [k.symbol for k in result.kernels] == symbols
        assert all(len(k.samples_s) == 2 for k in result.kernels)
    arm = service.tasks["arm-1"].result
    assert arm.device_id == service.device_id("phone") and arm.emulated
    assert {service.tasks[f"host-{i}"].device_id for i in (1, 2, 3)} <= {
        service.device_id("local"), service.device_id("ssh-box")}
    assert service.downloads.count("arm-1") == 1
    statuses = {d.status for beat in service.heartbeats for d in beat.devices}
    assert p.DeviceState.online in statuses


def test_phone_lost_mid_batch_releases_its_tasks(tmp_path, service, phone, arm_artifact_path):
    service.add_task("arm-1", arm_artifact_path, "aarch64")
    service.add_task("arm-2", arm_artifact_path, "aarch64")
    phone.vanish_when = lambda command: f"{RUNNER_NAME} -n " in command.replace("'", "")
    agent = Agent(config(tmp_path, service, local=False, phone=phone))
    device = agent.devices[0]

    async def scenario():
        await agent.discover()
        await agent.heartbeat()
        phone_id = device.device_id
        assert await agent.work_once(device) == 0 and phone.vanished.is_set()
        assert device.state == p.DeviceState.offline and "lost" in device.error
        assert [(r.device_id, r.task_ids) for r in service.releases] == [
            (phone_id, ["arm-1", "arm-2"])]
        assert {t.state for t in service.tasks.values()} == {"queued"}  # back in the queue
        assert service.last_status("phone") == p.DeviceState.offline
        assert not service.results

        phone.vanish_when = None
        phone.revive()
        await agent.discover()
        assert device.device_id == phone_id  # registered again under the same id
        assert await agent.work_once(device) == 2
        assert {t.state for t in service.tasks.values()} == {"done"}
        await agent.close()

    asyncio.run(scenario())


def test_unknown_devices_register_again(tmp_path, service):
    agent = Agent(config(tmp_path, service))

    async def scenario():
        await agent.discover()
        first = agent.devices[0].device_id
        service.devices.clear()  # the service lost its records
        await agent.heartbeat()
        second = agent.devices[0].device_id
        await agent.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert first != second and service.devices[second].name == "local"


def test_ssh_host_lost_mid_run(tmp_path, service, sshd, host_artifact_path):
    service.add_task("host-1", host_artifact_path, "x86_64", runs=100_000, repeats=20)
    service.add_task("host-2", host_artifact_path, "x86_64", runs=100_000, repeats=20)
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
    agent = Agent(config(tmp_path, service, local=False, sshd=sshd))

    async def scenario():
        await agent.discover()
        finished = await agent.work_once(agent.devices[0])
        await agent.close()
        return finished

    finished = asyncio.run(scenario())
    watcher.join()
    assert killed.is_set() and finished == 0
    assert agent.devices[0].state == p.DeviceState.offline
    assert [r.task_ids for r in service.releases] == [["host-1", "host-2"]]
    assert service.last_status("ssh-box") == p.DeviceState.offline
    assert {t.state for t in service.tasks.values()} == {"queued"}


def test_tasks_that_cannot_be_measured_are_reported_failed(tmp_path, service, phone,
                                                           host_artifact_path, host_artifact):
    service.add_task("wrong-arch", host_artifact_path, None)
    service.add_task("lying", host_artifact_path, "x86_64", runs=3)
    report = json.dumps(good_report(host_artifact.manifest, runs=3)).replace(
        '"median_ns": 600', '"median_ns": -600', 1)
    cfg = config(tmp_path, service, local=False, phone=phone)
    liar = Device("liar", "local", "", lambda: LyingBackend(tmp_path / "liar", report=report))
    agent = Agent(cfg)
    agent.devices.append(liar)
    asyncio.run(run_until(agent, service.finished))
    errors = {r.task_id: r.error for r in service.results}
    assert {r.status for r in service.results} == {"failed"}
    assert "built for x86_64" in errors["wrong-arch"] or "-600" in errors["wrong-arch"]
    assert "-600" in errors["lying"] and "latencies must be finite, > 0" in errors["lying"]


def test_a_refused_token_stops_the_agent(tmp_path, service, capsys):
    cfg = config(tmp_path, service).model_copy(update={"token": "wrong"})
    with pytest.raises(AuthError, match="401"):
        asyncio.run(Agent(cfg).run(once=True))
    path = tmp_path / "agent.toml"
    path.write_text(f'server = "{service.url}"\ntoken = "wrong"\nwork_dir = "w"\n')
    assert main(["--config", str(path), "--once"]) == 1
    assert "refused this agent's token" in capsys.readouterr().err


def test_cli_once_registers_and_measures(tmp_path, service, host_artifact_path):
    service.add_task("host-1", host_artifact_path, "x86_64")
    (tmp_path / "token").write_text(TOKEN + "\n")
    path = tmp_path / "agent.toml"
    path.write_text(f'server = "{service.url}"\ntoken_file = "token"\nwork_dir = "w"\n'
                    f'poll_interval = 0.1\n')
    assert main(["--config", str(path), "--once", "--log-level", "WARNING"]) == 0
    assert service.tasks["host-1"].state == "done"
    assert (tmp_path / "w" / "cache" / "downloads").is_dir()


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
    client = ServiceClient("http://kiln.internal:8000/base", TOKEN)
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
