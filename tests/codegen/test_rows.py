"""Reductions and normalisations: row stages, two-phase reductions with broadcast epilogues, and
"row blocks" with several reductions over the same rows (hand-made plans)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.blocks import build_plan
from kiln.target import host_target
from tests.codegen.harness import (
    assert_matches,
    check_model,
    model,
    random_inputs,
    reference,
    run_kernels,
)

REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("axes,keepdims", [([-1], 1), ([1], 0), ([0, 2], 1), ([], 1)])
def test_reductions(axes, keepdims):
    spec = {"x": ((3, 4, 5), "float32")}
    x = np.abs(random_inputs(spec)["x"]) + 0.1
    inits = {"axes": np.array(axes, np.int64)}
    nodes = [helper.make_node(op, ["x", "axes"], [f"y{i}"], keepdims=keepdims)
             for i, op in enumerate(REDUCE)]
    outputs = [f"y{i}" for i in range(len(REDUCE))]
    check_model(model(nodes, spec, outputs, inits, opset=18), {"x": x}, ["none", "dnnfusion"])


def test_integer_reductions_and_arg_ops():
    spec = {"x": ((4, 6), "int32"), "f": ((4, 6), "float32")}
    inputs = random_inputs(spec)
    inputs["f"][1, 2] = inputs["f"][1, 4] = 9.0  # a tie
    inits = {"axes": np.array([1], np.int64)}
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"]),
             helper.make_node("ReduceMax", ["x", "axes"], ["m"], keepdims=0),
             helper.make_node("ArgMax", ["f"], ["am"], axis=1),
             helper.make_node("ArgMax", ["f"], ["aml"], axis=1, select_last_index=1),
             helper.make_node("ArgMin", ["f"], ["an"], axis=0, keepdims=0)]
    check_model(model(nodes, spec, ["s", "m", "am", "aml", "an"], inits, opset=18), inputs)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis,opset", [(-1, 13), (1, 13), (1, 11)])
def test_softmax_family(op, axis, opset):
    spec = {"x": ((2, 3, 4), "float32")}
    check_model(model([helper.make_node(op, ["x"], ["y"], axis=axis)], spec, ["y"], opset=opset),
                random_inputs(spec))


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_of_wide_rows_with_masked_scores(op):
    """Rows of 197 spread over hundreds, a third of them -inf (masked): exp(x − max) below 2^-126,
    which the softmax's exp_flush makes 0, changes no result."""
    spec = {"x": ((3, 5, 197), "float32")}
    inputs = random_inputs(spec)
    inputs["x"] = inputs["x"] * 60
    inputs["x"][..., ::3] = -np.inf
    check_model(model([helper.make_node(op, ["x"], ["y"], axis=-1)], spec, ["y"], opset=13),
                inputs)


def test_normalizations():
    rng = np.random.default_rng(0)
    spec = {"x": ((2, 4, 3, 5), "float32")}
    inits = {"g": rng.standard_normal((3, 5)).astype(np.float32),
             "b": rng.standard_normal((3, 5)).astype(np.float32),
             "c": rng.standard_normal(4).astype(np.float32),
             "d": rng.standard_normal(4).astype(np.float32)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln", "mean", "inv"], axis=2),
             helper.make_node("InstanceNormalization", ["x", "c", "d"], ["inn"]),
             helper.make_node("LpNormalization", ["x"], ["lp"], axis=1, p=1)]
    check_model(model(nodes, spec, ["ln", "mean", "inv", "inn", "lp"], inits, opset=17),
                random_inputs(spec))


def test_two_phase_reduction_with_broadcast_epilogue():
    """ReduceMean → Sub(x, mean): one loop per row, reduction then the broadcast epilogue."""
    spec = {"x": ((6, 32), "float32")}
    inits = {"axes": np.array([-1], np.int64)}
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"]),
             helper.make_node("Sub", ["x", "m"], ["y"])]
    m = model(nodes, spec, ["y"], inits, opset=18)
    check_model(m, random_inputs(spec))
    graph = frontend.build(m, {}, "t")
    kernels = generate(build_plan(graph, [[op.id for op in graph.ops]], "test"), host_target())
    assert len(kernels[0].schedule["stages"]) == 1
    assert kernels[0].scratch_bytes == 0


def _decomposed_layer_norm():
    spec = {"x": ((2, 5, 16), "float32")}
    rng = np.random.default_rng(1)
    inits = {"axes": np.array([-1], np.int64), "two": np.array(2.0, np.float32),
             "eps": np.array(1e-5, np.float32), "g": rng.standard_normal(16).astype(np.float32),
             "b": rng.standard_normal(16).astype(np.float32)}
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"]),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p", "axes"], ["v"]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["ng"]),
             helper.make_node("Add", ["ng", "b"], ["y"])]
    return model(nodes, spec, ["y"], inits, opset=18), spec


