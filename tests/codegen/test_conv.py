"""Convolutions and pooling with random attributes (1-D/2-D/3-D, groups, strides, dilations,
pads, auto_pad), fused Pad/bias/activation/residual, against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.rewrite import rewrite
from tests.codegen.harness import (PARTITIONERS, assert_matches, check_model, model, random_inputs,
                                   reference, run_graph)


@st.composite
def conv_cases(draw):
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    group = draw(st.sampled_from([1, 1, 2]))
    cin = group * draw(st.integers(1, 3))
    cout = group * draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 2)) for _ in range(rank)]
    dilations = [draw(st.integers(1, 2)) for _ in range(rank)]
    spatial = [draw(st.integers(max(1, (k - 1) * d + 1), 9)) for k, d in zip(kernel, dilations)]
    auto_pad = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    attrs = {"kernel_shape": kernel, "strides": strides, "group": group, "auto_pad": auto_pad}
    if auto_pad == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, 2)) for _ in range(2 * rank)]
        attrs["dilations"] = dilations
    return (1 + draw(st.integers(0, 1)), cin, *spatial), (cout, cin // group, *kernel), attrs


@settings(max_examples=15, deadline=None)
@given(conv_cases(), st.booleans())
def test_conv_attributes(case, bias):
    x_shape, w_shape, attrs = case
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal(w_shape).astype(np.float32)}
    inputs = ["x", "w"]
    if bias:
        inits["b"] = rng.standard_normal(w_shape[0]).astype(np.float32)
        inputs.append("b")
    spec = {"x": (x_shape, "float32")}
    nodes = [helper.make_node("Conv", inputs, ["y"], **attrs), helper.make_node("Relu", ["y"], ["z"])]
    check_model(model(nodes, spec, ["z"], inits), random_inputs(spec))


def test_depthwise_pointwise_residual_block():
    """MobileNet-style: pointwise expand, depthwise 3x3 stride 1, Clip, pointwise project, add."""
    rng = np.random.default_rng(1)
    spec = {"x": ((1, 8, 10, 10), "float32")}
    inits = {"w1": rng.standard_normal((16, 8, 1, 1)).astype(np.float32),
             "w2": rng.standard_normal((16, 1, 3, 3)).astype(np.float32),
             "w3": rng.standard_normal((8, 16, 1, 1)).astype(np.float32),
             "b": rng.standard_normal(16).astype(np.float32),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b"], ["e"], kernel_shape=[1, 1]),
             helper.make_node("Clip", ["e", "lo", "hi"], ["ec"]),
             helper.make_node("Conv", ["ec", "w2"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              group=16),
             helper.make_node("Clip", ["d", "lo", "hi"], ["dc"]),
             helper.make_node("Conv", ["dc", "w3"], ["p"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["p", "x"], ["y"])]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


def test_pad_folded_into_conv_and_swish():
    rng = np.random.default_rng(2)
    spec = {"x": ((1, 4, 9, 9), "float32")}
    inits = {"w": rng.standard_normal((6, 4, 3, 3)).astype(np.float32),
             "pads": np.array([0, 0, 0, 1, 0, 0, 1, 0], np.int64)}
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"]),
             helper.make_node("Conv", ["xp", "w"], ["c"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


def test_zero_pad_between_blocks_becomes_the_conv_padding():
    """EfficientNet's stride-2 stage: 1×1 Conv + SiLU, a zero Pad (end only, the Conv VALID), a
    depthwise Conv + SiLU. The rewrite folds the Pad into the Conv's pads, so under every
    partitioner no kernel writes the padded tensor (the planners used to put the Pad in the
    1×1 conv's block: a second pass over a larger tensor). It matches onnxruntime."""
    rng = np.random.default_rng(4)
    spec = {"x": ((1, 3, 11, 11), "float32")}
    inits = {"w1": rng.standard_normal((8, 3, 1, 1)).astype(np.float32),
             "w2": rng.standard_normal((8, 1, 3, 3)).astype(np.float32),
             "b2": rng.standard_normal(8).astype(np.float32),
             "pads": np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64),
             "zero": np.array(0, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["e"], kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["e"], ["es"]),
             helper.make_node("Mul", ["e", "es"], ["a"]),
             helper.make_node("Pad", ["a", "pads", "zero"], ["ap"], mode="constant"),
             helper.make_node("Conv", ["ap", "w2", "b2"], ["d"], kernel_shape=[3, 3],
                              strides=[2, 2], group=8, auto_pad="VALID"),
             helper.make_node("Sigmoid", ["d"], ["ds"]),
             helper.make_node("Mul", ["d", "ds"], ["y"])]
    onnx_model = model(nodes, spec, ["y"], inits)
    inputs = random_inputs(spec)
    want = reference(onnx_model, inputs)
    graph = rewrite(frontend.build(onnx_model, {}, "test")).graph
    assert not [op for op in graph.ops if op.op_type == "Pad"]
    depthwise = next(op for op in graph.ops if op.attrs.get("group") == 8)
    assert graph.tensors[depthwise.inputs[0]].shape == (1, 8, 11, 11)
    assert list(depthwise.attrs["pads"]) == [0, 0, 1, 1]
    for name in PARTITIONERS:
        assert_matches(run_graph(graph, name, inputs), want, f"[{name}]")


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2]},
    {"kernel_shape": [3, 2], "pads": [1, 0, 0, 1], "strides": [2, 1], "output_padding": [1, 0]},
    {"kernel_shape": [2, 2], "strides": [2, 2], "group": 2, "dilations": [1, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
])
def test_conv_transpose(attrs):
    rng = np.random.default_rng(3)
    group = attrs.get("group", 1)
    spec = {"x": ((1, 4, 4, 5), "float32")}
    inits = {"w": rng.standard_normal((4, 6 // group, *attrs["kernel_shape"])).astype(np.float32),
             "b": rng.standard_normal(6).astype(np.float32)}
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1, "dilations": [2, 1]}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("LpPool", {"kernel_shape": [2, 2], "p": 3}),
])
def test_pools(op, attrs):
    spec = {"x": ((2, 3, 7, 6), "float32")}
    check_model(model([helper.make_node(op, ["x"], ["y"], **attrs)], spec, ["y"], opset=19),
                random_inputs(spec))


