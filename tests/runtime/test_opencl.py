"""The OpenCL backend on this machine's OpenCL runtime (PoCL: `apt-get install pocl-opencl-icd
ocl-icd-opencl-dev`, which scripts/test.sh installs): every tiny zoo model compiled with
`--target opencl` verifies against onnxruntime; the runner says clearly when the OpenCL library or
a device is missing, on x86-64 and for the phone runner (aarch64, under qemu)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main
from kiln.codegen import generate
from kiln.codegen.render.gpu import GpuRenderer
from kiln.pipeline import CompileOptions, compile_artifact, compile_model
from kiln.profile.local import default_store
from kiln.runtime.artifact import open_artifact
from kiln.runtime.execute import runner_prefix
from kiln.target import target
from tests.runtime.conftest import cross_toolchain_missing
from tests.runtime.test_end_to_end import TINY, ZOO, compile_or_skip

def opencl_missing() -> str | None:
    """Why no OpenCL device can run kernels here, or None."""
    name = ctypes.util.find_library("OpenCL")
    if name is None:
        return "no libOpenCL.so (apt-get install ocl-icd-opencl-dev pocl-opencl-icd)"
    lib = ctypes.CDLL(name)
    count = ctypes.c_uint32(0)
    if lib.clGetPlatformIDs(0, None, ctypes.byref(count)) != 0 or count.value == 0:
        return "no OpenCL platform (apt-get install pocl-opencl-icd)"
    return None


needs_opencl = pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))


@needs_opencl
@pytest.mark.parametrize("name", TINY)
def test_tiny_model_verifies_with_opencl(name, tmp_path, capsys):
    out = tmp_path / f"{name}-opencl.kiln"
    compile_or_skip(name, "dnnfusion", "opencl", out)
    assert main(["verify", str(out), str(ZOO / f"{name}.onnx")]) == 0, capsys.readouterr().out


def test_kernels_are_device_entry_points_launched_in_order():
    """Each stage is one or more `__kernel`s, the parallel ones over many work-items; no OpenMP,
    no libm-only names, and the GEMM micro-kernel is register-tiled with vector types."""
    plan = compile_model(ZOO / "resnet50.onnx", CompileOptions(target="opencl"),
                         default_store(":memory:")).plan
    kernels = generate(plan, target("opencl"))
    for k in kernels:
        assert k.launches, k.symbol
        for launch in k.launches:
            assert f"__kernel void {k.symbol}{launch.suffix}(" in k.source
        assert "#pragma omp" not in k.source and "memcpy" not in k.source
    assert max(launch.work_items for k in kernels for launch in k.launches) >= 256
    gemm = "\n".join(k.source for k in kernels if "kiln_ukr_" in k.source)
    assert "float4 c0_0" in gemm and "vload4(" in gemm and "vstore4(" in gemm


def test_the_gpu_renderer_leaves_its_spelling_to_subclasses():
    for hook in ("work_item_id", "vector_zero", "bitcast"):
        assert getattr(GpuRenderer, hook) is not None
    with pytest.raises(NotImplementedError):
        GpuRenderer().work_item_id()


@pytest.fixture(scope="module")
def opencl_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("opencl") / "resnet50.kiln"
    compile_artifact(ZOO / "resnet50.onnx", out, CompileOptions(target="opencl"),
                     default_store(":memory:"))
    return out


def _run_runner(artifact_path: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    artifact = open_artifact(artifact_path)
    inputs = []
    for i, info in enumerate(artifact.inputs):
        path = tmp / f"input_{i}.npy"
        np.save(path, np.zeros(info.shape, dtype=info.dtype))
        inputs.append(str(path))
    argv = [*runner_prefix(artifact), "-n", "2", "-w", "0", str(artifact.weights), *inputs]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@needs_opencl
def test_the_runner_measures_kernels_on_the_device(opencl_artifact, tmp_path):
    done = _run_runner(opencl_artifact, tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"kernels": [{"index": 0' in done.stdout


def test_the_runner_says_when_the_opencl_library_is_missing(opencl_artifact, tmp_path):
    done = _run_runner(opencl_artifact, tmp_path,
                       KILN_OPENCL_LIBRARY=str(tmp_path / "libOpenCL.so"))
    assert done.returncode == 2
    assert "cannot load the OpenCL library" in done.stderr
    assert "KILN_OPENCL_LIBRARY" in done.stderr


@needs_opencl
def test_the_runner_says_when_no_opencl_device_is_installed(opencl_artifact, tmp_path):
    empty = tmp_path / "vendors"
    empty.mkdir()
    done = _run_runner(opencl_artifact, tmp_path, OCL_ICD_VENDORS=str(empty))
    assert done.returncode == 2
    assert "no OpenCL platform found" in done.stderr


def test_the_phone_runner_cross_compiles_and_says_when_opencl_is_missing(tmp_path):
    reason = cross_toolchain_missing()
    if reason:
        pytest.skip(f"cannot cross-build for aarch64: {reason}")
    out = tmp_path / "resnet50-phone.kiln"
    compile_or_skip("resnet50", "dnnfusion", "opencl-aarch64", out)
    artifact = open_artifact(out)
    assert artifact.arch == "aarch64"
    header = artifact.runner.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # AArch64
    done = _run_runner(out, tmp_path)  # qemu-aarch64: no aarch64 OpenCL driver here
    assert done.returncode == 2, done.stderr
    assert "cannot load the OpenCL library" in done.stderr
