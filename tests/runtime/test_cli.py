"""`kiln compile -o`, `kiln run`, `kiln verify`, `kiln bench`, with a stand-in code generator that
emits hand-written kernels, so the runtime is tested on its own; and random valid inputs."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import codegen, frontend
from kiln.cli import main
from kiln.codegen import Kernel
from kiln.pipeline import CompileOptions, compile_artifact
from kiln.plan import FusionPlan
from kiln.profile.local import default_store
from kiln.runtime.artifact import TensorInfo, open_artifact
from kiln.runtime.inputs import index_bounds, random_inputs
from kiln.target import Target
from tests.graphs import float_input, save_model
from tests.runtime.conftest import cross_toolchain_missing
from tests.runtime.handmade import elementwise_kernel, matmul_kernel

RELU = "x0 > 0.0f ? x0 : 0.0f"


@pytest.fixture(scope="module")
def onnx_mlp(tmp_path_factory):
    """y = relu(x @ W + b); z = y + y."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.normal(size=(16,)).astype(np.float32), "B")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["y"]), helper.make_node("Add", ["y", "y"], ["z"])]
    path = tmp_path_factory.mktemp("onnx") / "mlp.onnx"
    return save_model(path, nodes, [float_input("x", [4, 8])],
                      [float_input("y", [4, 16]), float_input("z", [4, 16])], [w, b])


def handwritten_generate(relu: str = RELU):
    """A stand-in for kiln.codegen.generate for one-op blocks of MatMul, Add and Relu (models are
    compiled with --no-rewrite, which keeps exactly those ops)."""
    def generate(plan: FusionPlan, target: Target) -> list[Kernel]:
        kernels = []
        for i, block in enumerate(plan.blocks):
            (op_id,) = block.op_ids
            op = plan.graph.op_by_id[op_id]
            out = op.outputs[0]
            symbol = f"k{i}_{block.name}"
            count = plan.graph.tensors[out].numel
            if op.op_type == "MatMul":
                m, k = plan.graph.tensors[op.inputs[0]].shape
                n = plan.graph.tensors[op.inputs[1]].shape[1]
                kernels.append(matmul_kernel(symbol, block.id, (*op.inputs, out), m, k, n))
            elif op.op_type == "Add":
                period = plan.graph.tensors[op.inputs[1]].numel
                kernels.append(elementwise_kernel(symbol, block.id, op.inputs, out, count,
                                                  "x0 + x1", broadcast={1: period}))
            else:
                kernels.append(elementwise_kernel(symbol, block.id, op.inputs, out, count, relu))
        return kernels
    return generate


@pytest.fixture
def stand_in_codegen(monkeypatch):
    monkeypatch.setattr(codegen, "generate", handwritten_generate(), raising=False)


@pytest.fixture
def compiled(onnx_mlp, stand_in_codegen, tmp_path):
    out = tmp_path / "mlp.kiln"
    assert main(["compile", str(onnx_mlp), "-o", str(out), "--partitioner", "none",
                 "--no-rewrite", "--profile-db", ":memory:"]) == 0
    return out


def test_compile_artifact_adds_stages_and_memory_to_the_report(onnx_mlp, stand_in_codegen,
                                                               tmp_path):
    stages = []
    report = compile_artifact(onnx_mlp, tmp_path / "m.kiln",
                              CompileOptions(partitioner="none", rewrite=False),
                              default_store(":memory:"), stages.append)
    assert stages[-2:] == ["codegen", "build"]
    assert {"codegen", "build"} <= set(report["seconds"])
    assert report["compiled_kernels"] == report["kernels"] == 4
    memory = report["memory"]
    assert report["peak_memory_bytes"] == sum(memory.values())
    assert memory["weights_bytes"] >= (8 * 16 + 16) * 4
    assert memory["io_bytes"] == (4 * 8 + 2 * 4 * 16) * 4
    assert (tmp_path / "m.kiln").is_file()


def test_compile_without_output_stops_after_planning(onnx_mlp, capsys):
    assert main(["compile", str(onnx_mlp), "--profile-db", ":memory:"]) == 0
    assert "codegen" not in capsys.readouterr().out


def test_compile_prints_the_artifact(onnx_mlp, stand_in_codegen, tmp_path, capsys):
    out = tmp_path / "mlp.kiln"
    assert main(["compile", str(onnx_mlp), "-o", str(out), "--partitioner", "none",
                 "--no-rewrite", "--profile-db", ":memory:"]) == 0
    assert f"wrote {out}: 4 kernels, peak memory" in capsys.readouterr().out


def test_verify_passes_for_correct_kernels(compiled, onnx_mlp, capsys):
    assert main(["verify", str(compiled), str(onnx_mlp)]) == 0
    out = capsys.readouterr().out
    assert "ok: 2 output(s) within" in out
    assert out.count(" ok") >= 2


