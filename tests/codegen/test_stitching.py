"""FusionStitching's code generation: stages of a stitched kernel split their rows into the same
static blocks (`Schedule.stitch_blocks`), and a kernel's scratch intermediates share space by
liveness; results against onnxruntime."""
from __future__ import annotations

import math
import re

import numpy as np
from hypothesis import given, settings, strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import host_target
from tests.codegen.harness import (
    assert_matches,
    model,
    parallel_loops,
    plan_for,
    random_inputs,
    reference,
    run_graph,
    run_kernels,
)

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
    loops = parallel_loops(kernel.source)
    rows = 8 * 64  # every stage runs over 512 rows (of the last or the middle axis)
    assert loops == [(rows, rows // blocks, "CYCLIC")] * 5
    # Four 128 KiB intermediates, at most two alive at once: half of them in scratch.
    assert kernel.scratch_bytes == 2 * 8 * 64 * 64 * 4
    inputs = random_inputs(SPEC)
    assert_matches(run_graph(graph, "fusionstitching", inputs), reference(onnx_model, inputs))


def test_without_stitch_blocks_stages_keep_their_dynamic_chunks():
    graph = frontend.build(_alternating_softmaxes(), {}, "test")
    plan = plan_for(graph, "fusionstitching")
    kernel = generate(plan, host_target(), block_schedules={plan.blocks[0].id: {"stitch_blocks": 0}})[0]
    loops = parallel_loops(kernel.source)
    assert loops and all(mode == "DYNAMIC" for _, _, mode in loops), loops


# --- Column schedules ----------------------------------------------------------------------

def _column_statistics(shape, axes, softmax_axis):
    """BatchNorm-style statistics over `axes` (outer dims), the normalised tensor, a Softmax over
    an outer axis and a ReduceMax of it: every reduction leaves the inner columns whole."""
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
             helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["q"]),
             helper.make_node("ReduceMean", ["q", "axes"], ["var"], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["y"]),
             helper.make_node("Softmax", ["y"], ["z"], axis=softmax_axis),
             helper.make_node("ReduceMax", ["z", "axes"], ["top"], keepdims=0),
             helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0)]
    initializers = {"axes": np.array(axes, dtype=np.int64), "eps": np.float32(1e-5)}
    return model(nodes, {"x": (shape, "float32")}, ["z", "top", "total"], initializers, opset=18)


def _column_kernel_matches(shape, axes, softmax_axis, blocks, seed=0):
    onnx_model = _column_statistics(shape, axes, softmax_axis)
    graph = frontend.build(onnx_model, {}, "test")
    plan = plan_for(graph, "fusionstitching")
    columns = math.prod(shape[max(axes) + 1:])
    forced = {b.id: {"stitch_blocks": blocks, "stitch_columns": columns} for b in plan.blocks}
    kernels = generate(plan, host_target(), block_schedules=forced)
    inputs = random_inputs({"x": (shape, "float32")}, seed)
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
    return kernels


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 40), columns=st.integers(1, 300), blocks=st.integers(1, 7),
       seed=st.integers(0, 100))
def test_column_schedules_of_column_reductions_match_onnxruntime(rows, columns, blocks, seed):
    # Columns that do not divide by the blocks (37 by 2, 7 by 4, ...) and more blocks than
    # columns included.
    _column_kernel_matches((rows, columns), [0], 0, blocks, seed)


def test_column_schedules_of_nhwc_statistics_and_batched_columns_match_onnxruntime():
    _column_kernel_matches((2, 3, 5, 19), [0, 1, 2], 1, 2)  # N·H·W statistics of NHWC
    _column_kernel_matches((3, 7, 50), [1], 1, 4)  # a batch of 3 column problems
    _column_kernel_matches((4, 600), [0], 0, 2)  # chunks wider than a tile
    _column_kernel_matches((300, 200), [0], 0, 2)  # the Softmax's kept rows narrow the tiles


def test_column_schedule_runs_rows_inside_contiguous_column_chunks():
    kernels = _column_kernel_matches((64, 300), [0], 0, 3)
    source = "\n".join(k.source for k in kernels)
    assert all(k.schedule["stitch_type"] == "column" for k in kernels)
    # Every stage: a parallel loop over the 3 chunks, one each, dealt statically.
    loops = parallel_loops(source)
    assert loops and set(loops) == {(3, 1, "CYCLIC")}, loops
    # The column loop is the vectorised inner loop, over a range that starts at the chunk's.
    assert re.search(r"#pragma omp simd\n\s*for \(int64_t c\d+ = \(k\d+ \* 100\);", source)
    # No column reduction is left as a strided walk down a column (a loop over the rows reading
    # x[r * 300 + o] with o the parallel index).
    assert not re.search(r"for \(int64_t o\d+ = \([^)]*\) \+ kiln_begin", source)
