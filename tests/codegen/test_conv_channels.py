"""Depthwise convs over tiny planes with channels as vector lanes
(kiln.codegen.ops.conv_channels) against onnxruntime: random kernels, strides, dilations and
pads, batches, fused prologues and epilogues, with the form each one was built as."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import Target, host_target, target
from tests.codegen.harness import check_model, model, plan_for, random_inputs
from tests.codegen.test_conv_direct import AVX512, _conv_model, depthwise_5x5_silu, windows

LANES = {"avx512": 16, "avx2": 8}
FORM = "depthwise, channels as lanes"


def _host_lanes() -> int:
    return host_target().vector_bytes // 4


@st.composite
def tiny_plane_cases(draw, lanes: int):
    """Depthwise convs on one or two vectors of channels whose output rows are under half a
    vector, kernels up to 7 × 7."""
    channels = lanes * draw(st.sampled_from([1, 1, 2]))
    attrs = draw(windows([1, 3, 5, 7], max_pad=3, group=channels))
    kernel, dilations, pads, strides = (attrs["kernel_shape"], attrs["dilations"], attrs["pads"],
                                        attrs["strides"])
    spatial = []
    for d in range(2):
        reach = (kernel[d] - 1) * dilations[d] + 1
        low = max(1, reach - pads[d] - pads[d + 2])
        # input columns that keep the output's rows under half a vector
        high = (lanes // 2 - 2) * strides[d] + reach - pads[d] - pads[d + 2] if d else 12
        spatial.append(draw(st.integers(low, max(low, high))))
    return ((draw(st.integers(1, 2)), channels, *spatial), (channels, 1, *kernel), attrs)


@settings(max_examples=20, deadline=None)
@given(tiny_plane_cases(16), st.sampled_from(["none", "relu-in", "relu-out", "pad-in"]))
def test_depthwise_over_tiny_planes(case, fusion):
    """On AVX-512 these take the channel-lanes form (where the host has it, they run there)."""
    onnx_model, inputs = _conv_model(case, fusion, seed=21)
    if _host_lanes() == 16:
        check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))
    graph = frontend.build(onnx_model, {}, "test")
    out_width = graph.tensors["c"].shape[3] if "c" in graph.tensors else None
    if out_width is not None and 2 * out_width < 16:
        assert FORM in _forms_on(onnx_model, AVX512)


@settings(max_examples=10, deadline=None)
@given(tiny_plane_cases(8), st.sampled_from(["none", "relu-out"]))
def test_depthwise_over_tiny_planes_with_avx2_lanes(case, fusion):
    """Built for AVX2 (8 lanes), which every x86-64 host here runs."""
    onnx_model, inputs = _conv_model(case, fusion, seed=22)
    check_model(onnx_model, inputs, partitioners=("none",), on=target("x86_64"))


def test_mobilenet_tail_block_runs_with_channels_as_lanes():
    """MobileNetV2's last depthwise convs: 3 × 3 onto 7 × 7 with a ReLU6, stride 1 and stride 2
    from 14 × 14, a residual Add after the Clip; on 32 channels, two blocks of lanes. The
    channel-lanes form on AVX-512 (the in-place kernel ran 3.1× as long); it matches
    onnxruntime."""
    rng = np.random.default_rng(23)
    for stride, size in ((1, 7), (2, 14)):
        spec = {"x": ((1, 32, size, size), "float32"), "r": ((1, 32, 7, 7), "float32")}
        inits = {"w": rng.standard_normal((32, 1, 3, 3)).astype(np.float32),
                 "b": rng.standard_normal(32).astype(np.float32),
                 "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
        onnx_model = model([
            helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3],
                             pads=[1, 1, 1, 1], strides=[stride] * 2, group=32),
            helper.make_node("Clip", ["c", "lo", "hi"], ["k"]),
            helper.make_node("Add", ["k", "r"], ["y"])], spec, ["y"], inits)
        check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
        assert FORM in _forms_on(onnx_model, AVX512)


def test_narrow_planes_with_a_silu_run_with_channels_as_lanes():
    """EfficientNet's 5 × 5 depthwise convs onto 7 × 7 with a SiLU, on 16 channels: the
    epilogue runs along each channel's plane after the transpose back; it matches
    onnxruntime."""
    onnx_model, spec = depthwise_5x5_silu((2, 16, 7, 7), seed=24)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert FORM in _forms_on(onnx_model, AVX512)


def test_weights_given_at_run_time_are_gathered_per_block():
    """Weights that are an input of the model, not a constant, are gathered as a vector per
    tap for each block of channels; a Relu before the conv is evaluated in the copy of the
    block's planes. It matches onnxruntime."""
    rng = np.random.default_rng(26)
    spec = {"x": ((1, 32, 6, 6), "float32"), "w": ((32, 1, 3, 3), "float32")}
    inits = {"b": rng.standard_normal(32).astype(np.float32)}
    onnx_model = model([
        helper.make_node("Relu", ["x"], ["xr"]),
        helper.make_node("Conv", ["xr", "w", "b"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 0, 0, 1], group=32)], spec, ["y"], inits)
    if _host_lanes() == 16:
        check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert FORM in _forms_on(onnx_model, AVX512)


@pytest.mark.parametrize("channels, width, multiplier", [(24, 7, 1), (16, 8, 1), (16, 7, 2)])
def test_other_depthwise_convs_keep_their_forms(channels, width, multiplier):
    """Channels that are not whole vectors, output rows of half a vector or more, and a channel
    multiplier keep the NCHW forms on AVX-512."""
    rng = np.random.default_rng(25)
    spec = {"x": ((1, channels, 7, width), "float32")}
    inits = {"w": rng.standard_normal((channels * multiplier, 1, 3, 3)).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3],
                                         pads=[1, 1, 1, 1], group=channels)],
                       spec, ["y"], inits)
    assert FORM not in _forms_on(onnx_model, AVX512)


@pytest.mark.parametrize("gpu", ["opencl", "cuda"])
def test_gpu_targets_keep_their_depthwise_forms(gpu):
    """GPU renderers have no vector transposes and work-groups of their own: a depthwise conv
    onto rows of one pixel (under half of OpenCL's 4 lanes) on 8 channels keeps the planes
    there, and its source renders."""
    rng = np.random.default_rng(27)
    spec = {"x": ((1, 8, 3, 2), "float32")}
    inits = {"w": rng.standard_normal((8, 1, 3, 3)).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3],
                                         pads=[1, 1, 1, 1], strides=[1, 2], group=8)],
                       spec, ["y"], inits)
    assert FORM not in _forms_on(onnx_model, target(gpu))


def _forms_on(onnx_model, on: Target) -> str:
    graph = frontend.build(onnx_model, {}, "test")
    return " | ".join(str(info.get("form")) for kernel in generate(plan_for(graph, "none"), on)
                      for info in kernel.schedule.get("stages", []))
