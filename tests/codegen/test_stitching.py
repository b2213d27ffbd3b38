"""FusionStitching's code generation: stages of a stitched kernel split their rows into the same
static blocks (`Schedule.stitch_blocks`), and a kernel's scratch intermediates share space by
liveness; results against onnxruntime."""
from __future__ import annotations

import re

from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import host_target
from tests.codegen.harness import assert_matches, model, plan_for, random_inputs, reference, run_graph

SPEC = {"x": ((8, 64, 64), "float32")}


def _alternating_softmaxes():
    """Softmax over the last axis, then the middle one, and so on: row stages of different loop
    shapes, each reading the previous one's result from scratch."""
    names = ["x", "a", "b", "c", "d", "y"]
    nodes = [helper.make_node("Softmax", [src], [dst], axis=2 if i % 2 == 0 else 1)
             for i, (src, dst) in enumerate(zip(names, names[1:]))]
    return model(nodes, SPEC, ["y"])


def test_stitched_stages_share_static_blocks_and_scratch():
    onnx_model = _alternating_softmaxes()
    graph = frontend.build(onnx_model, {}, "test")
    plan = plan_for(graph, "fusionstitching")
    assert len(plan.blocks) == 1
    blocks = plan.schedules[plan.blocks[0].id]["stitch_blocks"]
    kernel = generate(plan, host_target())[0]
    pragmas = [line for line in kernel.source.splitlines() if "omp parallel" in line]
    rows = 8 * 64  # every stage runs over 512 rows (of the last or the middle axis)
    assert len(pragmas) == 5
    assert all(re.search(rf"schedule\(static, {rows // blocks}\)", p) for p in pragmas), pragmas
    # Four 128 KiB intermediates, at most two alive at once: half of them in scratch.
    assert kernel.scratch_bytes == 2 * 8 * 64 * 64 * 4
    inputs = random_inputs(SPEC)
    assert_matches(run_graph(graph, "fusionstitching", inputs), reference(onnx_model, inputs))


def test_without_stitch_blocks_stages_keep_their_dynamic_chunks():
    graph = frontend.build(_alternating_softmaxes(), {}, "test")
    plan = plan_for(graph, "fusionstitching")
    kernel = generate(plan, host_target(), block_schedules={plan.blocks[0].id: {"stitch_blocks": 0}})[0]
    pragmas = [line for line in kernel.source.splitlines() if "omp parallel" in line]
    assert pragmas and all("schedule(dynamic" in p for p in pragmas)
