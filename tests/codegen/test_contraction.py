"""MatMul, Gemm and Einsum, with prologues (ops evaluated while reading operands) and epilogues
(ops applied to results before the store)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from tests.codegen.harness import check_model, model, random_inputs


@st.composite
def matmul_shapes(draw):
    m, k, n = (draw(st.integers(1, 9)) for _ in range(3))
    batch = draw(st.lists(st.sampled_from([1, 2, 3]), max_size=2))
    a_batch = [1 if draw(st.booleans()) else b for b in batch][draw(st.integers(0, len(batch))):]
    b_batch = [1 if draw(st.booleans()) else b for b in batch][draw(st.integers(0, len(batch))):]
    a = (k,) if draw(st.integers(0, 5)) == 0 else (*a_batch, m, k)
    b = (k,) if draw(st.integers(0, 5)) == 0 else (*b_batch, k, n)
    return a, b


@settings(max_examples=15, deadline=None)
@given(matmul_shapes())
def test_batched_broadcast_matmul(shapes):
    a, b = shapes
    spec = {"a": (a, "float32"), "b": (b, "float32")}
    check_model(model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"]),
                random_inputs(spec))


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("bias_shape", [None, (1,), (7,), (5, 1), (5, 7)])
def test_gemm(trans_a, trans_b, bias_shape):
    a = (3, 5) if trans_a else (5, 3)
    b = (7, 3) if trans_b else (3, 7)
    spec = {"a": (a, "float32")}
    rng = np.random.default_rng(0)
    inits = {"b": rng.standard_normal(b).astype(np.float32)}
    inputs = ["a", "b"]
    if bias_shape:
        inits["c"] = rng.standard_normal(bias_shape).astype(np.float32)
        inputs.append("c")
    nodes = [helper.make_node("Gemm", inputs, ["y"], transA=trans_a, transB=trans_b, alpha=0.5,
                              beta=2.0),
             helper.make_node("Relu", ["y"], ["z"])]
    check_model(model(nodes, spec, ["z"], inits), random_inputs(spec))


def test_matmul_prologue_and_epilogue():
    """bias+GELU feeding A, a transposed activation as B, bias and a head split after."""
    spec = {"x": ((2, 6, 8), "float32"), "w": ((2, 16, 8), "float32")}
    rng = np.random.default_rng(3)
    inits = {"b0": rng.standard_normal(8).astype(np.float32),
             "b1": rng.standard_normal(16).astype(np.float32),
             "shape": np.array([2, 6, 4, 4], np.int64)}
    nodes = [helper.make_node("Add", ["x", "b0"], ["xb"]),
             helper.make_node("Erf", ["xb"], ["e"]),
             helper.make_node("Mul", ["xb", "e"], ["g"]),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["g", "wt"], ["mm"]),
             helper.make_node("Add", ["mm", "b1"], ["y"]),
             helper.make_node("Reshape", ["y", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["heads"], perm=[0, 2, 1, 3])]
    check_model(model(nodes, spec, ["heads"], inits), random_inputs(spec))


def test_attention_scores_with_transposed_key():
    spec = {"q": ((1, 2, 5, 4), "float32"), "k": ((1, 2, 5, 4), "float32"),
            "v": ((1, 2, 5, 4), "float32")}
    inits = {"scale": np.array(0.5, np.float32)}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    check_model(model(nodes, spec, ["o"], inits), random_inputs(spec))


def test_large_matmul_with_partial_tiles():
    spec = {"a": ((37, 70), "float32")}
    inits = {"b": np.random.default_rng(2).standard_normal((70, 301)).astype(np.float32)}
    check_model(model([helper.make_node("MatMul", ["a", "b"], ["y"]),
                       helper.make_node("Tanh", ["y"], ["z"])], spec, ["z"], inits),
                random_inputs(spec))


@pytest.mark.parametrize("equation,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,kj->ik", [(3, 4), (5, 4)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
    ("i,i", [(6,), (6,)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
])
def test_einsum(equation, shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    spec = {n: (s, "float32") for n, s in zip(names, shapes)}
    nodes = [helper.make_node("Einsum", names, ["y"], equation=equation)]
    check_model(model(nodes, spec, ["y"], opset=12), random_inputs(spec))
