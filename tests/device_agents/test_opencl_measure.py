"""The agents' local backend measures OpenCL kernels on this machine's OpenCL device (PoCL): the
whole path of a measurement task — service, agent, runner, profile entries filed under the OpenCL
device's fingerprint (not the CPU's: kernel signatures do not name a backend) — and the refusal on
a device without OpenCL."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from device_agents.agent import Agent
from device_agents.backends.local import LocalBackend
from device_agents.facts import HardwareFacts, device_class
from device_agents.measure import MeasurementError, check_compatible
from kiln.pipeline import CompileOptions, compile_artifact, compile_model
from kiln.profile.local import default_store
from kiln.runtime.artifact import open_artifact
from kiln.signature import kernel_signature
from tests.device_agents.test_agent import config, run_until, service  # noqa: F401 (fixture)
from tests.runtime.test_opencl import opencl_missing

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "zoo" / "resnet50.onnx"


@pytest.fixture(scope="module")
def opencl_artifact(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny resnet50 for OpenCL, and its blocks' kernel signatures (what a task files)."""
    out = tmp_path_factory.mktemp("opencl") / "resnet50.kiln"
    options = CompileOptions(target="opencl")
    compile_artifact(MODEL, out, options, default_store(":memory:"))
    plan = compile_model(MODEL, options, default_store(":memory:")).plan
    kernels = {b.id: {"signature": kernel_signature(plan.graph, b.op_ids), "schedule": "{}"}
               for b in plan.blocks if not b.is_view}
    return out, kernels


@pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))
def test_the_local_agent_measures_opencl_kernels(tmp_path, service, opencl_artifact):  # noqa: F811
    path, kernels = opencl_artifact
    task = service.add_task(path, "x86_64", runs=3, repeats=1, kernels=kernels)
    agent = Agent(config(tmp_path, service))
    asyncio.run(run_until(agent, service.finished, timeout=300))
    done = service.tasks()[task]
    local = service.devices()["local"]
    assert (done.status, done.device_id, done.error) == ("done", local.id, None)
    assert local.facts["opencl_device"]  # PoCL's device
    opencl_class = device_class(local.fingerprint, local.facts, "opencl")
    assert opencl_class != local.fingerprint
    entries = service.entries()
    assert {e.signature for e in entries} == {k["signature"] for k in kernels.values()}
    assert {e.device_fingerprint for e in entries} == {opencl_class}
    assert all(0 < e.median_s < 60 and e.source == "measured" for e in entries)


def test_a_device_without_opencl_refuses_opencl_artifacts(tmp_path, opencl_artifact):
    artifact = open_artifact(opencl_artifact[0])
    cpu = HardwareFacts(kind="cpu", arch="x86_64", abi="x86_64", os="Linux", cpu_model="x",
                        logical_cores=2, isa=("avx2", "fma"))
    with pytest.raises(MeasurementError, match="opencl device; .* has none"):
        check_compatible(artifact, cpu, LocalBackend(tmp_path).name)
    check_compatible(artifact, cpu.model_copy(update={"opencl_device": "pocl"}), "local")
