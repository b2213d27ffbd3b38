"""CUDA artifacts go only to GPUs that run them: the rule (cubin of the GPU's major architecture,
or PTX not newer), the service's claims, the workers' choice of device class, the agent's check."""
from __future__ import annotations

import pytest

from device_agents import protocol as p
from device_agents.facts import HardwareFacts, device_class, facts_from_probe
from device_agents.matching import gpu_mismatch
from kiln.target import cuda_image_for, sm_capability, target
from service.db import database
from service.devices import service as devices
from service.migrate import upgrade
from service.settings import Settings
from tests.device_agents import samples as s


def gpu_host(capability: str | None, name: str = "A100") -> HardwareFacts:
    return HardwareFacts(kind="gpu-host" if capability else "cpu", arch="x86_64", abi="x86_64",
                         os="Linux 6.1", cpu_model="EPYC", logical_cores=32, isa=("avx2",),
                         gpu_model=name if capability else None, gpu_count=1 if capability else 0,
                         gpu_compute_capability=capability)


@pytest.mark.parametrize("built, device, image", [
    ("sm_80", "8.0", "cubin"), ("sm_80", "8.6", "cubin"), ("sm_80", "9.0", "ptx"),
    ("sm_80", "12.0", "ptx"), ("sm_86", "8.0", None), ("sm_90", "8.9", None),
    ("sm_90", "9.0", "cubin"), ("sm_120", "9.0", None), ("sm_75", "8.6", "ptx"),
])
def test_which_code_a_gpu_runs(built, device, image):
    assert cuda_image_for(sm_capability(built), sm_capability(device)) == image
    reason = gpu_mismatch(built, gpu_host(device), "box")
    assert (reason is None) == (image is not None)
    if reason:
        assert built in reason and device in reason


def test_targets_name_their_architecture():
    assert target("cuda") == target("cuda-sm80")
    assert target("cuda-sm90").gpu_arch == "sm_90" and target("cuda-sm90").backend == "cuda"
    assert target("cuda-sm120").compute_capability == (12, 0)
    assert target("cuda-sm86").compute_capability == (8, 6)
    assert gpu_mismatch("sm_80", gpu_host(None), "cpu-box").startswith(
        "the artifact's kernels are CUDA for sm_80, and cpu-box reports no NVIDIA GPU")
    assert gpu_mismatch("", gpu_host(None), "cpu-box") is None  # a CPU artifact runs anywhere


def test_facts_of_an_ssh_gpu_host_come_from_nvidia_smi():
    facts = facts_from_probe(s.probe_output({
        "uname-a": s.X86_UNAME, "uname-m": "x86_64", "cpuinfo": s.X86_CPUINFO,
        "nvidia-smi-csv": s.NVIDIA_SMI_CSV, "nvidia-smi": s.NVIDIA_SMI_BANNER}), "", "ssh")
    assert facts.kind == "gpu-host" and facts.gpu_compute_capability == "9.0"
    assert gpu_mismatch("sm_90", facts, "h100") is None
    assert gpu_mismatch("sm_80", facts, "h100") is None  # by its PTX
    assert "neither its cubin" in gpu_mismatch("sm_100", facts, "h100")


def test_claims_hand_cuda_tasks_only_to_gpus_that_run_them(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    upgrade(settings.database_url)
    db = database(settings.database_url)
    agent, _token = devices.create_agent(db, "gpus")
    ids = {}
    for name, capability in (("a100", "8.0"), ("h100", "9.0"), ("t4", "7.5"), ("cpu", None)):
        facts = gpu_host(capability, name)
        ids[name] = devices.register(db, agent.id, p.DeviceRegistration(
            name=name, transport="ssh", facts=facts, fingerprint=facts.fingerprint,
            agent_version="t"))
    kernels = {"b0": {"signature": "0" * 64, "schedule": "{}"}}
    task = {gpu_arch: devices.create_task(db, artifact_path="x.kiln", artifact_sha256="0" * 64,
                                          arch="x86_64", gpu_arch=gpu_arch, kernels=kernels)
            for gpu_arch in ("sm_90", "sm_80", "")}

    def claim(name):
        return {t.id for t in devices.claim(db, agent.id, ids[name], 10, 60, 3600)}

    assert claim("cpu") == {task[""]}  # a CPU artifact: any device of its architecture
    assert claim("t4") == set()  # too old for both CUDA tasks
    assert claim("a100") == {task["sm_80"]}
    assert claim("h100") == {task["sm_90"]}
    assert [d.name for d in devices.online_devices_for(db, "x86_64", "sm_80")] in (
        ["h100", "a100"], ["a100", "h100"])
    assert [d.name for d in devices.online_devices_for(db, "x86_64", "sm_90")] == ["h100"]


def test_yellow_lookups_of_a_cuda_compile_go_to_a_gpu_that_runs_it(tmp_path):
    """The workers' profile store picks the device class of a GPU that runs the target and
    queues the probe (built with nvcc) for GPUs of at least its architecture."""
    from sqlalchemy import select

    from service.devices.tables import MeasurementTask
    from service.storage import Storage
    from tests.runtime.handmade import mlp
    from tests.runtime.test_cuda import nvcc_missing
    from workers.profile_store import DatabaseProfileStore

    if nvcc_missing():
        pytest.skip(nvcc_missing())
    settings = Settings(data_dir=tmp_path / "data", measure_wait_seconds=0.2)
    upgrade(settings.database_url)
    db, storage = database(settings.database_url), Storage(settings.storage_root)
    agent, _token = devices.create_agent(db, "gpus")
    for name, capability in (("a100", "8.0"), ("h100", "9.0")):
        facts = gpu_host(capability, name)
        devices.register(db, agent.id, p.DeviceRegistration(
            name=name, transport="ssh", facts=facts, fingerprint=facts.fingerprint,
            agent_version="t"))
    store = DatabaseProfileStore(db, storage, settings, "cuda-sm90")
    h100 = gpu_host("9.0", "h100")
    assert store.route == h100.fingerprint  # its tasks go to the h100
    assert store.fingerprint == device_class(h100.fingerprint, h100.model_dump(mode="json"),
                                             "cuda-sm90")
    assert store.latency(mlp().plan.graph, ["op0"]).source == "cost-model"  # nobody answers
    assert store.stats()["dispatched"] == 1
    with db.read() as s:
        task = s.scalars(select(MeasurementTask)).one()
    assert (task.arch, task.gpu_capability, task.device_fingerprint) == (
        "x86_64", 900, store.route)
    assert "kernels.sm_90.cubin" in str(zip_members(storage.resolve(task.artifact_path)))


def zip_members(path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return archive.namelist()