def test_verify_fails_for_wrong_kernels(onnx_mlp, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(codegen, "generate", handwritten_generate(relu="x0"), raising=False)
    out = tmp_path / "wrong.kiln"
    assert main(["compile", str(onnx_mlp), "-o", str(out), "--partitioner", "none",
                 "--no-rewrite", "--profile-db", ":memory:"]) == 0
    assert main(["verify", str(out), str(onnx_mlp)]) == 1
    assert "FAILED: 2 of 2 output(s) beyond tolerance: y, z" in capsys.readouterr().out


def test_verify_refuses_other_shapes(compiled, onnx_mlp, capsys):
    assert main(["verify", str(compiled), str(onnx_mlp), "--shape", "x=2,8"]) == 2
    assert "axis 0 is fixed to 4" in capsys.readouterr().err


def test_verify_of_another_model_names_both_inputs(compiled, tmp_path, capsys):
    other = save_model(tmp_path / "other.onnx", [helper.make_node("Relu", ["image"], ["y"])],
                       [float_input("image", [4, 8])], [float_input("y", [4, 8])], [])
    assert main(["verify", str(compiled), str(other)]) == 2
    err = capsys.readouterr().err
    assert "the artifact's inputs (x) do not match the model's (image)" in err
    assert "--shape" not in err


def test_run_writes_outputs_by_name(compiled, tmp_path):
    x = np.ones((4, 8), np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run", str(compiled), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        assert sorted(out.files) == ["y", "z"]
        np.testing.assert_allclose(out["z"], 2 * out["y"])


def test_run_names_a_wrong_input(compiled, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", image=np.ones((4, 8), np.float32))
    assert main(["run", str(compiled), "--inputs", str(tmp_path / "in.npz"),
                 "--outputs", str(tmp_path / "out.npz")]) == 2
    assert "unknown input 'image'; the model's inputs are x" in capsys.readouterr().err


def test_bench_prints_the_median(compiled, capsys):
    assert main(["bench", str(compiled), "--runs", "3", "--warmup", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 kernels, 1 threads, 3 runs" in out and "median" in out


@pytest.mark.parametrize("flag, value, message", [
    ("--runs", "0", "argument --runs: must be at least 1, not 0"),
    ("--warmup", "-1", "argument --warmup: must be at least 0, not -1"),
    ("--threads", "-1", "argument --threads: must be at least 0, not -1"),
    ("--runs", "many", "argument --runs: must be an integer, not 'many'"),
])
def test_bench_names_its_own_option_when_a_count_is_wrong(compiled, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(compiled), flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "-n RUNS" not in err and "runner" not in err


def test_bench_lists_the_slowest_kernels(compiled, capsys):
    assert main(["bench", str(compiled), "--runs", "3", "--warmup", "1", "--threads", "1",
                 "--kernels", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("kernel ")):]
    assert len(table) == 4 and table[-1].startswith("all 4 kernels")
    symbols = open_artifact(compiled).kernel_symbols()
    rows = [row.split() for row in table[1:3]]
    assert all(row[0] in symbols for row in rows)
    assert [float(r[1]) for r in rows] == sorted((float(r[1]) for r in rows), reverse=True)


def test_aarch64_compile_and_verify_under_qemu(onnx_mlp, stand_in_codegen, tmp_path, capsys):
    reason = cross_toolchain_missing()
    if reason:
        pytest.skip(f"cannot cross-build for aarch64: {reason}")
    out = tmp_path / "mlp-a64.kiln"
    assert main(["compile", str(onnx_mlp), "-o", str(out), "--target", "aarch64",
                 "--partitioner", "none", "--no-rewrite", "--profile-db", ":memory:"]) == 0
    assert main(["verify", str(out), str(onnx_mlp)]) == 0
    capsys.readouterr()
    assert main(["bench", str(out), "--runs", "2", "--warmup", "0"]) == 0
    printed = capsys.readouterr()
    assert "(aarch64, 4 kernels" in printed.out
    assert "ran under qemu-aarch64" in printed.err and "its times are emulated" in printed.err


# ---------------------------------------------------------------------------------------------
# Random inputs

def test_random_inputs_respect_gather_tables_masks_and_dtypes(tmp_path):
    table = numpy_helper.from_array(np.ones((37, 4), np.float32), "table")
    types = numpy_helper.from_array(np.ones((2, 4), np.float32), "types")
    shape = numpy_helper.from_array(np.array([10], np.int64), "flat")
    nodes = [
        helper.make_node("Reshape", ["input_ids", "flat"], ["ids_flat"]),
        helper.make_node("Gather", ["table", "ids_flat"], ["emb"]),
        helper.make_node("Cast", ["token_type_ids"], ["tt32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["types", "tt32"], ["tt_emb"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Not", ["keep"], ["drop"]),
    ]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [2, 5])
            for n in ("input_ids", "token_type_ids", "attention_mask")]
    keep = helper.make_tensor_value_info("keep", TensorProto.BOOL, [3])
    outputs = [float_input("emb", [10, 4]), float_input("tt_emb", [2, 5, 4]),
               float_input("maskf", [2, 5]), helper.make_tensor_value_info("drop", TensorProto.BOOL, [3])]
    path = save_model(tmp_path / "emb.onnx", nodes, [*ints, keep], outputs, [table, types, shape])
    graph = frontend.load(path)
    assert index_bounds(graph) == {"input_ids": 37, "token_type_ids": 2}
    specs = [TensorInfo(n, "int64", (2, 5)) for n in ("input_ids", "token_type_ids", "attention_mask")]
    specs += [TensorInfo("keep", "bool", (3,)), TensorInfo("pixels", "float32", (1000,))]
    for seed in range(5):
        values = random_inputs(specs, graph, seed)
        assert values["input_ids"].max() < 37 and values["input_ids"].min() >= 0
        assert set(np.unique(values["token_type_ids"])) <= {0, 1}
        np.testing.assert_array_equal(values["attention_mask"], np.ones((2, 5), np.int64))
        assert values["keep"].dtype == np.bool_
        assert values["pixels"].dtype == np.float32 and 0.5 < values["pixels"].std() < 1.5
    without_graph = random_inputs(specs)
    assert not without_graph["input_ids"].any()  # zeros: a valid index into any table
