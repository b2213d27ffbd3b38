"""Elementwise ops: broadcasting, dtypes, ONNX integer semantics and NaN handling, all three
partitioners, against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import target
from tests.codegen.harness import check_model, model, plan_for, random_inputs, run_graph

SMALL_DIMS = st.sampled_from([1, 2, 3, 5])


@st.composite
def broadcast_shapes(draw):
    out = draw(st.lists(SMALL_DIMS, min_size=1, max_size=4))
    def operand():
        rank = draw(st.integers(0, len(out)))
        return tuple(1 if draw(st.booleans()) else n for n in out[len(out) - rank:])
    return operand(), operand(), operand()


@settings(max_examples=12, deadline=None)
@given(broadcast_shapes(), st.sampled_from(["float32", "int32"]))
def test_broadcast_chain(shapes, dtype):
    a, b, c = shapes
    spec = {"a": (a, dtype), "b": (b, dtype), "c": (c, dtype)}
    nodes = [helper.make_node("Add", ["a", "b"], ["ab"]),
             helper.make_node("Mul", ["ab", "c"], ["abc"]),
             helper.make_node("Max", ["abc", "a"], ["m"]),
             helper.make_node("Greater", ["m", "b"], ["g"]),
             helper.make_node("Where", ["g", "m", "c"], ["y"])]
    check_model(model(nodes, spec, ["y", "ab"]), random_inputs(spec))


UNARY = ["Abs", "Neg", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Erf", "Softplus",
         "Softsign", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "LeakyRelu", "Sign",
         "Floor", "Ceil", "Round", "Reciprocal", "Sin", "Cos", "Atan", "Mish", "IsNaN", "IsInf",
         "ThresholdedRelu", "Shrink"]


def test_unary_ops():
    spec = {"x": ((3, 7), "float32")}
    x = random_inputs(spec)["x"] * 3
    x[0, :4] = [np.nan, np.inf, -np.inf, 0.5]
    nodes = [helper.make_node(op, ["x"], [f"y{i}"]) for i, op in enumerate(UNARY)]
    nodes.append(helper.make_node("Gelu", ["x"], ["g0"]))
    nodes.append(helper.make_node("Gelu", ["x"], ["g1"], approximate="tanh"))
    outputs = [f"y{i}" for i in range(len(UNARY))] + ["g0", "g1"]
    check_model(model(nodes, spec, outputs, opset=20), {"x": x}, ["none", "dnnfusion"])


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8"])
def test_integer_division_and_modulo(dtype):
    spec = {"a": ((2, 6), dtype), "b": ((6,), dtype)}
    signed = np.dtype(dtype).kind == "i"
    a = np.array([[-7, 7, -7, 7, 100, -100], [5, -5, 0, 9, -9, 3]] if signed else
                 [[7, 8, 9, 200, 100, 1], [5, 5, 0, 9, 9, 3]]).astype(dtype)
    b = np.array([2, -2, -3, 3, 7, -7] if signed else [2, 3, 4, 5, 7, 6]).astype(dtype)
    nodes = [helper.make_node("Div", ["a", "b"], ["q"]),
             helper.make_node("Mod", ["a", "b"], ["r"]),
             helper.make_node("Mod", ["a", "b"], ["f"], fmod=1),
             helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("Mul", ["a", "a"], ["p"])]
    check_model(model(nodes, spec, ["q", "r", "f", "s", "p"]), {"a": a, "b": b}, ["none"])


def test_nan_propagation_matches_onnxruntime():
    spec = {"a": ((4,), "float32"), "b": ((4,), "float32")}
    a = np.array([np.nan, 1, -1, np.nan], np.float32)
    b = np.array([0, np.nan, 2, np.nan], np.float32)
    nodes = [helper.make_node("Max", ["a", "b"], ["mx"]), helper.make_node("Min", ["a", "b"], ["mn"]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Clip", ["a", "lo", "hi"], ["c"])]
    inits = {"lo": np.array(0, np.float32), "hi": np.array(0.5, np.float32)}
    check_model(model(nodes, spec, ["mx", "mn", "r", "c"], inits), {"a": a, "b": b}, ["none"])


CAST_TYPES = ["float32", "float64", "int8", "int32", "int64", "uint8", "uint16", "bool"]


@pytest.mark.parametrize("source", CAST_TYPES)
def test_casts(source):
    spec = {"x": ((10,), source)}
    x = np.array([0, 1, -1, 2.7, -2.7, 100, 300.5, -0.5, 7, 0.49])
    if source != "bool":
        x = x.astype(np.float64)
        info = np.iinfo(source) if np.dtype(source).kind in "iu" else None
        x = np.clip(x, info.min, info.max).astype(source) if info else x.astype(source)
    else:
        x = x != 0
    targets = [t for t in CAST_TYPES if not (np.dtype(source).kind == "f" and t in ("uint8", "uint16"))]
    nodes = [helper.make_node("Cast", ["x"], [f"y{i}"], to=helper.np_dtype_to_tensor_dtype(np.dtype(t)))
             for i, t in enumerate(targets)]
    check_model(model(nodes, spec, [f"y{i}" for i in range(len(targets))]), {"x": x}, ["none"])


def test_logic_bitwise_and_comparisons():
    spec = {"a": ((3, 4), "bool"), "b": ((4,), "bool"), "u": ((3, 4), "uint8"), "v": ((3, 4), "uint8")}
    nodes = [helper.make_node("And", ["a", "b"], ["and"]), helper.make_node("Or", ["a", "b"], ["or"]),
             helper.make_node("Xor", ["a", "b"], ["xor"]), helper.make_node("Not", ["a"], ["not"]),
             helper.make_node("BitwiseAnd", ["u", "v"], ["band"]),
             helper.make_node("BitShift", ["u", "v"], ["shl"], direction="LEFT"),
             helper.make_node("LessOrEqual", ["u", "v"], ["le"]),
             helper.make_node("Equal", ["a", "b"], ["eq"])]
    inputs = random_inputs(spec)
    inputs["v"] = inputs["v"] % 9
    check_model(model(nodes, spec, ["and", "or", "xor", "not", "band", "shl", "le", "eq"], opset=18),
                inputs, ["none", "dnnfusion"])


def test_pow_special_exponents_and_variadic():
    spec = {"x": ((2, 3), "float32"), "y": ((3,), "float32")}
    inits = {"two": np.array(2.0, np.float32), "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("Pow", ["x", "two"], ["p2"]),
             helper.make_node("Abs", ["x"], ["ax"]),
             helper.make_node("Pow", ["ax", "half"], ["ph"]),
             helper.make_node("Pow", ["ax", "y"], ["py"]),
             helper.make_node("Sum", ["x", "y", "p2"], ["s"]),
             helper.make_node("Mean", ["x", "y"], ["m"])]
    check_model(model(nodes, spec, ["p2", "ph", "py", "s", "m"], inits), random_inputs(spec))


def test_batchnorm_inference():
    spec = {"x": ((2, 3, 4, 5), "float32")}
    rng = np.random.default_rng(1)
    inits = {n: rng.random(3).astype(np.float32) + 0.5 for n in ("s", "b", "m", "v")}
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3),
             helper.make_node("Relu", ["y"], ["z"])]
    check_model(model(nodes, spec, ["z"], inits), random_inputs(spec))


def test_bool_output_dtype_is_exact():
    spec = {"x": ((5,), "float32")}
    nodes = [helper.make_node("Cast", ["x"], ["b"], to=TensorProto.BOOL)]
    check_model(model(nodes, spec, ["b"]), {"x": np.array([0, -0.0, 1, np.nan, 2], np.float32)},
                ["none"])


def _logistic_inputs() -> np.ndarray:
    """Special values, the tails where exp(-x) or its reciprocal leaves the normal range, and a
    dense sweep of the range activations see."""
    rng = np.random.default_rng(3)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45, 1e-8, -1e-8,
               0.5, -0.5, 4.0, -4.0, 10.0, -10.0, 10.6, -10.6, 11.0, -11.0, 17.0, -17.0, 20.0,
               -20.0, 87.0, -87.0, 87.3, -87.3, 87.5, -87.5, 88.0, -88.0, 88.5, -88.5, 88.8,
               -88.8, 89.5, -89.5, 104.0, -104.0, 1e4, -1e4, 1e13, -1e13, 3e38, -3e38]
    dense = rng.uniform(-1, 1, 20_000) * 12
    wide = rng.uniform(-1, 1, 4_000) * 100
    small = rng.uniform(-1, 1, 2_000) * 1e-3
    return np.concatenate([special, dense, wide, small]).astype(np.float32)


def test_logistic_activations_within_a_few_ulp_of_float64():
    """Sigmoid, SiLU (Sigmoid then Mul, and Swish) and GELU's tanh form, x / (1 + exp(-2u)), are
    within 4 ulp of float64 where the result is normal, plus for GELU 3 ulp per unit of |2u|
    (2u is rounded in float32, and exp turns its absolute error into the result's relative
    error). Where the logistic factor leaves the normal range, within |x|·2^-126 (exp_flush's
    tails). NaN and infinities as in float64."""
    x = _logistic_inputs()
    spec = {"x": ((x.size,), "float32")}
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["silu"]),
             helper.make_node("Swish", ["x"], ["swish"]),
             helper.make_node("Gelu", ["x"], ["gelu"], approximate="tanh")]
    outputs = ["s", "silu", "swish", "gelu"]
    graph = frontend.build(model(nodes, spec, outputs, opset=24), {}, "test")
    d = x.astype(np.float64)
    with np.errstate(all="ignore"):
        sig = 1 / (1 + np.exp(-d))
        twice_u = 2 * np.sqrt(2 / np.pi) * (d + 0.044715 * d ** 3)
        want = {"s": sig, "silu": d * sig, "swish": d * sig, "gelu": d / (1 + np.exp(-twice_u))}
    rounded_argument = {"s": 0, "silu": 0, "swish": 0, "gelu": np.abs(twice_u)}
    tiny = float(np.finfo(np.float32).tiny)
    for name in ("none", "dnnfusion"):
        got = dict(zip(outputs, run_graph(graph, name, {"x": x})))
        for out, ref in want.items():
            y = got[out].astype(np.float64)
            spacing = np.spacing(np.abs(ref.astype(np.float32))).astype(np.float64)
            with np.errstate(all="ignore"):
                err = np.abs(y - ref)
                allowed = np.where(np.abs(ref) >= tiny * np.maximum(np.abs(d), 1),
                                   (4 + 3 * rounded_argument[out]) * spacing,
                                   np.maximum(np.abs(d), 1) * tiny)
            bad = ~(err <= allowed) & ~(np.isnan(y) & np.isnan(ref)) & ~(y == ref)
            assert not bad.any(), (name, out, x[bad][:5], y[bad][:5], ref[bad][:5])


@pytest.mark.parametrize("gpu", ["opencl", "cuda"])
def test_gpu_languages_spell_kilns_own_functions_with_libms(gpu):
    """exp_flush and gelu_erf are Kiln's C; a GPU language gets exp and erf instead."""
    spec = {"x": ((4, 8), "float32")}
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("Gelu", ["x"], ["g0"]),
             helper.make_node("Gelu", ["x"], ["g1"], approximate="tanh")]
    graph = frontend.build(model(nodes, spec, ["s", "g0", "g1"], opset=20), {}, "test")
    source = "\n".join(k.source for k in generate(plan_for(graph, "dnnfusion"), target(gpu)))
    assert "exp(" in source and "erf(" in source
    assert "exp_flush" not in source and "gelu_erf" not in source and "kiln_expf" not in source
