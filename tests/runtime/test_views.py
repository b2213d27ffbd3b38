"""View blocks (Reorganize ops only) run no kernel: they alias their root tensor's bytes."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

import kiln
from kiln import codegen, frontend
from kiln.plan import partitioner
from kiln.profile.machine import host_machine
from kiln.profile.roofline import RooflineModel
from kiln.runtime.artifact import build_artifact, open_artifact
from kiln.target import host_target
from tests.graphs import float_input, save_model


def views_model(tmp_path):
    # r = Reshape(x) feeds Relu (view of an input); y = Reshape(Relu(r)) is a model output (view of
    # a kernel result); z = Flatten(x) is a model output that is a view of an input.
    shape = numpy_helper.from_array(np.array([6, 4], np.int64), "shape")
    back = numpy_helper.from_array(np.array([2, 12], np.int64), "back")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Relu", ["r"], ["a"]),
             helper.make_node("Reshape", ["a", "back"], ["y"]),
             helper.make_node("Flatten", ["x"], ["z"], axis=1)]
    return save_model(tmp_path / "views.onnx", nodes, [float_input("x", (2, 3, 4))],
                      [float_input("y", (2, 12)), float_input("z", (2, 12))], [shape, back])


def test_views_alias_instead_of_running_kernels(tmp_path):
    path = views_model(tmp_path)
    graph = frontend.load(path)
    plan = partitioner("none")(graph, RooflineModel(host_machine()))
    assert [b.is_view for b in plan.blocks] == [True, False, True, True]
    kernels = codegen.generate(plan, host_target())
    report = build_artifact(plan, kernels, host_target(), {}, tmp_path / "views.kiln")
    manifest = open_artifact(tmp_path / "views.kiln").manifest
    assert len(manifest["kernels"]) == 1, "only the Relu runs"
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    got = kiln.load(tmp_path / "views.kiln")(x=x)
    want = ort.InferenceSession(str(path)).run(None, {"x": x})
    got = list(got.values()) if isinstance(got, dict) else list(got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert report["compiled_kernels"] == 1
    assert report["memory"]["arena_bytes"] == 0, "the Relu writes straight into the output buffer"
