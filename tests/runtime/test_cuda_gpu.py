"""CUDA artifacts on a real NVIDIA GPU (skipped on machines without one, as CI's are): every tiny
zoo model, fused (dnnfusion) and unfused (none), built for the GPU's own architecture, matches
onnxruntime in-process (`kiln verify`'s comparison); the runner program does the same outside
Python; an artifact built for an older architecture runs through its PTX, which the driver
compiles."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln import frontend
from kiln.cli import main
from kiln.runtime import cuda
from kiln.runtime.artifact import open_artifact
from kiln.runtime.cli import compare, run_onnxruntime
from kiln.runtime.execute import run_artifact, run_runner
from kiln.runtime.inputs import random_inputs
from tests.runtime.test_cuda import ZOO, nvcc_missing

CAPABILITY = cuda.gpu_capability()

pytestmark = [pytest.mark.skipif(CAPABILITY is None, reason="no NVIDIA GPU on this machine"),
              pytest.mark.skipif(nvcc_missing() is not None, reason=str(nvcc_missing()))]

MODELS = sorted(p.stem for p in ZOO.glob("*.onnx"))


def gpu_target() -> str:
    major, minor = CAPABILITY or (0, 0)
    return f"cuda-sm{major}{minor}"


def verify(out: Path, model: Path, folder: Path, run: Callable = run_artifact) -> None:
    """What `kiln verify` does (called directly: the CLI's other commands come from the installed
    package's entry points, and the GPU host runs the tests from a checkout)."""
    artifact = open_artifact(out, folder)
    graph = frontend.build(frontend.read_model(model), {}, model.stem)
    inputs = random_inputs(artifact.inputs, graph)  # token ids within the vocabulary
    names, want = run_onnxruntime(model, inputs)
    rows = [compare(n, g, w) for n, g, w in zip(names, run(artifact, inputs), want)]
    assert all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("partitioner", ["dnnfusion", "none"])
@pytest.mark.parametrize("name", MODELS)
def test_every_tiny_model_verifies_on_the_gpu(name, partitioner, tmp_path):
    out = tmp_path / f"{name}.kiln"
    assert main(["compile", str(ZOO / f"{name}.onnx"), "--target", gpu_target(),
                 "--partitioner", partitioner, "-o", str(out)]) == 0
    verify(out, ZOO / f"{name}.onnx", tmp_path / "extracted")


def test_the_runner_program_runs_the_model_on_the_gpu(tmp_path):
    out = tmp_path / "tinybert.kiln"
    assert main(["compile", str(ZOO / "tinybert.onnx"), "--target", gpu_target(), "-o",
                 str(out)]) == 0
    verify(out, ZOO / "tinybert.onnx", tmp_path / "extracted",
           lambda artifact, inputs: run_runner(artifact, inputs).outputs)


def test_an_older_architecture_runs_through_its_ptx(tmp_path):
    """Built for sm_80, on a newer GPU: the driver compiles the embedded PTX."""
    if CAPABILITY is not None and CAPABILITY < (8, 0):
        pytest.skip("the GPU is older than sm_80")
    out = tmp_path / "swin-t.kiln"
    assert main(["compile", str(ZOO / "swin-t.onnx"), "--target", "cuda-sm80", "-o",
                 str(out)]) == 0
    verify(out, ZOO / "swin-t.onnx", tmp_path / "extracted")
