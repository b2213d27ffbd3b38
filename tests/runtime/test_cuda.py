"""The CUDA backend without a GPU: every tiny zoo model's kernels compile with nvcc (the
`nvidia-cuda-nvcc` package, `pip install 'kiln[cuda]'`) for two architectures; an artifact holds
cubin plus PTX and builds on this machine; its library and runner say clearly that there is no
NVIDIA driver. (The kernels' index arithmetic is the GPU printer's, run through PoCL by the OpenCL
tests: the same IR, the same entry points.)"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.codegen import generate
from kiln.errors import KilnError
from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.machine import host_machine
from kiln.profile.roofline import RooflineModel
from kiln.runtime import cuda, nvcc
from kiln.runtime.artifact import ArtifactError, open_artifact, read_manifest
from kiln.runtime.cuda_driver import program_source
from kiln.runtime.driver import kernel_units
from kiln.runtime.execute import run_runner
from kiln.runtime.inputs import random_inputs
from kiln.runtime.loader import load
from kiln.runtime.toolchain import ToolchainError, run_tool
from kiln.target import target

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
ARCHITECTURES = ("sm_80", "sm_90")


def nvcc_missing() -> str | None:
    try:
        nvcc.find_nvcc()
    except ToolchainError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(nvcc_missing() is not None, reason=str(nvcc_missing()))


def cuda_program(model: Path) -> str:
    """The model's CUDA kernels as one program (what the artifact build hands to nvcc)."""
    plan = compile_model(model, CompileOptions(target="cuda"), RooflineModel(host_machine())).plan
    views = {b.id for b in plan.blocks if b.is_view}
    kernels = [k for k in generate(plan, target("cuda")) if k.block_id not in views]
    return program_source(list(kernel_units(kernels).values()))


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cuda")
    out = {}
    for model in sorted(ZOO.glob("*.onnx")):
        out[model.stem] = folder / f"{model.stem}.cu"
        out[model.stem].write_text(cuda_program(model))
    return out


def test_every_tiny_model_compiles_with_nvcc_for_two_architectures(programs):
    """One .cu per model, compiled to cubin (front end and ptxas) per architecture, two at once."""
    command = nvcc.find_nvcc()

    def compile_one(job: tuple[str, str]) -> str | None:
        name, arch = job
        try:
            run_tool([command, *nvcc.FLAGS, f"-arch={arch}", "-cubin", str(programs[name]), "-o",
                      str(programs[name].with_suffix(f".{arch}.cubin"))], f"{name} for {arch}")
        except ToolchainError as exc:
            return str(exc)
        return None

    jobs = [(name, arch) for name in programs for arch in ARCHITECTURES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(compile_one, jobs) if f]
    assert failures == []
    assert len(programs) == 13
    for name, arch in jobs:
        assert programs[name].with_suffix(f".{arch}.cubin").stat().st_size > 0


def test_entry_points_are_unmangled_global_functions(programs):
    text = programs["tinybert"].read_text()
    assert 'extern "C" __global__ void kiln_k_' in text
    assert "blockIdx.x * blockDim.x + threadIdx.x" in text
    assert "__kernel" not in text and "get_global_id" not in text


@pytest.mark.skipif(cuda.gpu_capability() is not None, reason="this machine has an NVIDIA GPU")
def test_an_artifact_holds_cubin_and_ptx_and_needs_a_driver_to_run(tmp_path, capsys):
    out = tmp_path / "tinybert.kiln"
    assert main(["compile", str(ZOO / "tinybert.onnx"), "--target", "cuda-sm90", "-o",
                 str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest["target"]["gpu_arch"] == "sm_90" and manifest["target"]["backend"] == "cuda"
    assert {"lib/kernels.sm_90.cubin", "lib/kernels.compute_90.ptx", "src/runner.c",
            "src/model.c"} <= set(manifest["files"])
    artifact = open_artifact(out, tmp_path / "extracted")
    cubin = (artifact.root / "lib/kernels.sm_90.cubin").read_bytes()
    ptx = (artifact.root / "lib/kernels.compute_90.ptx").read_text()
    assert cubin[:4] == b"\x7fELF" and ".target sm_90" in ptx
    assert cubin in artifact.library.read_bytes()  # embedded: the runner needs no other file
    with pytest.raises(ArtifactError, match="cannot load the CUDA driver library libcuda.so.1"):
        load(out)
    with pytest.raises(KilnError, match=r"the runner failed \(exit status 2\): kiln-runner: "
                                        r"error: cannot load the CUDA driver library .* no NVIDIA "
                                        r"driver; run the artifact on a GPU host"):
        run_runner(artifact, random_inputs(artifact.inputs))
    assert main(["verify", str(out), str(ZOO / "tinybert.onnx")]) == 2
    assert "cannot load the CUDA driver library" in capsys.readouterr().err


def test_architectures_nvcc_cannot_build_are_named(tmp_path):
    with pytest.raises(ToolchainError, match=r"cannot build for sm_50; it builds for .*sm_80"):
        nvcc.build_images("", "sm_50", root=tmp_path)
    with pytest.raises(KilnError, match="unknown target 'cuda-smx'"):
        target("cuda-smx")
