"""Ops with their own loop nests beyond contractions and windows: recurrences, attention, losses,
scatters, quantization — against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.codegen.harness import check_model, model, random_inputs


@pytest.mark.parametrize("op,gates,direction", [("LSTM", 4, "bidirectional"), ("GRU", 3, "forward"),
                                                ("RNN", 1, "reverse")])
def test_recurrent(op, gates, direction):
    rng = np.random.default_rng(0)
    dirs = 2 if direction == "bidirectional" else 1
    hidden, features = 5, 3
    spec = {"x": ((4, 2, features), "float32")}
    inits = {"w": rng.standard_normal((dirs, gates * hidden, features)).astype(np.float32) * 0.5,
             "r": rng.standard_normal((dirs, gates * hidden, hidden)).astype(np.float32) * 0.5,
             "b": rng.standard_normal((dirs, 2 * gates * hidden)).astype(np.float32) * 0.1,
             "lens": np.array([4, 2], np.int32)}
    nodes = [helper.make_node(op, ["x", "w", "r", "b", "lens"], ["y", "yh"], hidden_size=hidden,
                              direction=direction)]
    check_model(model(nodes, spec, ["y", "yh"], inits), random_inputs(spec), ["none"])


def test_attention_with_cache_mask_and_gqa():
    spec = {"q": ((2, 4, 3, 8), "float32"), "k": ((2, 2, 3, 8), "float32"),
            "v": ((2, 2, 3, 6), "float32"), "m": ((3, 5), "bool"),
            "pk": ((2, 2, 2, 8), "float32"), "pv": ((2, 2, 2, 6), "float32")}
    nodes = [helper.make_node("Attention", ["q", "k", "v", "m", "pk", "pv"], ["y", "ck", "cv"],
                              is_causal=1, softcap=2.0)]
    inputs = random_inputs(spec)
    inputs["m"][:, 0] = True
    check_model(model(nodes, spec, ["y", "ck", "cv"], opset=23), inputs, ["none"])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_losses(reduction):
    spec = {"x": ((3, 5, 2), "float32"), "t": ((3, 2), "int64")}
    inits = {"w": np.linspace(0.5, 1.5, 5).astype(np.float32)}
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ["l", "lp"],
                              reduction=reduction, ignore_index=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t"], ["n"], reduction=reduction)]
    inputs = {"x": random_inputs({"x": spec["x"]})["x"], "t": np.array([[0, 1], [4, 2], [1, 3]])}
    check_model(model(nodes, spec, ["l", "lp", "n"], inits, opset=13), inputs, ["none"])


def test_scatters():
    spec = {"d": ((4, 3), "float32"), "u": ((2, 3), "float32")}
    inits = {"ie": np.array([[1, 0, 2], [1, 3, 0]], np.int64), "nd": np.array([[3], [1]], np.int64)}
    nodes = [helper.make_node("ScatterElements", ["d", "ie", "u"], ["a"], axis=0, reduction="add"),
             helper.make_node("ScatterND", ["a", "nd", "u"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    check_model(model(nodes, spec, ["y"], inits, opset=18), random_inputs(spec))


def test_quantize_roundtrip_and_qlinear_matmul():
    spec = {"x": ((4, 6), "float32")}
    rng = np.random.default_rng(5)
    inits = {"s": np.array(0.05, np.float32), "z": np.array(3, np.uint8),
             "ps": np.linspace(0.02, 0.07, 6).astype(np.float32), "pz": np.arange(6, dtype=np.int8),
             "b": rng.integers(0, 255, (6, 5)).astype(np.uint8), "bs": np.array(0.01, np.float32),
             "bz": np.array(128, np.uint8), "ys": np.array(0.2, np.float32),
             "yz": np.array(10, np.uint8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]),
             helper.make_node("QuantizeLinear", ["x", "ps", "pz"], ["pq"], axis=1),
             helper.make_node("QLinearMatMul", ["q", "s", "z", "b", "bs", "bz", "ys", "yz"], ["mm"]),
             helper.make_node("Cast", ["mm"], ["mmf"], to=TensorProto.FLOAT)]
    check_model(model(nodes, spec, ["dq", "pq", "mmf"], inits, opset=13), random_inputs(spec))


@pytest.mark.parametrize("kernel", [1, 3])
def test_qlinear_conv_accumulates_in_int32(kernel):
    """A QLinearConv's int32 accumulation: a 1 × 1 one asks for the target's micro-kernel shape
    (for int32: 4-byte lanes, as float32's) on its way to its own loops."""
    spec = {"x": ((1, 3, 7, 7), "float32")}
    rng = np.random.default_rng(11)
    inits = {"s": np.array(0.05, np.float32), "z": np.array(3, np.uint8),
             "w": rng.integers(0, 255, (4, 3, kernel, kernel)).astype(np.uint8),
             "ws": np.array(0.01, np.float32), "wz": np.array(128, np.uint8),
             "ys": np.array(0.5, np.float32), "yz": np.array(10, np.uint8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("QLinearConv", ["q", "s", "z", "w", "ws", "wz", "ys", "yz"], ["c"],
                              pads=[kernel // 2] * 4),
             helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT)]
    check_model(model(nodes, spec, ["cf"], inits, opset=13), random_inputs(spec))


@pytest.mark.parametrize("inverse,onesided", [(0, 0), (0, 1), (1, 0)])
def test_dft_reading_a_graph_input(inverse, onesided):
    """The input is tensor t0: generated loop names must not collide with tensor ids."""
    spec = {"x": ((2, 8, 1 if onesided else 2), "float32")}
    inits = {"axis": np.array(1, np.int64)}
    nodes = [helper.make_node("DFT", ["x", "", "axis"], ["y"], inverse=inverse, onesided=onesided)]
    check_model(model(nodes, spec, ["y"], inits, opset=20), random_inputs(spec), ["none"])


def test_determinants_with_pivoting():
    spec = {"x": ((3, 4, 4), "float32")}
    x = random_inputs(spec)["x"]
    x[0, 0, :] = 0.0  # a zero first pivot needs a row swap
    x[1] = 0.0  # singular
    check_model(model([helper.make_node("Det", ["x"], ["d"])], spec, ["d"]), {"x": x}, ["none"])
