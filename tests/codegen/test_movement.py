"""Data-movement ops inside blocks are index remaps: results match onnxruntime, and the fused
loops of affine maps carry no division or modulo in their inner loops."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import host_target
from tests.codegen.harness import check_model, model, plan_for, random_inputs


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=2, max_size=4), st.data())
def test_transpose_reshape_chains(shape, data):
    rank = len(shape)
    perm1 = data.draw(st.permutations(range(rank)))
    perm2 = data.draw(st.permutations(range(rank)))
    spec = {"x": (tuple(shape), "float32"), "b": ((shape[perm1[-1]],), "float32")}
    flat = [int(np.prod(shape))]
    nodes = [helper.make_node("Transpose", ["x"], ["t1"], perm=list(perm1)),
             helper.make_node("Add", ["t1", "b"], ["a"]),
             helper.make_node("Reshape", ["a", "flat"], ["r"]),
             helper.make_node("Reshape", ["r", "back"], ["r2"]),
             helper.make_node("Transpose", ["r2"], ["y"], perm=list(perm2))]
    inits = {"flat": np.array(flat, np.int64),
             "back": np.array([shape[p] for p in perm1], np.int64)}
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


def _inner_loops(source: str) -> list[str]:
    """Bodies of innermost loops (for-loops with no nested for)."""
    bodies = re.findall(r"for \(int64_t [^{]*\{([^{}]*)\}", source)
    return bodies


def test_fused_transpose_has_no_division_in_inner_loops():
    spec = {"x": ((2, 16, 768), "float32")}
    nodes = [helper.make_node("Reshape", ["x", "s4"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Mul", ["t", "k"], ["y"])]
    inits = {"s4": np.array([2, 16, 12, 64], np.int64), "k": np.array(0.5, np.float32)}
    m = model(nodes, spec, ["y"], inits)
    check_model(m, random_inputs(spec), ["dnnfusion"])
    graph = frontend.build(m, {}, "t")
    (kernel,) = generate(plan_for(graph, "dnnfusion"), host_target())
    for body in _inner_loops(kernel.source):
        assert "/" not in body and "%" not in body, body


def test_slice_concat_split_pad_tile():
    spec = {"x": ((3, 8, 5), "float32"), "y": ((3, 2, 5), "float32")}
    inits = {"st": np.array([1], np.int64), "en": np.array([7], np.int64),
             "ax": np.array([1], np.int64), "sp": np.array([1], np.int64),
             "st2": np.array([-1, 6], np.int64), "en2": np.array([-100, 0], np.int64),
             "ax2": np.array([2, 1], np.int64), "sp2": np.array([-2, -3], np.int64),
             "pads": np.array([0, 1, 2, 1, 0, 1], np.int64), "pv": np.array(1.5, np.float32),
             "rep": np.array([1, 2, 1], np.int64), "parts": np.array([5, 6, 5], np.int64)}
    nodes = [helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["s"]),
             helper.make_node("Concat", ["s", "y", "x"], ["c"], axis=1),
             helper.make_node("Split", ["c", "parts"], ["p0", "p1", "p2"], axis=1),
             helper.make_node("Pad", ["p1", "pads", "pv"], ["pc"]),
             helper.make_node("Pad", ["p0", "pads"], ["pr"], mode="reflect"),
             helper.make_node("Pad", ["p2", "pads"], ["pe"], mode="edge"),
             helper.make_node("Tile", ["p2", "rep"], ["tl"]),
             helper.make_node("Relu", ["pc"], ["out"]),
             helper.make_node("Slice", ["x", "st2", "en2", "ax2", "sp2"], ["rev"])]
    check_model(model(nodes, spec, ["out", "pr", "pe", "tl", "rev"], inits), random_inputs(spec))


@pytest.mark.parametrize("indices", [np.array([[0, 2], [-1, 1]], np.int64), np.array(1, np.int64)])
def test_gather_with_constant_and_runtime_indices(indices):
    spec = {"x": ((4, 3, 5), "float32"), "i": (indices.shape, "int64")}
    inits = {"ci": indices}
    nodes = [helper.make_node("Gather", ["x", "i"], ["g0"], axis=1),
             helper.make_node("Gather", ["x", "ci"], ["g1"], axis=0),
             helper.make_node("Neg", ["g1"], ["n1"])]
    inputs = {"x": random_inputs({"x": spec["x"]})["x"], "i": indices}
    check_model(model(nodes, spec, ["g0", "n1"], inits), inputs)


def test_gather_elements_nd_expand_squeeze():
    spec = {"x": ((3, 4), "float32"), "ie": ((3, 2), "int64"), "nd": ((2, 1), "int64")}
    inits = {"shape": np.array([2, 3, 4], np.int64), "axes": np.array([0], np.int64)}
    nodes = [helper.make_node("GatherElements", ["x", "ie"], ["ge"], axis=1),
             helper.make_node("GatherND", ["x", "nd"], ["gn"]),
             helper.make_node("Expand", ["x", "shape"], ["ex"]),
             helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
             helper.make_node("Squeeze", ["u", "axes"], ["sq"]),
             helper.make_node("Add", ["ex", "sq"], ["y"])]
    inputs = {"x": random_inputs({"x": spec["x"]})["x"],
              "ie": np.array([[0, 3], [-1, 1], [2, 2]], np.int64),
              "nd": np.array([[2], [0]], np.int64)}
    check_model(model(nodes, spec, ["ge", "gn", "y"], inits), inputs)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_space_roundtrip(mode):
    spec = {"x": ((1, 8, 2, 3), "float32")}
    nodes = [helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2, mode=mode),
             helper.make_node("Sigmoid", ["d"], ["s"]),
             helper.make_node("SpaceToDepth", ["s"], ["y"], blocksize=2)]
    check_model(model(nodes, spec, ["d", "y"]), random_inputs(spec))


def test_trilu_onehot_range_like_generators():
    spec = {"x": ((4, 5), "float32"), "idx": ((3,), "int64")}
    inits = {"k": np.array(1, np.int64), "depth": np.array(5, np.int64),
             "vals": np.array([0.0, 2.0], np.float32)}
    nodes = [helper.make_node("Trilu", ["x", "k"], ["u"]),
             helper.make_node("Trilu", ["x"], ["l"], upper=0),
             helper.make_node("OneHot", ["idx", "depth", "vals"], ["oh"]),
             helper.make_node("EyeLike", ["x"], ["eye"], k=-1)]
    inputs = {"x": random_inputs({"x": spec["x"]})["x"], "idx": np.array([0, 4, -1], np.int64)}
    check_model(model(nodes, spec, ["u", "l", "oh", "eye"], inits), inputs)


@pytest.mark.parametrize("mode,coordinates", [("nearest", "asymmetric"), ("linear", "half_pixel"),
                                              ("cubic", "align_corners"),
                                              ("linear", "pytorch_half_pixel")])
def test_resize(mode, coordinates):
    spec = {"x": ((1, 2, 4, 5), "float32")}
    inits = {"roi": np.array([], np.float32),
             "scales": np.array([1, 1, 1.5, 0.6], np.float32)}
    nodes = [helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode=mode,
                              coordinate_transformation_mode=coordinates)]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


def test_upsample_with_scales_attribute():
    spec = {"x": ((1, 2, 3, 4), "float32")}
    nodes = [helper.make_node("Upsample", ["x"], ["y"], scales=[1.0, 1.0, 2.0, 3.0], mode="nearest")]
    check_model(model(nodes, spec, ["y"], opset=7), random_inputs(spec))
