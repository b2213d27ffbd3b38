"""The GPU backends' work-group tiled GEMM (`kiln.codegen.gemm.group`): MatMul, Gemm and the convs
that lower to GEMMs, with their fused epilogues, compiled `--target opencl` and run on PoCL against
onnxruntime (`kiln verify`), ragged and tiny shapes included; the rendered kernels declare local
memory and barriers and are launched in work-groups that fit the target's limits; the CUDA
spelling compiles with nvcc for sm_80 and sm_90 (the CUDA emulator runs it in
test_cuda_emulated.py)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main
from kiln.codegen import generate
from kiln.codegen.gemm.group import group_tiles
from kiln.codegen.microkernel import MicroKernel
from kiln.codegen.schedule import Schedule
from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.local import default_store
from kiln.runtime import nvcc
from kiln.runtime.toolchain import run_tool
from kiln.target import CUDA_GPU_LIMITS, MOBILE_GPU_LIMITS, target
from tests.runtime.test_cuda import nvcc_missing
from tests.runtime.test_opencl import needs_opencl

RNG = np.random.default_rng(7)


def _weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _save(nodes, inputs, output_shape, initializers, path: Path) -> Path:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def matmul_model(path: Path, m: int, n: int, k: int, form: str) -> Path:
    """x (m × k) times a weight, through a fused epilogue: MatMul + bias + Relu, Gemm (transB,
    alpha, beta, C) + a residual input, or x · sigmoid(another input) (both operands computed at
    run time, B through a fused prologue)."""
    if form == "matmul":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
                 helper.make_node("Add", ["p", "bias"], ["q"]),
                 helper.make_node("Relu", ["q"], ["y"])]
        return _save(nodes, [("x", [m, k])], [m, n], [_weight("w", (k, n)), _weight("bias", (n,))],
                     path)
    if form == "gemm":
        nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["p"], transB=1, alpha=0.5, beta=2.0),
                 helper.make_node("Add", ["p", "r"], ["y"])]
        return _save(nodes, [("x", [m, k]), ("r", [m, n])], [m, n],
                     [_weight("w", (n, k)), _weight("c", (n,))], path)
    nodes = [helper.make_node("Sigmoid", ["b"], ["s"]),
             helper.make_node("MatMul", ["x", "s"], ["p"]),
             helper.make_node("Tanh", ["p"], ["y"])]
    return _save(nodes, [("x", [m, k]), ("b", [k, n])], [m, n], [], path)


def conv_model(path: Path, channels: int, out_channels: int, size: int, kernel: int,
               stride: int) -> Path:
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], ["c"], kernel_shape=[kernel, kernel],
                              strides=[stride, stride], pads=[pad] * 4),
             helper.make_node("Relu", ["c"], ["y"])]
    return _save(nodes, [("x", [1, channels, size, size])], [1, out_channels, out, out],
                 [_weight("w", (out_channels, channels, kernel, kernel)),
                  _weight("bias", (out_channels,))], path)


def verify_opencl(model: Path, capsys) -> None:
    out = model.with_suffix(".kiln")
    assert main(["compile", str(model), "--target", "opencl", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), str(model)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok:")


@needs_opencl
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.one_of(st.just(1), st.integers(1, 90)), n=st.integers(1, 90),
       k=st.one_of(st.just(1), st.integers(1, 100)),
       form=st.sampled_from(["matmul", "gemm", "activations"]))
def test_matmul_and_gemm_with_epilogues_verify_on_pocl(m, n, k, form, tmp_path_factory, capsys):
    folder = tmp_path_factory.mktemp("gemm")
    verify_opencl(matmul_model(folder / "m.onnx", m, n, k, form), capsys)


@needs_opencl
@pytest.mark.parametrize("channels, out_channels, size, kernel, stride", [
    (19, 21, 9, 1, 1),   # pointwise: a plain GEMM over pixels
    (5, 18, 11, 3, 2),   # strided: the implicit GEMM, im2col in the copy to local memory
    (7, 20, 10, 3, 1),   # 3×3 stride 1: Winograd's GEMMs over the transformed weights' panels
])
def test_convolutions_through_the_tiled_gemm_verify_on_pocl(channels, out_channels, size, kernel,
                                                            stride, tmp_path, capsys):
    model = conv_model(tmp_path / "conv.onnx", channels, out_channels, size, kernel, stride)
    plan = compile_model(model, CompileOptions(target="opencl"), default_store(":memory:")).plan
    sources = "\n".join(k.source for k in generate(plan, target("opencl")))
    assert "work-group tiled GEMM" in sources
    verify_opencl(model, capsys)


def _kernels(model: Path, target_name: str):
    plan = compile_model(model, CompileOptions(target=target_name),
                         default_store(":memory:")).plan
    return [k for k in generate(plan, target(target_name)) if "tiled GEMM" in k.source]


def test_opencl_gemm_stages_tiles_in_local_memory_behind_barriers(tmp_path):
    model = matmul_model(tmp_path / "m.onnx", 200, 150, 300, "matmul")
    (kernel,) = _kernels(model, "opencl")
    assert "barrier(CLK_LOCAL_MEM_FENCE);" in kernel.source
    tiles = [int(size) for size in re.findall(r"__local float \w+\[(\d+)\];", kernel.source)]
    assert len(tiles) == 2 and 4 * sum(tiles) <= MOBILE_GPU_LIMITS.fast_memory_bytes
    assert "__local const float *a, __local const float *b" in kernel.source  # the micro-kernel
    assert "float4 c0_0" in kernel.source  # register tile in vector registers
    (launch,) = [la for la in kernel.launches if la.work_group]
    assert 1 < launch.work_group <= MOBILE_GPU_LIMITS.max_work_group
    assert launch.work_items % launch.work_group == 0


def test_cuda_gemm_uses_shared_memory_and_syncthreads(tmp_path):
    model = matmul_model(tmp_path / "m.onnx", 300, 260, 128, "gemm")
    (kernel,) = _kernels(model, "cuda")
    assert "__syncthreads();" in kernel.source and "barrier(" not in kernel.source
    tiles = [int(size) for size in re.findall(r"__shared__ float \w+\[(\d+)\];", kernel.source)]
    assert len(tiles) == 2 and 4 * sum(tiles) <= CUDA_GPU_LIMITS.fast_memory_bytes
    assert all(la.work_group <= CUDA_GPU_LIMITS.max_work_group for la in kernel.launches)


@pytest.mark.parametrize("limits", [MOBILE_GPU_LIMITS, CUDA_GPU_LIMITS])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 4096, 768), (3136, 64, 576), (77, 5, 1000),
                                     (512, 512, 512)])
def test_group_tiles_fit_the_device_limits(limits, m, n, k):
    schedule = Schedule().for_device(limits)
    for dtype, vector_bytes in (("float32", 16), ("float64", 16)):
        uk = MicroKernel(dtype, schedule.gemm_mr, schedule.gemm_nr, vector_bytes)
        tiles = group_tiles(m, n, k, uk, schedule)
        assert tiles.work_items <= limits.max_work_group
        assert tiles.local_bytes(4 if dtype == "float32" else 8) <= limits.fast_memory_bytes
        assert tiles.mt < 2 * max(m, uk.mr) and tiles.nt < 2 * max(n, uk.nr)  # fits the product
    accumulators, b_row, a_column = uk.mr * uk.nr, uk.nr, uk.mr
    assert accumulators + b_row + a_column <= limits.registers


@pytest.mark.skipif(nvcc_missing() is not None, reason=str(nvcc_missing()))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiled_cuda_gemm_compiles_with_nvcc(arch, tmp_path):
    from kiln.runtime.cuda_driver import program_source
    from kiln.runtime.driver import kernel_units

    model = conv_model(tmp_path / "conv.onnx", 6, 24, 12, 3, 2)
    plan = compile_model(model, CompileOptions(target="cuda"), default_store(":memory:")).plan
    views = {b.id for b in plan.blocks if b.is_view}
    kernels = [k for k in generate(plan, target("cuda")) if k.block_id not in views]
    source = tmp_path / "conv.cu"
    source.write_text(program_source(list(kernel_units(kernels).values())))
    assert "__shared__" in source.read_text()
    cubin = tmp_path / f"conv.{arch}.cubin"
    run_tool([nvcc.find_nvcc(), *nvcc.FLAGS, f"-arch={arch}", "-cubin", str(source), "-o",
              str(cubin)], f"conv for {arch}")
    assert cubin.stat().st_size > 0
