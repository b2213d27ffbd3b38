"""GraphTurbo (kiln.plan.graphturbo, kiln.plan.scopes, kiln.codegen.tiled): SplitInfo, grouping,
instance order, halo windows, scope allocation, and tiled kernels against onnxruntime."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.graphturbo import (
    MAX_RECOMPUTE,
    GraphTurbo,
    Hardware,
    best_split,
    carried_dims,
    factors,
    instance_graph,
    instance_order,
    overlapping,
    peak_bytes,
    split_info,
)
from kiln.plan.scopes import allocate, conv_rows, row_windows
from kiln.report import plan_stages
from kiln.target import host_target
from tests.codegen.harness import assert_matches, model, reference, run_kernels, store
from tests.test_plan import RandomLatencies, random_dags

SMALL = Hardware(l1_bytes=4 << 10, local_bytes=16 << 10)


@st.composite
def conv_chains(draw):
    """An NCHW chain of 1×1 / k×k / depthwise convolutions with Clip, Sigmoid·x and residual
    Adds, as an ONNX model with random weights."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    channels = draw(st.sampled_from([3, 8, 16]))
    height, width = draw(st.sampled_from([8, 12, 16, 24])), draw(st.sampled_from([7, 16, 20]))
    nodes, init, x, c, h, w = [], {}, "x", channels, height, width
    init["lo"], init["hi"] = np.array(0, "float32"), np.array(6, "float32")
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["pointwise", "depthwise", "full", "residual"]))
        out = draw(st.sampled_from([4, 8, 16, 24])) if kind in ("pointwise", "full") else c
        kernel = 1 if kind == "pointwise" else draw(st.sampled_from([3, 5]))
        stride = draw(st.sampled_from([1, 2])) if kind in ("depthwise", "full") else 1
        group = c if kind in ("depthwise", "residual") else 1
        init[f"w{i}"] = (rng.standard_normal((out, c // group, kernel, kernel)) * 0.3).astype("float32")
        init[f"b{i}"] = rng.standard_normal(out).astype("float32")
        pad = kernel // 2
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], group=group,
                                      pads=[pad] * 4, strides=[stride, stride]))
        h, w = (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1
        act = draw(st.sampled_from(["clip", "silu", "none"]))
        y = f"c{i}"
        if act == "clip":
            nodes.append(helper.make_node("Clip", [y, "lo", "hi"], [f"a{i}"]))
            y = f"a{i}"
        elif act == "silu":
            nodes += [helper.make_node("Sigmoid", [y], [f"s{i}"]),
                      helper.make_node("Mul", [y, f"s{i}"], [f"a{i}"])]
            y = f"a{i}"
        if kind == "residual":
            nodes.append(helper.make_node("Add", [y, x], [f"r{i}"]))
            y = f"r{i}"
        x, c = y, out
    return model(nodes, {"x": ((1, channels, height, width), "float32")}, [x], init)


def _graph(onnx_model):
    return frontend.build(onnx_model, {}, "test")


# --- SplitInfo --------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(onnx_model=conv_chains(), local=st.sampled_from([2 << 10, 8 << 10, 64 << 10]))
def test_the_best_split_is_the_smallest_even_cut_that_fits_the_local_buffer(onnx_model, local):
    graph = _graph(onnx_model)
    ops = list(graph.ops)
    peak = peak_bytes(graph, ops)
    info = split_info(graph, ops, local)
    out = graph.tensors[ops[-1].outputs[0]].shape
    for s in info:
        assert out[s.dim] % s.parts == 0
        assert -(-peak // s.parts) <= local
        assert all(-(-peak // v) > local for v in factors(out[s.dim]) if v < s.parts)
        if s.parts > 1:  # a real cut splits every op of the sub-graph
            members = {op.id for op in ops}
            assert s.ops == len(ops)
            assert all(s.dim in carried_dims(graph, op, members) for op in ops)
    best = best_split(info)
    if best is not None:
        assert best.key() == max(s.key() for s in info)
    else:  # no dimension both cuts the data small enough and splits every op
        members = {op.id for op in ops}
        for d, n in enumerate(out):
            fitting = [v for v in factors(n) if -(-peak // v) <= local]
            assert not fitting or (fitting[0] > 1 and not all(
                d in carried_dims(graph, op, members)
                and graph.tensors[op.outputs[0]].shape[d] % fitting[0] == 0
                and len(graph.tensors[op.outputs[0]].shape) == len(out) for op in ops))


def test_a_down_sampling_ends_a_stage_and_a_large_local_buffer_needs_no_cut():
    from tests.codegen.test_graphturbo_kernels import inverted_residual
    graph = _graph(inverted_residual(channels=16, expand=64, size=28, stride=2))
    plan = GraphTurbo(Hardware(l1_bytes=4 << 10, local_bytes=128 << 10))(graph, store())
    expand, depthwise = graph.ops[0].id, graph.ops[2].id
    assert plan.block_of[expand] != plan.block_of[depthwise]  # the stride-2 conv starts a stage
    assert plan.stages[plan.block_of[expand]].split.parts > plan.stages[
        plan.block_of[depthwise]].split.parts
    refused = [d.reason for d in plan.decisions if not d.fused]
    assert any(r.startswith("rule (i)") for r in refused)
    whole = GraphTurbo(Hardware(local_bytes=64 << 20))(graph, store())
    assert all(not s.tiled and s.split.parts == 1 for s in whole.stages.values())
    # uncut, several convolutions would run whole in one kernel: each keeps its own stage
    assert all(sum(whole.graph.op_by_id[i].compute_intensive for i in b.op_ids) <= 1
               for b in whole.blocks)


# --- grouping and instances -----------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(graph=random_dags(), seed=st.integers(0, 100), local=st.sampled_from([64, 256, 1 << 20]))
def test_every_merged_stage_has_a_split_and_a_reason(graph, seed, local):
    plan = GraphTurbo(Hardware(l1_bytes=32, local_bytes=local))(graph, RandomLatencies(seed))
    for block in plan.blocks:
        stage = plan.stages[block.id]
        if stage.split is not None:
            assert -(-stage.peak_bytes // stage.split.parts) <= local
        else:  # only a layer, the sub-graph grouping starts from, may not fit the local buffer
            ops = [plan.graph.op_by_id[i] for i in block.op_ids]
            for before, op in zip(ops, ops[1:]):
                assert [p.id for p in plan.graph.predecessors(op)] == [before.id]
        assert set(stage.scopes) >= set(block.outputs)
        assert all(stage.scopes[t] == "memory" for t in block.outputs)
    known = ("straight merge", "diamond merge", "branch merge", "rule (i)", "rule (ii)",
             "no SplitInfo", "opaque", "more than", "cost model", "kernel generator")
    assert all(d.reason.startswith(known) for d in plan.decisions)
    producers = instance_graph(plan, plan.stages)
    for depth_first in (False, True):
        order = instance_order(producers, depth_first)
        assert sorted(order) == sorted(producers)
        seen = set()
        for inst in order:
            assert producers[inst] <= seen
            seen.add(inst)


# --- windows and scopes --------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(onnx_model=conv_chains(), parts=st.sampled_from([2, 3, 4]))
def test_every_window_holds_the_rows_its_readers_need(onnx_model, parts):
    graph = _graph(onnx_model)
    ids = [op.id for op in graph.ops]
    out = graph.outputs[0]
    windows = row_windows(graph, ids, [out], parts)
    if windows is None:
        assert graph.tensors[out].shape[2] % parts
        return
    for i in range(parts):
        step = graph.tensors[out].shape[2] // parts
        need = {out: set(range(i * step, (i + 1) * step))}
        for op in reversed(graph.ops):  # brute force: rows each reader needs, op by op
            rows = need.get(op.outputs[0], set())
            if op.op_type == "Conv":
                g, height = conv_rows(graph, op), graph.tensors[op.inputs[0]].shape[2]
                wanted = {y * g.stride - g.pad + k * g.dilation for y in rows
                          for k in range(g.kernel)} & set(range(height))
                reads = [op.inputs[0]]
            else:
                wanted, reads = rows, list(graph.activation_inputs(op))
            for t in reads:
                if graph.producer(t) is not None:
                    need.setdefault(t, set()).update(wanted)
        for t, rows in need.items():
            w = windows[t]
            start = min(max(i * w.step + w.lo, 0), w.height - w.rows)
            assert rows <= set(range(start, start + w.rows)), (t, i)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 10), st.integers(0, 5)),
                min_size=1, max_size=12),
       st.integers(1000, 8000), st.integers(2000, 16000))
def test_allocation_reuses_bytes_only_between_lifetimes_and_spills_to_fit(spec, l1, l2):
    buffers = [(f"t{i}", n, first, first + length) for i, (n, first, length) in enumerate(spec)]
    placed = allocate(buffers, (("L1", l1), ("L2", l2), ("memory", 0)))
    assert sorted(p.tensor for p in placed) == sorted(b[0] for b in buffers)
    for p in placed:
        if p.scope != "memory":
            assert p.offset + p.nbytes <= {"L1": l1, "L2": l2}[p.scope]
        for q in placed:
            if p is not q and p.scope == q.scope and p.first <= q.last and q.first <= p.last:
                assert p.offset + p.nbytes <= q.offset or q.offset + q.nbytes <= p.offset


def test_the_longest_lived_buffer_spills_first():
    placed = {p.tensor: p.scope for p in allocate(
        [("long", 128, 0, 9), ("a", 128, 1, 2), ("b", 128, 3, 4)], (("L1", 256), ("memory", 0)))}
    assert placed == {"long": "L1", "a": "L1", "b": "L1"}  # a and b share bytes
    placed = {p.tensor: p.scope for p in allocate(
        [("long", 128, 0, 9), ("a", 192, 1, 2), ("b", 192, 3, 4)], (("L1", 256), ("memory", 0)))}
    assert placed == {"long": "memory", "a": "L1", "b": "L1"}


# --- tiled kernels against onnxruntime ------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(onnx_model=conv_chains(), local=st.sampled_from([2 << 10, 6 << 10, 24 << 10]))
def test_tiled_stages_match_onnxruntime(onnx_model, local):
    rng = np.random.default_rng(1)
    shape = tuple(d.dim_value for d in onnx_model.graph.input[0].type.tensor_type.shape.dim)
    inputs = {"x": rng.standard_normal(shape).astype("float32")}
    want = reference(onnx_model, inputs)
    graph = _graph(onnx_model)
    plan = GraphTurbo(Hardware(l1_bytes=2 << 10, local_bytes=local))(graph, store())
    kernels = generate(plan, host_target())
    for kernel in kernels:  # the plan's tiled stages are the kernels' tiled stages
        tiled = any(s.get("form") == "tiled" for s in kernel.schedule["stages"])
        assert tiled == plan.stages[kernel.block_id].tiled
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in plan.graph.outputs], want)


def test_the_report_says_where_every_tensor_lives():
    from tests.codegen.test_graphturbo_kernels import inverted_residual
    graph = _graph(inverted_residual(channels=8, expand=32, size=16, stride=1))
    plan = GraphTurbo(SMALL)(graph, store())
    stages = plan_stages(plan)["stages"]
    produced = {t for op in plan.graph.ops for t in op.outputs}
    scopes = {t: s for stage in stages.values() for t, s in stage["scopes"].items()}
    assert set(scopes) == produced
    assert set(scopes.values()) <= {"register", "L1", "L2", "memory"}
    tiled = [s for s in stages.values() if s["tiled"]]
    assert tiled and all(b["scope"] in ("L1", "L2", "memory") for s in tiled for b in s["buffers"])
    assert math.isfinite(MAX_RECOMPUTE)


def test_empty_tensors_plan_as_one_instance():
    from tests.graphs import ecg
    graph = ecg([("Relu", ["x"], ["h"]), ("Relu", ["h"], ["y"])],
                {"x": (0, 4), "h": (0, 4), "y": (0, 4)}, ["x"], ["y"])
    plan = GraphTurbo(SMALL)(graph, RandomLatencies(0))  # empty outputs divided nothing by zero
    assert all(s.instances == 1 for s in plan.stages.values())


@settings(max_examples=200, deadline=None)
@given(parts_j=st.integers(1, 60), parts_k=st.integers(1, 60), data=st.data())
def test_overlapping_shares_are_exactly_those_whose_ranges_intersect(parts_j, parts_k, data):
    j = data.draw(st.integers(0, parts_j - 1))
    # Share j of parts_j covers [j/parts_j, (j+1)/parts_j) of the extent; likewise share k.
    want = [k for k in range(parts_k)
            if max(j / parts_j, k / parts_k) < min((j + 1) / parts_j, (k + 1) / parts_k)]
    assert list(overlapping(j, parts_j, parts_k)) == want
