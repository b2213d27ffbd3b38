"""The code generator's interface: supported ops, refusals, the kernel ABI, Kiln-only names,
schedules, and both CPU targets."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

from kiln import frontend
from kiln.codegen import check_supported, generate, supported_ops
from kiln.errors import UnsupportedOpsError
from kiln.target import target
from tests.codegen.harness import check_model, model, plan_for, random_inputs

EVIL = 'x"/*; system("rm -rf /"); */'


def test_supported_ops_cover_the_zoo_and_the_paper_ops():
    ops = supported_ops()
    for op in ("MatMul", "Gemm", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "Softmax",
               "LayerNormalization", "LSTM", "GRU", "Resize", "Einsum", "TopK", "CumSum", "Gather",
               "Concat", "Pad", "Transpose", "Reshape", "ReduceMean", "Erf", "Where", "Cast"):
        assert op in ops
    assert "NonZero" not in ops and "Loop" not in ops


def test_check_supported_lists_every_offending_op_with_its_names():
    # (the frontend itself refuses float16 models: strings are the element type that reaches here)
    spec = {"x": ((2, 2), "object"), "m": ((2, 2), "float32")}
    nodes = [helper.make_node("Equal", ["x", "x"], ["a"], name="string_equal"),
             helper.make_node("Bernoulli", ["m"], ["d"], name="random_node")]
    graph = frontend.build(model(nodes, spec, ["a", "d"], opset=19), {}, "t")
    with pytest.raises(UnsupportedOpsError) as error:
        check_supported(graph)
    assert set(error.value.unsupported) == {"Equal", "Bernoulli"}
    assert error.value.unsupported["Bernoulli"] == ["random_node"]


def test_kernel_abi_and_model_names_never_reach_the_source():
    spec = {EVIL: ((2, 3), "float32")}
    nodes = [helper.make_node("Relu", [EVIL], [EVIL + "r"], name=EVIL + "n"),
             helper.make_node("MatMul", [EVIL + "r", "w"], ["out" + EVIL], name=EVIL + "m")]
    inits = {"w": np.ones((3, 4), np.float32)}
    graph = frontend.build(model(nodes, spec, ["out" + EVIL], inits), {}, "t")
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, target("host"))
    assert [k.block_id for k in kernels] == [b.id for b in plan.blocks]
    for kernel, block in zip(kernels, plan.blocks):
        assert EVIL not in kernel.source and "rm -rf" not in kernel.source
        assert re.fullmatch(r"k\d+_[A-Za-z0-9_]+", kernel.symbol)
        assert f"void {kernel.symbol}(void *const *args)" in kernel.source
        assert set(kernel.outputs) == set(block.outputs)
        assert kernel.args[-len(kernel.outputs):] == kernel.outputs
        assert set(kernel.args[:-len(kernel.outputs)]) <= set(block.inputs) | set(kernel.derived_constants)
        assert {"target", "matmul_tile_n", "stages"} <= set(kernel.schedule)


def test_schedule_overrides_are_recorded_and_keep_results():
    spec = {"a": ((9, 20), "float32")}
    inits = {"b": np.random.default_rng(0).standard_normal((20, 33)).astype(np.float32)}
    m = model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"], inits)
    graph = frontend.build(m, {}, "t")
    plan = plan_for(graph, "none")
    (kernel,) = generate(plan, target("host"), block_schedules={plan.blocks[0].id: {
        "gemm_min_m": 100, "matmul_tile_m": 2, "matmul_tile_n": 16, "split_loops": False}})
    assert kernel.schedule["matmul_tile_n"] == 16
    assert kernel.schedule["stages"][0]["tile_m"] == 2
    # packed GEMM with a ragged last block along every axis: 20 = 7 + 7 + 6 along the sum
    (packed,) = generate(plan, target("host"), block_schedules={plan.blocks[0].id: {
        "gemm_kc": 8, "gemm_l2_bytes": 0, "gemm_mc": 4, "gemm_nc": 8}})
    stage = packed.schedule["stages"][-1]
    assert stage["form"] == "packed" and stage["kc"] == 7
    assert packed.schedule["gemm_mr"] > 0 and packed.schedule["vector_bytes"] > 0
    with pytest.raises(ValueError):
        generate(plan, target("host"), block_schedules={plan.blocks[0].id: {"tile": 1}})
    check_model(m, random_inputs(spec))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler")
def test_aarch64_sources_compile(tmp_path):
    spec = {"x": ((1, 3, 8, 8), "float32")}
    inits = {"w": np.ones((4, 3, 3, 3), np.float32)}
    m = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3]),
               helper.make_node("Softmax", ["y"], ["z"])], spec, ["z"], inits)
    aarch64 = target("aarch64")
    kernels = generate(plan_for(frontend.build(m, {}, "t"), "dnnfusion"), aarch64)
    src = tmp_path / "k.c"
    src.write_text("\n".join(k.source for k in kernels))
    subprocess.run([aarch64.cc, "-O2", "-fopenmp", "-c", *aarch64.cflags, str(src), "-o",
                    str(tmp_path / "k.o")], check=True)


def test_sources_compile_without_warnings(tmp_path):
    spec = {"x": ((2, 3, 5), "float32"), "i": ((2,), "int64")}
    nodes = [helper.make_node("Gather", ["x", "i"], ["g"], axis=2),
             helper.make_node("ReduceMax", ["g"], ["m"], keepdims=1),
             helper.make_node("Sub", ["g", "m"], ["y"]),
             helper.make_node("Cast", ["y"], ["c"], to=TensorProto.INT8)]
    graph = frontend.build(model(nodes, spec, ["c"], opset=13), {}, "t")
    kernels = generate(plan_for(graph, "dnnfusion"), target("host"))
    src = tmp_path / "k.c"
    src.write_text("\n".join(k.source for k in kernels))
    done = subprocess.run(["gcc", "-O2", "-fopenmp", "-Wall", "-Wextra", "-c", str(src), "-o",
                           str(tmp_path / "k.o")], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and not done.stderr, done.stderr


def test_supported_ops_after_importing_one_op_module_first():
    """Importing one lowering module directly registers only its ops: the registry must still
    load every module when asked, in a fresh interpreter where nothing else was imported."""
    script = ("import kiln.codegen.ops.contraction\n"
              "from kiln.codegen.generate import supported_ops\n"
              "print(len(supported_ops()))")
    direct = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert int(direct.stdout) == len(supported_ops())