def _decomposed_softmax():
    spec = {"x": ((3, 4, 10), "float32")}
    inits = {"axes": np.array([-1], np.int64)}
    nodes = [helper.make_node("ReduceMax", ["x", "axes"], ["m"]),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Exp", ["d"], ["e"]),
             helper.make_node("ReduceSum", ["e", "axes"], ["s"]),
             helper.make_node("Div", ["e", "s"], ["y"]),
             helper.make_node("Softmax", ["y"], ["z"], axis=-1)]
    return model(nodes, spec, ["z"], inits, opset=18), spec


@pytest.mark.parametrize("build", [_decomposed_layer_norm, _decomposed_softmax])
def test_row_block_with_several_reductions(build):
    """A planner "row block": every op in one block; one stage, one loop over rows, phases."""
    m, spec = build()
    inputs = random_inputs(spec)
    graph = frontend.build(m, {}, "t")
    plan = build_plan(graph, [[op.id for op in graph.ops]], "test")
    (kernel,) = generate(plan, host_target())
    assert len(kernel.schedule["stages"]) == 1
    assert kernel.scratch_bytes == 0
    values = run_kernels(plan, [kernel], dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(m, inputs))


def test_cumulative_and_topk():
    spec = {"x": ((3, 7), "float32")}
    inits = {"axis": np.array(1, np.int64), "k": np.array([3], np.int64)}
    x = random_inputs(spec)["x"]
    x[0, 1] = x[0, 5]  # a tie
    nodes = [helper.make_node("CumSum", ["x", "axis"], ["c"], exclusive=1, reverse=1),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1),
             helper.make_node("TopK", ["x", "k"], ["sv", "si"], axis=0, largest=0)]
    check_model(model(nodes, spec, ["c", "v", "i", "sv", "si"], inits), {"x": x})


@pytest.mark.parametrize("pixels,op", [((9, 15), "LayerNormalization"),
                                       ((8, 8), "LayerNormalization"), ((7, 11), "Softmax"),
                                       ((1, 1), "LayerNormalization")])
def test_rows_side_by_side_run_across_the_vector_lanes(pixels, op):
    """A normalisation over the channels of an NCHW tensor read as NHWC through a Transpose
    (ConvNeXt's LayerNorm): the rows lie side by side, and the row stage runs tiles of rows along
    the vector lanes, per-row values computed once per row; 135 rows leave a ragged tile, 64 rows
    four whole ones of 16, a single row the row-by-row loop. Against onnxruntime."""
    h, w = pixels
    spec = {"x": ((1, 24, h, w), "float32")}
    rng = np.random.default_rng(7)
    inits = {"g": rng.standard_normal(24).astype(np.float32),
             "b": rng.standard_normal(24).astype(np.float32)}
    norm = (helper.make_node(op, ["t", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
            if op == "LayerNormalization" else helper.make_node(op, ["t"], ["y"], axis=-1))
    m = model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]), norm], spec, ["y"],
              inits if op == "LayerNormalization" else {}, opset=17)
    inputs = random_inputs(spec)
    graph = frontend.build(m, {}, "t")
    plan = build_plan(graph, [set(op.id for op in graph.ops)], "hand")
    kernels = generate(plan, host_target())
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(m, inputs))
    source = "\n".join(k.source for k in kernels)
    across = re.search(r"col0\[(16|32|48|64)\]", source) is not None  # a tile's accumulators
    assert across == (h * w > 1), source


def test_rows_side_by_side_keep_their_accumulators_in_the_loop():
    """Across the lanes, what a loop over the row accumulates (Softmax's running max and sum of
    a row constant along itself: column sums broadcast and transposed) is not a per-row value
    computed before the loop."""
    spec = {"x": ((5, 5), "float32")}
    inits = {"a": np.array([0], np.int64), "s": np.array([5, 5], np.int64)}
    nodes = [helper.make_node("ReduceSum", ["x", "a"], ["r"]),
             helper.make_node("Expand", ["r", "s"], ["e"]),
             helper.make_node("Transpose", ["e"], ["t"], perm=[1, 0]),
             helper.make_node("Softmax", ["t"], ["y"], axis=1)]
    m = model(nodes, spec, ["y"], inits, opset=18)
    inputs = random_inputs(spec)
    graph = frontend.build(m, {}, "t")
    plan = build_plan(graph, [set(op.id for op in graph.ops)], "hand")
    values = run_kernels(plan, generate(plan, host_target()),
                         dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(m, inputs))
