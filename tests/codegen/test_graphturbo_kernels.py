"""GraphTurbo's tiled kernel (kiln.codegen.tiled) on MobileNetV2's inverted residual: row tiles
with halo rows, the expanded intermediate in window buffers, against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.graphturbo import GraphTurbo, Hardware
from kiln.target import host_target
from tests.codegen.harness import assert_matches, model, reference, run_kernels, store


def inverted_residual(channels: int, expand: int, size: int, stride: int):
    """1×1 expand → Clip → 3×3 depthwise (stride) → Clip → 1×1 project (+ input when stride 1)."""
    rng = np.random.default_rng(0)
    init = {"w1": rng.standard_normal((expand, channels, 1, 1)).astype("float32") * 0.2,
            "b1": rng.standard_normal(expand).astype("float32"),
            "w2": rng.standard_normal((expand, 1, 3, 3)).astype("float32") * 0.3,
            "b2": rng.standard_normal(expand).astype("float32"),
            "w3": rng.standard_normal((channels, expand, 1, 1)).astype("float32") * 0.2,
            "b3": rng.standard_normal(channels).astype("float32"),
            "lo": np.array(0, "float32"), "hi": np.array(6, "float32")}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["e"]),
             helper.make_node("Clip", ["e", "lo", "hi"], ["e6"]),
             helper.make_node("Conv", ["e6", "w2", "b2"], ["d"], group=expand, pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["d6"]),
             helper.make_node("Conv", ["d6", "w3", "b3"], ["p"])]
    out = "p"
    if stride == 1:
        nodes.append(helper.make_node("Add", ["p", "x"], ["y"]))
        out = "y"
    return model(nodes, {"x": ((1, channels, size, size), "float32")}, [out], init)


@pytest.mark.parametrize("stride", [1, 2])
def test_inverted_residual_runs_tile_by_tile(stride):
    m = inverted_residual(channels=16, expand=64, size=28, stride=stride)
    inputs = {"x": np.random.default_rng(2).standard_normal((1, 16, 28, 28)).astype("float32")}
    graph = frontend.build(m, {}, "test")
    plan = GraphTurbo(Hardware(l1_bytes=8 << 10, local_bytes=128 << 10))(graph, store())
    kernels = generate(plan, host_target())
    expand, depthwise = graph.ops[0], graph.ops[2]
    if stride == 1:  # one stage; the expanded intermediate lives in an instance's buffers
        first = plan.stages[plan.blocks[0].id]
        assert len(plan.blocks) == 1 and first.tiled and first.split.parts > 1
        assert first.scopes[expand.outputs[0]] in ("register", "L1", "L2")
        stage = kernels[0].schedule["stages"][0]
        assert stage["form"] == "tiled" and stage["instances"] == first.split.parts
        assert kernels[0].scratch_bytes == 0  # no whole intermediate anywhere
    else:  # the down-sampling depthwise conv starts a new stage (rule (i))
        assert plan.block_of[expand.id] != plan.block_of[depthwise.id]
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in plan.graph.outputs], reference(m, inputs))
