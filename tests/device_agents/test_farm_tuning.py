"""Tuning on the farm: `--tune` for a target this machine cannot run (aarch64, OpenCL) is measured
by an agent's matching device through the measurement task queue, and lands in the profile
database under that device's class (its fingerprint; for OpenCL, its OpenCL device's).

Everything is real: the service in its own process, the agent (in a thread of this process) with
the stand-in phone (an ADB wire-protocol peer running aarch64 runners under qemu) or its local
backend's OpenCL device (PoCL), the aarch64 cross compiler, and the workers' profile store and
farm on the service's database.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from device_agents.agent import Agent
from device_agents.facts import device_class
from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.machine import host_machine
from kiln.profile.roofline import RooflineModel
from kiln.target import target
from kiln.tune import format_tuning, tune_plan
from service.settings import Settings
from tests.device_agents.test_agent import config
from tests.device_agents.test_agent import service  # noqa: F401  (the fixture)
from tests.runtime.test_opencl import opencl_missing
from tests.tune.conftest import small_model  # noqa: F401  (the fixture)
from workers.profile_store import DatabaseProfileStore


class AgentThread:
    """The agent's loop on its own event loop in a thread, while the tuner blocks this one."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        await self.agent.run(self.stop)

    def __enter__(self) -> "AgentThread":
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def wait_online(service, name: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        device = service.devices().get(name)
        if device is not None and device.status == "online":
            return device
        time.sleep(0.1)
    raise AssertionError(f"{name} did not come online")


def test_aarch64_candidates_are_measured_on_the_phone(tmp_path, service, phone,  # noqa: F811
                                                      small_model):  # noqa: F811
    settings = Settings(data_dir=tmp_path / "worker", database_url=service.database_url,
                        storage_root=service.storage.root, measure_runs=3)
    plan = compile_model(small_model, CompileOptions(target="aarch64"),
                         RooflineModel(host_machine())).plan
    arm = target("aarch64")
    nobody = DatabaseProfileStore(service.db, service.storage, settings, "aarch64")
    assert nobody.farm() is None  # no aarch64 device yet: tuning is skipped, as before
    skipped = tune_plan(plan, arm, nobody, "quick", 30)
    assert "cannot be measured on this machine" in skipped.report["skipped"]["all"]

    with AgentThread(Agent(config(tmp_path, service, local=False, phone=phone))):
        device = wait_online(service, "phone")
        store = DatabaseProfileStore(service.db, service.storage, settings, "aarch64")
        farm = store.farm()
        assert farm is not None and farm.fingerprint == device.fingerprint
        first = tune_plan(plan, arm, store, "quick", 300, farm=farm)
        print(format_tuning(first.report))
        assert first.measured >= 2 and first.report["failed"] == 0
        assert "phone" in first.report["device"]
        assert first.report["threads"] == device.facts["logical_cores"]
        entries = [e for e in service.entries() if e.device_fingerprint == device.fingerprint]
        kernels = {e.schedule for e in entries}
        assert len(entries) == first.measured and len(kernels) == first.measured
        assert all('"kernel":' in e.schedule and e.source == "measured" for e in entries)
        assert {t.priority for t in service.tasks().values()} == {5}
        assert {t.status for t in service.tasks().values()} == {"done"}

        # The same tuning again: every candidate is in the database, nothing is sent.
        tasks = len(service.tasks())
        second = tune_plan(plan, arm, store, "quick", 300, farm=farm)
        assert second.measured == 0 and second.reused == first.measured
        assert second.block_schedules == first.block_schedules
        assert len(service.tasks()) == tasks


def test_a_budget_that_ends_before_the_device_answers_measures_nothing(tmp_path, service,  # noqa: F811
                                                                       small_model):  # noqa: F811
    """A matching device that never claims: the tuner stops at its budget with nothing
    measured, and the unclaimed tasks expire at that deadline instead of waiting for a device."""
    from device_agents import protocol as p
    from device_agents.facts import HardwareFacts
    from service.devices import service as devices

    phone = HardwareFacts(kind="phone", arch="aarch64", abi="arm64-v8a", os="Android 14",
                          cpu_model="Cortex-A55", logical_cores=8, isa=("neon",))
    agent, _token = devices.create_agent(service.db, "phones")
    devices.register(service.db, agent.id, p.DeviceRegistration(
        name="pixel", transport="adb", facts=phone, fingerprint=phone.fingerprint,
        agent_version="t"))
    settings = Settings(data_dir=tmp_path / "worker", database_url=service.database_url,
                        storage_root=service.storage.root, measure_runs=3)
    store = DatabaseProfileStore(service.db, service.storage, settings, "aarch64")
    plan = compile_model(small_model, CompileOptions(target="aarch64"),
                         RooflineModel(host_machine())).plan
    budget = 3  # long enough to dispatch the candidates, then waited out on purpose
    start = time.monotonic()
    result = tune_plan(plan, target("aarch64"), store, "quick", budget, farm=store.farm())
    assert time.monotonic() - start < budget + 5
    assert result.measured == 0 and not result.block_schedules
    tasks = service.tasks().values()
    assert tasks and all(t.deadline is not None and t.device_fingerprint == phone.fingerprint
                         for t in tasks)
    devices.reap(service.db, offline_after_s=3600)
    assert {t.status for t in service.tasks().values()} == {"expired"}


def tuned_job(tmp_path, service, model_path, target_name: str) -> tuple[str, dict]:  # noqa: F811
    """A job for `model_path` with `tune="quick"` for `target_name`, run by the worker while an
    agent is online: its status and its report's tuning section."""
    import hashlib

    from service.jobs import service as jobs
    from service.jobs.schemas import JobCreate
    from service.jobs.tables import Job
    from service.models.tables import ModelRecord
    from service.tenants.service import create_tenant
    from workers.compile import run_job

    settings = Settings(data_dir=tmp_path / "worker", database_url=service.database_url,
                        storage_root=service.storage.root, measure_runs=3,
                        measure_budget_seconds=0, heartbeat_seconds=0.2)
    tenant = create_tenant(service.db, "acme")
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    service.storage.install_model(model_path, sha)
    with service.db.write() as s:
        model = ModelRecord(tenant_id=tenant.id, sha256=sha, size_bytes=len(data),
                            filename=model_path.name, opset=17,
                            inputs=[{"name": "x", "dtype": "float32", "shape": [1, 48, 64]}])
        s.add(model)
    job = jobs.create(service.db, tenant.id, JobCreate(model_id=model.id, target=target_name,
                                                       tune="quick", tune_budget_s=300))
    status = run_job(settings, service.db, job.id, "w1")
    with service.db.read() as s:
        return status, s.get(Job, job.id).report["tuning"]


def test_a_tuned_aarch64_job_through_the_service_is_measured_on_the_phone(tmp_path, service,  # noqa: F811
                                                                          phone, small_model):  # noqa: F811
    """The worker's compile of a job with `tune` hands the tuner the farm: the job's report says
    the phone measured, and its entries are the phone's."""
    with AgentThread(Agent(config(tmp_path, service, local=False, phone=phone))):
        device = wait_online(service, "phone")
        status, tuning = tuned_job(tmp_path, service, small_model, "aarch64")
    assert status == "succeeded"
    assert tuning["measured"] >= 2 and "phone" in tuning["device"], tuning
    entries = [e for e in service.entries() if '"kernel":' in e.schedule]
    assert len(entries) == tuning["measured"]
    assert {e.device_fingerprint for e in entries} == {device.fingerprint}


@pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))
def test_a_tuned_opencl_job_through_the_service_is_measured_on_the_local_opencl_device(
        tmp_path, service, small_model):  # noqa: F811
    """An `opencl` job with `tune`: this worker cannot run OpenCL kernels itself, so the local
    agent's OpenCL device (PoCL) measures the candidates, filed under that device's class."""
    with AgentThread(Agent(config(tmp_path, service))):
        device = wait_online(service, "local")
        status, tuning = tuned_job(tmp_path, service, small_model, "opencl")
    assert status == "succeeded"
    assert tuning["measured"] >= 2 and tuning["failed"] == 0, tuning
    assert "local" in tuning["device"], tuning
    opencl_class = device_class(device.fingerprint, device.facts, "opencl")
    assert opencl_class != device.fingerprint
    entries = [e for e in service.entries() if '"kernel":' in e.schedule]
    assert len(entries) == tuning["measured"]
    assert {e.device_fingerprint for e in entries} == {opencl_class}
    assert all(0 < e.median_s < 60 and e.source == "measured" for e in entries)
