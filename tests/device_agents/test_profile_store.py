"""The workers' database ProfileStore: hit, measure on a miss (here, or by an agent), cost model."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from kiln.pipeline import CompileOptions, compile_model
from kiln.profile import ProfileStore
from kiln.signature import kernel_signature
from service.db import database
from service.devices import service as devices
from service.devices.tables import MeasurementTask
from service.migrate import upgrade
from service.profiles.measure import local_facts
from service.profiles.tables import ProfileEntry
from service.settings import Settings
from service.storage import Storage
from tests.graphs import small_mlp
from tests.runtime.conftest import cross_toolchain_missing
from tests.runtime.handmade import mlp
from workers.profile_store import DatabaseProfileStore


@pytest.fixture
def setup(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", measure_runs=5, measure_wait_seconds=0.5)
    upgrade(settings.database_url)
    return settings, database(settings.database_url), Storage(settings.storage_root)


def entries(db) -> list[ProfileEntry]:
    with db.read() as s:
        return list(s.scalars(select(ProfileEntry)))


def test_a_miss_is_measured_here_then_answered_from_the_database(setup):
    settings, db, storage = setup
    graph = mlp().plan.graph
    store = DatabaseProfileStore(db, storage, settings, "host")
    assert isinstance(store, ProfileStore)  # the whole protocol: fallback, record, schedules
    first = store.latency(graph, ["op1", "op2"])
    assert first.source == "measured" and 0 < first.seconds < 1
    [entry] = entries(db)
    assert entry.device_fingerprint == local_facts().fingerprint
    assert entry.signature == kernel_signature(graph, ["op1", "op2"])
    assert entry.n == 5 and entry.p10_s <= entry.median_s <= entry.p90_s
    again = store.latency(graph, ["op2", "op1"])
    assert again == first and store.stats() == {"measured-local": 1, "hit": 1}

    # kiln.tune's side: record schedules, read them back best first.
    store.record(graph, ["op0"], [3e-6, 4e-6], schedule={"kernel": "x", "threads": 1})
    store.record(graph, ["op0"], [1e-6], schedule={"kernel": "y", "threads": 1})
    assert [s["kernel"] for s, _m in store.schedules(graph, ["op0"])] == ["y", "x"]
    with pytest.raises(ValueError, match="latencies must be finite"):
        store.record(graph, ["op0"], [float("nan")])


def test_without_measuring_the_cost_model_answers(setup):
    settings, db, storage = setup
    settings = settings.model_copy(update={"measure_local": False})
    store = DatabaseProfileStore(db, storage, settings, "host")
    estimate = store.latency(mlp().plan.graph, ["op0"])
    assert estimate.source == "cost-model" and estimate.seconds > 0
    assert not entries(db) and store.stats() == {"cost-model (measuring off)": 1}


def test_a_compile_with_a_filled_database_measures_nothing(setup, tmp_path):
    settings, db, storage = setup
    model = small_mlp(tmp_path / "mlp.onnx")
    empty = DatabaseProfileStore(db, storage, settings, "host")
    first = compile_model(model, CompileOptions(), empty)
    assert empty.stats().get("measured-local", 0) >= 1
    filled = DatabaseProfileStore(db, storage, settings, "host")
    second = compile_model(model, CompileOptions(), filled)
    assert "measured-local" not in filled.stats() and filled.stats().get("hit", 0) >= 1
    assert [b.op_ids for b in second.plan.blocks] == [b.op_ids for b in first.plan.blocks]


def test_another_target_dispatches_to_a_matching_agent_device(setup, tmp_path):
    missing = cross_toolchain_missing()
    if missing:
        pytest.skip(missing)
    settings, db, storage = setup
    graph = mlp().plan.graph
    alone = DatabaseProfileStore(db, storage, settings, "aarch64")
    assert alone.fingerprint is None  # no aarch64 device anywhere
    assert alone.latency(graph, ["op0"]).source == "cost-model"
    assert alone.stats() == {"cost-model (no device)": 1}

    from device_agents import protocol as p
    from device_agents.facts import HardwareFacts

    phone = HardwareFacts(kind="phone", arch="aarch64", abi="arm64-v8a", os="Android 14",
                          cpu_model="Cortex-A55", logical_cores=8, isa=("neon",))
    agent, _token = devices.create_agent(db, "phones")
    devices.register(db, agent.id, p.DeviceRegistration(
        name="pixel", transport="adb", facts=phone, fingerprint=phone.fingerprint,
        agent_version="t"))
    store = DatabaseProfileStore(db, storage, settings, "aarch64")
    assert store.fingerprint == phone.fingerprint
    estimate = store.latency(graph, ["op0"])  # nobody measures it within 0.5 s
    assert estimate.source == "cost-model"
    assert store.stats() == {"dispatched": 1, "timed-out": 1, "cost-model (fallback)": 1}
    with db.read() as s:
        task = s.scalars(select(MeasurementTask)).one()
    assert (task.status, task.arch, task.device_fingerprint) == ("queued", "aarch64",
                                                                  phone.fingerprint)
    assert task.signature == kernel_signature(graph, ["op0"]) and task.priority == 10
    assert storage.resolve(task.artifact_path).is_file()


def test_an_opencl_target_files_under_the_opencl_device_of_a_device_that_has_one(setup):
    """Only a device with an OpenCL driver measures for an OpenCL target; its entries go under
    its OpenCL device's class, its tasks to the device itself."""
    from device_agents import protocol as p
    from device_agents.facts import HardwareFacts, device_class

    settings, db, storage = setup
    cpu = HardwareFacts(kind="cpu", arch="x86_64", abi="x86_64", os="Linux", cpu_model="x",
                        logical_cores=2, isa=("avx2", "fma"))
    agent, _token = devices.create_agent(db, "hosts")
    devices.register(db, agent.id, p.DeviceRegistration(
        name="plain", transport="ssh", facts=cpu, fingerprint=cpu.fingerprint, agent_version="t"))
    assert DatabaseProfileStore(db, storage, settings, "opencl").fingerprint is None
    gpu = cpu.model_copy(update={"cpu_model": "y", "opencl_device": "Some GPU",
                                 "opencl_gpu": True})
    devices.register(db, agent.id, p.DeviceRegistration(
        name="gpu", transport="ssh", facts=gpu, fingerprint=gpu.fingerprint, agent_version="t"))
    store = DatabaseProfileStore(db, storage, settings, "opencl")
    assert store.route == gpu.fingerprint
    assert store.fingerprint == device_class(gpu.fingerprint, gpu.model_dump(), "opencl")
