"""CUDA artifacts run end to end without a GPU: the artifact's own library and runner, with a
stand-in libcuda.so.1 (cuda_emulator/fake_libcuda.cpp) that runs the model's CUDA kernels,
compiled for this CPU (cuda_emulator/emulator.h: warps as fibers, so __shfl_xor_sync and
__syncwarp behave as on a GPU), and `kiln verify` compares the outputs with onnxruntime. What the
emulator cannot show is speed, and what nvcc's device compiler does (test_cuda.py compiles the
same sources with it)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.runtime.artifact import Artifact, open_artifact
from kiln.runtime.loader import load
from tests.runtime.test_cuda import ZOO, nvcc_missing
from tests.runtime.test_gpu_gemm import matmul_model

EMULATOR = Path(__file__).resolve().parent / "cuda_emulator"
EMULATED = ("tinybert", "swin-t")  # rows a warp runs; a row loop split in pieces

pytestmark = [pytest.mark.skipif(nvcc_missing() is not None, reason=str(nvcc_missing())),
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")]


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fake-cuda") / "libcuda.so.1"
    subprocess.run(["g++", "-O2", "-std=c++17", "-fPIC", "-shared",
                    str(EMULATOR / "fake_libcuda.cpp"), "-o", str(out), "-ldl"], check=True)
    return out


def emulated_kernels(artifact: Artifact, out: Path) -> Path:
    """The artifact's CUDA sources compiled for this CPU, with a wrapper per entry point."""
    program = "\n".join(p.read_text() for p in sorted((artifact.root / "src").glob("*.cu")))
    wrappers = []
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', program):
        count = params.count(",") + 1 if params.strip() else 0
        args = ", ".join(f"(unsigned char *)(uintptr_t)*(unsigned long long *)p[{i}]"
                         for i in range(count))
        wrappers.append(f'extern "C" void kiln_emu_{name}(void **p) {{ {name}({args}); }}')
    source = out.with_suffix(".cpp")
    source.write_text(program + "\n" + "\n".join(dict.fromkeys(wrappers)) + "\n")
    subprocess.run(["g++", "-O1", "-std=c++17", "-fPIC", "-shared", "-w", "-include",
                    str(EMULATOR / "emulator.h"), str(source), "-o", str(out)], check=True)
    return out


@pytest.fixture
def emulate(fake_libcuda, monkeypatch, tmp_path):
    """Point the driver at the stand-in; returns a function that loads an artifact's kernels."""
    log = tmp_path / "images.log"
    monkeypatch.setenv("KILN_CUDA_LIBRARY", str(fake_libcuda))
    monkeypatch.setenv("KILN_FAKE_CUDA_LOG", str(log))

    def use(path: Path, capability: str = "8.0") -> Path:
        artifact = open_artifact(path, tmp_path / "extracted")
        module = emulated_kernels(artifact, tmp_path / f"{path.stem}.so")
        monkeypatch.setenv("KILN_FAKE_CUDA_MODULE", str(module))
        monkeypatch.setenv("KILN_FAKE_CUDA_CAPABILITY", capability)
        return log

    return use


@pytest.fixture(scope="module")
def tinybert_sm86(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda-artifacts") / "tinybert.kiln"
    assert main(["compile", str(ZOO / "tinybert.onnx"), "--target", "cuda-sm86", "-o",
                 str(out)]) == 0
    return out


@pytest.mark.parametrize("name", EMULATED)
def test_tiny_models_verify_through_the_cuda_driver(name, emulate, tmp_path, capsys):
    out = tmp_path / f"{name}.kiln"
    assert main(["compile", str(ZOO / f"{name}.onnx"), "--target", "cuda", "-o", str(out)]) == 0
    log = emulate(out)
    capsys.readouterr()
    assert main(["verify", str(out), str(ZOO / f"{name}.onnx")]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok:")
    assert log.read_text() == "cubin\n"  # an sm_80 GPU runs the sm_80 cubin


def test_each_gpu_gets_the_image_it_runs(tinybert_sm86, emulate, capsys):
    model = str(ZOO / "tinybert.onnx")
    log = emulate(tinybert_sm86, "8.9")  # same major architecture, newer minor: the cubin
    assert main(["verify", str(tinybert_sm86), model]) == 0
    emulate(tinybert_sm86, "9.0")  # a newer major architecture: the PTX, compiled by the driver
    assert main(["bench", str(tinybert_sm86), "--runs", "2", "--warmup", "0"]) == 0
    assert log.read_text().splitlines() == ["cubin", "ptx"]
    for older in ("8.0", "7.5"):  # binary compatibility runs forward only; the PTX is newer
        emulate(tinybert_sm86, older)
        with pytest.raises(KilnError, match=rf"built for sm_86 \(compute capability 8.6\); Kiln "
                                            rf"CUDA emulator has {older}, which runs neither"):
            load(tinybert_sm86)
    assert log.read_text().splitlines() == ["cubin", "ptx"]  # nothing loaded for those


@pytest.mark.parametrize("m, n, k, form", [(1, 7, 5, "matmul"), (70, 45, 100, "gemm"),
                                           (33, 130, 40, "activations")])
def test_the_work_group_tiled_gemm_runs_through_the_cuda_driver(m, n, k, form, emulate, tmp_path,
                                                                 capsys):
    """Blocks of threads that share __shared__ tiles and meet at __syncthreads, ragged edges."""
    model = matmul_model(tmp_path / "m.onnx", m, n, k, form)
    out = tmp_path / "m.kiln"
    assert main(["compile", str(model), "--target", "cuda", "-o", str(out)]) == 0
    emulate(out)
    source = "\n".join(p.read_text() for p in (open_artifact(out, tmp_path / "x").root / "src")
                       .glob("*.cu"))
    assert "__syncthreads();" in source and "__shared__ float" in source
    capsys.readouterr()
    assert main(["verify", str(out), str(model)]) == 0, capsys.readouterr().out