@pytest.mark.parametrize("op,shape,attrs", [
    # ResNet's stem pool: each row's pixels whose window lies inside the input run as a vector loop
    ("MaxPool", (1, 3, 40, 37), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", (2, 2, 9, 50), {"kernel_shape": [3, 5], "pads": [2, 0, 0, 3], "dilations": [1, 2],
                                "ceil_mode": 1, "strides": [1, 3]}),
    ("MaxPool", (1, 2, 12, 40), {"kernel_shape": [7, 7], "pads": [3, 3, 3, 3]}),  # looped taps
    ("MaxPool", (1, 3, 45), {"kernel_shape": [4], "strides": [2], "pads": [1, 2]}),
    ("MaxPool", (1, 2, 5, 6, 36), {"kernel_shape": [2, 3, 3], "pads": [1, 1, 1, 0, 1, 1]}),
    ("AveragePool", (1, 3, 20, 41), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1],
                                     "strides": [2, 2]}),
    ("AveragePool", (1, 2, 9, 40), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1],
                                    "count_include_pad": 1, "ceil_mode": 1, "strides": [2, 2]}),
    ("LpPool", (1, 2, 6, 35), {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1], "p": 2}),
])
def test_pools_with_interior_runs(op, shape, attrs):
    spec = {"x": (shape, "float32")}
    check_model(model([helper.make_node(op, ["x"], ["y"], **attrs)], spec, ["y"], opset=19),
                random_inputs(spec))


def test_maxpool_indices_and_int8_with_interior_runs():
    spec = {"x": ((1, 2, 7, 40), "float32")}
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], storage_order=1)]
    check_model(model(nodes, spec, ["y", "i"]), random_inputs(spec))
    spec = {"x": ((1, 2, 7, 40), "int8")}
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    check_model(model(nodes, spec, ["y"], opset=12), random_inputs(spec))


def test_maxpool_indices():
    spec = {"x": ((1, 2, 5, 5), "float32")}
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2],
                              ceil_mode=1)]
    check_model(model(nodes, spec, ["y", "i"]), random_inputs(spec))


def test_global_pools_and_flatten_gemm_head():
    rng = np.random.default_rng(4)
    spec = {"x": ((2, 8, 5, 5), "float32")}
    inits = {"w": rng.standard_normal((10, 8)).astype(np.float32),
             "b": rng.standard_normal(10).astype(np.float32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"]),
             helper.make_node("GlobalMaxPool", ["x"], ["gm"]),
             helper.make_node("Add", ["g", "gm"], ["s"]),
             helper.make_node("Flatten", ["s"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1)]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


@st.composite
def depthwise_cases(draw):
    """2-D convs with one input channel per group (the depthwise kernel): channel multiplier,
    kernels up to 5×5, strides, dilations, asymmetric pads, inputs smaller than the window's
    reach (no interior at all) and sizes that leave several border rows and columns."""
    channels = draw(st.integers(1, 5))
    multiplier = draw(st.sampled_from([1, 1, 2]))
    kernel = [draw(st.integers(1, 5)) for _ in range(2)]
    strides = [draw(st.integers(1, 3)) for _ in range(2)]
    dilations = [draw(st.integers(1, 2)) for _ in range(2)]
    spatial = [draw(st.integers(1, 13)) for _ in range(2)]
    pads = [draw(st.integers(0, 3)) for _ in range(4)]
    for d in range(2):  # at least one output position per dim
        reach = (kernel[d] - 1) * dilations[d] + 1
        spatial[d] = max(spatial[d], reach - pads[d] - pads[d + 2])
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads,
             "group": channels}
    return ((draw(st.integers(1, 2)), channels, *spatial),
            (channels * multiplier, 1, *kernel), attrs)


@settings(max_examples=30, deadline=None)
@given(depthwise_cases(), st.sampled_from(["none", "clip", "swish-in", "bias-add", "scale-swish"]))
def test_depthwise_conv(case, fusion):
    """Depthwise convs with a prologue or an epilogue fused, against onnxruntime."""
    x_shape, w_shape, attrs = case
    rng = np.random.default_rng(3)
    inits = {"w": rng.standard_normal(w_shape).astype(np.float32),
             "b": rng.standard_normal(w_shape[0]).astype(np.float32),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32),
             "scale": rng.standard_normal((w_shape[0], 1, 1)).astype(np.float32)}
    spec = {"x": (x_shape, "float32")}
    conv_in, inputs = "x", ["x", "w", "b"]
    nodes = []
    if fusion == "swish-in":
        nodes += [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["xs"])]
        inputs = ["xs", "w", "b"]
    nodes.append(helper.make_node("Conv", inputs, ["c"], **attrs))
    if fusion == "clip":
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif fusion == "bias-add":
        nodes.append(helper.make_node("Add", ["c", "c"], ["y"]))
    elif fusion == "scale-swish":  # a per-channel broadcast and an exp in the epilogue
        nodes += [helper.make_node("Mul", ["c", "scale"], ["cs"]),
                  helper.make_node("Sigmoid", ["cs"], ["sg"]), helper.make_node("Mul", ["cs", "sg"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))
