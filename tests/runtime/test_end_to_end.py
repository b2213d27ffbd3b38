"""The tiny zoo models: compile → artifact → `kiln verify` against onnxruntime, on this machine
with both partitioners and for aarch64 under qemu. A model whose operators the code generator
declares unsupported is skipped, naming them."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln import codegen
from kiln.cli import main
from kiln.errors import UnsupportedOpsError
from kiln.pipeline import CompileOptions, compile_artifact
from kiln.profile.local import default_store
from tests.runtime.conftest import cross_toolchain_missing

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
TINY = sorted(p.stem for p in ZOO.glob("*.onnx"))

pytestmark = pytest.mark.skipif(not hasattr(codegen, "generate"),
                                reason="kiln.codegen.generate does not exist yet")


def compile_or_skip(name: str, partitioner: str, target: str, out: Path) -> dict:
    options = CompileOptions(partitioner=partitioner, target=target)
    try:
        return compile_artifact(ZOO / f"{name}.onnx", out, options, default_store(":memory:"))
    except UnsupportedOpsError as exc:
        pytest.skip(f"{name}: {exc}")


@pytest.mark.parametrize("partitioner", ["dnnfusion", "none", "ago", "souffle", "fusionstitching"])
@pytest.mark.parametrize("name", TINY)
def test_tiny_model_verifies_on_this_machine(name, partitioner, tmp_path, capsys):
    out = tmp_path / f"{name}.kiln"
    report = compile_or_skip(name, partitioner, "host", out)
    assert report["compiled_kernels"] > 0
    assert report["peak_memory_bytes"] > 0
    assert main(["verify", str(out), str(ZOO / f"{name}.onnx")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_verifies_for_aarch64_under_qemu(name, tmp_path, capsys):
    reason = cross_toolchain_missing()
    if reason:
        pytest.skip(f"cannot cross-build for aarch64: {reason}")
    out = tmp_path / f"{name}-aarch64.kiln"
    compile_or_skip(name, "dnnfusion", "aarch64", out)
    assert main(["verify", str(out), str(ZOO / f"{name}.onnx")]) == 0, capsys.readouterr().out
