"""Blocks of any shape the ABI allows: hand-made irregular blocks (anchors feeding anchors,
several outputs) and random DAGs cut into random blocks, against onnxruntime."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.blocks import build_plan
from kiln.target import host_target
from tests.codegen.harness import (
    assert_matches,
    model,
    random_inputs,
    reference,
    run_kernels,
)


def run_with_groups(m, inputs, groups_of):
    graph = frontend.build(m, {}, "t")
    plan = build_plan(graph, groups_of(graph), "test")
    kernels = generate(plan, host_target())
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(m, inputs))
    return kernels


def everything(graph):
    return [[op.id for op in graph.ops]]


def test_squeeze_excitation_in_one_block():
    """Conv → GlobalAveragePool → MatMul → Sigmoid → Mul(conv, gate): three anchors, one block."""
    rng = np.random.default_rng(0)
    spec = {"x": ((1, 4, 6, 6), "float32")}
    inits = {"w": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
             "fc": rng.standard_normal((8, 8)).astype(np.float32),
             "shape": np.array([1, 8], np.int64), "back": np.array([1, 8, 1, 1], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["gf"]),
             helper.make_node("MatMul", ["gf", "fc"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Reshape", ["s", "back"], ["sb"]),
             helper.make_node("Mul", ["c", "sb"], ["y"])]
    inputs = random_inputs(spec)
    (kernel,) = run_with_groups(model(nodes, spec, ["y"], inits), inputs, everything)
    assert kernel.scratch_bytes > 0  # the conv result is kept for the final multiply


def test_chained_matmuls_softmax_and_several_outputs():
    spec = {"a": ((3, 4), "float32"), "b": ((4, 5), "float32"), "c": ((5, 2), "float32")}
    nodes = [helper.make_node("MatMul", ["a", "b"], ["ab"]),
             helper.make_node("Relu", ["ab"], ["r"]),
             helper.make_node("Softmax", ["r"], ["s"], axis=0),
             helper.make_node("MatMul", ["s", "c"], ["y"]),
             helper.make_node("Transpose", ["y"], ["yt"])]
    run_with_groups(model(nodes, spec, ["yt", "r", "s"]), random_inputs(spec), everything)


def test_one_kernel_per_op_and_singletons():
    spec = {"a": ((2, 3), "float32")}
    nodes = [helper.make_node("Exp", ["a"], ["e"]), helper.make_node("Transpose", ["e"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["s"], keepdims=0)]
    run_with_groups(model(nodes, spec, ["s", "e"], opset=13), random_inputs(spec),
                    lambda g: [[op.id] for op in g.ops])


# --- random DAGs ------------------------------------------------------------------------------------
N = 5


@st.composite
def random_programs(draw):
    """Random graphs over (5, 5) float tensors: elementwise, transposes, matmuls, softmax,
    row reductions broadcast back; some intermediates are also outputs."""
    tensors = ["x", "y"]
    nodes, inits = [], {"axes": np.array([-1], np.int64)}
    for i in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "transpose", "matmul",
                                     "softmax", "reduce", "reshape", "gather", "concat", "expand",
                                     "layernorm", "where"]))
        a, b = draw(st.sampled_from(tensors)), draw(st.sampled_from(tensors))
        out = f"t{i}"
        if kind == "unary":
            op = draw(st.sampled_from(["Relu", "Tanh", "Neg", "Sigmoid", "Abs"]))
            nodes.append(helper.make_node(op, [a], [out]))
        elif kind == "binary":
            op = draw(st.sampled_from(["Add", "Mul", "Sub", "Max"]))
            nodes.append(helper.make_node(op, [a, b], [out]))
        elif kind == "transpose":
            nodes.append(helper.make_node("Transpose", [a], [out], perm=[1, 0]))
        elif kind == "matmul":
            nodes.append(helper.make_node("MatMul", [a, b], [out]))
        elif kind == "softmax":
            nodes.append(helper.make_node("Softmax", [a], [out], axis=draw(st.sampled_from([0, 1]))))
        elif kind == "reduce":
            op = draw(st.sampled_from(["ReduceMean", "ReduceMax", "ReduceSum"]))
            nodes.append(helper.make_node(op, [a, "axes"], [f"{out}r"]))
            nodes.append(helper.make_node("Sub", [b, f"{out}r"], [out]))
        elif kind == "gather":
            inits[f"{out}i"] = np.array(draw(st.permutations(range(N))), np.int64)
            nodes.append(helper.make_node("Gather", [a, f"{out}i"], [out],
                                          axis=draw(st.sampled_from([0, 1]))))
        elif kind == "concat":
            cut = draw(st.integers(1, N - 1))
            inits[f"{out}lo"], inits[f"{out}mid"] = np.array([0], np.int64), np.array([cut], np.int64)
            inits[f"{out}hi"] = np.array([N], np.int64)
            nodes.append(helper.make_node("Slice", [a, f"{out}lo", f"{out}mid"], [f"{out}p"]))
            nodes.append(helper.make_node("Slice", [b, f"{out}mid", f"{out}hi"], [f"{out}q"]))
            nodes.append(helper.make_node("Concat", [f"{out}p", f"{out}q"], [out], axis=0))
        elif kind == "expand":
            inits[f"{out}a"] = np.array([0], np.int64)
            inits[f"{out}s"] = np.array([N, N], np.int64)
            nodes.append(helper.make_node("ReduceSum", [a, f"{out}a"], [f"{out}r"]))
            nodes.append(helper.make_node("Expand", [f"{out}r", f"{out}s"], [out]))
        elif kind == "layernorm":
            inits[f"{out}g"] = np.linspace(0.5, 1.5, N).astype(np.float32)
            # epsilon 0.1: a row that is constant up to rounding (Relu of a sum) would otherwise
            # have its rounding noise amplified 300-fold by 1/sqrt(1e-5)
            nodes.append(helper.make_node("LayerNormalization", [a, f"{out}g"], [out], epsilon=0.1))
        elif kind == "where":
            nodes.append(helper.make_node("Greater", [a, b], [f"{out}c"]))
            nodes.append(helper.make_node("Where", [f"{out}c", a, b], [out]))
        else:
            inits[f"{out}s"] = np.array([N * N], np.int64)
            inits[f"{out}b"] = np.array([N, N], np.int64)
            nodes.append(helper.make_node("Reshape", [a, f"{out}s"], [f"{out}f"]))
            nodes.append(helper.make_node("Reshape", [f"{out}f", f"{out}b"], [out]))
        tensors.append(out)
    produced = tensors[2:]
    used = {i for n in nodes for i in n.input}
    outputs = [t for t in produced if t not in used]
    outputs += [t for t in produced if t in used and draw(st.integers(0, 3)) == 0]
    cuts = sorted(set(draw(st.lists(st.integers(1, len(nodes)), max_size=4))))
    return nodes, inits, outputs, cuts


@settings(max_examples=25, deadline=None)
@given(random_programs())
def test_random_dags_in_random_blocks(program):
    nodes, inits, outputs, cuts = program
    spec = {"x": ((N, N), "float32"), "y": ((N, N), "float32")}
    m = model(nodes, spec, outputs, inits, opset=18)

    def groups(graph):
        ids = [op.id for op in graph.ops]
        bounds = [0] + [c for c in cuts if c < len(ids)] + [len(ids)]
        return [ids[lo:hi] for lo, hi in itertools.pairwise(bounds) if hi > lo]

    run_with_groups(m, random_inputs(spec), groups)
