"""FusionStitching: work/span layers, the schedule space and Table 1's propagation rules (each
checked against the element-level index map of its op), and the partitioner's choices."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
from hypothesis import given, settings, strategies as st

from kiln.mapping import MappingType as M
from kiln.plan import partitioner
from kiln.plan.fusionstitching import Constraints, FusionStitching, span_layers, work_span
from kiln.plan.stitch_schedule import (
    COLUMN,
    ONE_BLOCK,
    ROW,
    StitchSchedule,
    broadcast_rule,
    propagate,
    reduce_rule,
    reshape_rule,
    satisfiable,
    schedule_space,
    transpose_rule,
    with_partition,
)
from kiln.plan.stitch_tuning import COLUMNS_KEY, STITCH_KEY, PerformanceLibrary, imbalance
from kiln.profile import COST_MODEL, MEASURED, Estimate
from kiln.report import fusion_report
from tests.graphs import ecg
from tests.test_plan import RandomLatencies, random_dags

shapes = st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4).map(tuple)


# --- §3.1 ---------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(graph=random_dags())
def test_span_is_one_more_than_the_largest_users_and_layers_are_independent(graph):
    spans = work_span(graph)
    for op in graph.ops:
        users = graph.successors(op)
        assert spans[op.id] == (1 + max(spans[u.id] for u in users) if users else 0)
    layers = span_layers(graph, spans)
    assert sorted(op.id for layer in layers for op in layer) == sorted(op.id for op in graph.ops)
    reach = _reachability(graph)
    for layer in layers:
        for a, b in itertools.permutations(layer, 2):
            assert b.id not in reach[a.id]  # no data dependence inside a layer
    if graph.ops:  # the largest span is the critical path's length
        assert max(spans.values()) == _longest_path(graph)


def _reachability(graph):
    reach = {}
    for op in reversed(graph.ops):
        reach[op.id] = set()
        for user in graph.successors(op):
            reach[op.id] |= {user.id} | reach[user.id]
    return reach


def _longest_path(graph):
    depth = {}
    for op in graph.ops:
        depth[op.id] = max((depth[p.id] + 1 for p in graph.predecessors(op)), default=0)
    return max(depth.values())


# --- §4.1: the space and what a schedule means --------------------------------------------

def block_ids(shape, schedule: StitchSchedule) -> np.ndarray:
    """Reference: the block of every element, from Fig. 5's definition."""
    dims = shape or (1,)
    d, s = schedule.split_dim, schedule.sword
    part = dims[d] // s
    idx = np.indices(dims).reshape(len(dims), -1)
    if schedule.sched_type is ROW:
        prefix = np.ravel_multi_index(idx[:d], dims[:d]) if d else np.zeros(idx.shape[1], int)
        return prefix * s + idx[d] // part
    suffix = (np.ravel_multi_index(idx[d + 1:], dims[d + 1:]) if d + 1 < len(dims)
              else np.zeros(idx.shape[1], int))
    return (idx[d] // part) * math.prod(dims[d + 1:]) + suffix


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return is_function(a, b) and is_function(b, a)


def is_function(src: np.ndarray, dst: np.ndarray) -> bool:
    """Does each value of `src` go with a single value of `dst`?"""
    seen = {}
    return all(seen.setdefault(int(x), int(y)) == int(y) for x, y in zip(src, dst))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, max_blocks=st.integers(1, 64))
def test_schedule_space_is_legal_and_partition_keys_name_partitions(shape, max_blocks):
    space = schedule_space(shape, max_blocks)
    assert ONE_BLOCK in space
    for s in space:
        assert s.legal(shape) and s.blocks(shape) <= max_blocks
        ids = block_ids(shape, s)
        assert len(set(ids.tolist())) == s.blocks(shape)
        again = with_partition(shape, s.partition(shape))
        assert again is not None and same_partition(block_ids(shape, again), ids)
    for a, b in itertools.combinations(space, 2):
        if a.partition(shape) == b.partition(shape):
            assert same_partition(block_ids(shape, a), block_ids(shape, b))


# --- §4.2: Table 1, each rule against its op's index map ----------------------------------

def assert_rule_keeps_blocks(out_shape, in_shape, out, inp, pairs):
    """Every output element's inputs lie in one input block, which is a function of the output
    element's block: the op runs block by block, reading only what its producer's same block
    (or, for a broadcast, a block shared by several) computed."""
    assert inp.legal(in_shape)
    out_ids, in_ids = block_ids(out_shape, out), block_ids(in_shape, inp)
    o, i = zip(*pairs)
    assert is_function(out_ids[list(o)], in_ids[list(i)])


def flat(shape, idx):
    return int(np.ravel_multi_index(idx, shape or (1,))) if shape else 0


@settings(max_examples=200, deadline=None)
@given(out_shape=shapes, data=st.data())
def test_broadcast_rule(out_shape, data):
    rank = data.draw(st.integers(0, len(out_shape)))
    in_shape = tuple(data.draw(st.sampled_from([1, d])) for d in out_shape[len(out_shape) - rank:])
    out = data.draw(st.sampled_from(schedule_space(out_shape, 64)))
    inp = broadcast_rule(out_shape, in_shape or (1,), out)
    pairs = []
    for idx in np.ndindex(*out_shape):
        src = tuple(0 if n == 1 else i for i, n in zip(idx[len(idx) - len(in_shape):], in_shape))
        pairs.append((flat(out_shape, idx), flat(in_shape, src)))
    assert_rule_keeps_blocks(out_shape, in_shape or (1,), out, inp, pairs)


@settings(max_examples=200, deadline=None)
@given(in_shape=shapes, data=st.data())
def test_reshape_rule(in_shape, data):
    numel = math.prod(in_shape)
    out_shape = data.draw(st.sampled_from([s for s in _factorisations(numel)]))
    out = data.draw(st.sampled_from(schedule_space(out_shape, 64)))
    inp = reshape_rule(out_shape, in_shape, out)
    if out.sched_type is ROW:  # whenever the input shape can be cut into the same chunks
        assert (inp is None) == (with_partition(in_shape, out.partition(out_shape)) is None)
    if inp is not None:
        assert_rule_keeps_blocks(out_shape, in_shape, out, inp, [(f, f) for f in range(numel)])


def _factorisations(n):
    found = [(n,)]
    for a in range(2, n + 1):
        if n % a == 0:
            found += [(a, n // a), (n // a, a)] + ([(a, 1, n // a)] if n // a > 1 else [])
    return found


@settings(max_examples=200, deadline=None)
@given(in_shape=shapes, data=st.data())
def test_transpose_rule(in_shape, data):
    perm = tuple(data.draw(st.permutations(range(len(in_shape)))))
    out_shape = tuple(in_shape[p] for p in perm)
    out = data.draw(st.sampled_from(schedule_space(out_shape, 64)))
    inp = transpose_rule(perm, out)
    moved = [i for i, p in enumerate(perm) if p != i]
    if moved and out.sched_type is ROW and out.split_dim < min(moved):
        assert inp is not None
    if inp is not None:
        pairs = [(flat(out_shape, idx), flat(in_shape, tuple(idx[perm.index(k)]
                                                             for k in range(len(perm)))))
                 for idx in np.ndindex(*out_shape)]
        assert_rule_keeps_blocks(out_shape, in_shape, out, inp, pairs)


@settings(max_examples=200, deadline=None)
@given(in_shape=shapes, data=st.data())
def test_reduce_rule_keeps_every_reduction_in_one_block(in_shape, data):
    reduced = frozenset(data.draw(st.sets(st.integers(0, len(in_shape) - 1), min_size=1)))
    keepdims = data.draw(st.booleans())
    kept = [d for d in range(len(in_shape)) if d not in reduced]
    out_shape = (tuple(1 if d in reduced else n for d, n in enumerate(in_shape)) if keepdims
                 else tuple(in_shape[d] for d in kept))
    if not out_shape:
        return
    out = data.draw(st.sampled_from(schedule_space(out_shape, 64)))
    inp = reduce_rule(in_shape, out_shape, reduced, out)
    if inp is None:
        return
    pairs = []
    for idx in np.ndindex(*in_shape):
        o = (tuple(0 if d in reduced else i for d, i in enumerate(idx)) if keepdims
             else tuple(idx[d] for d in kept))
        pairs.append((flat(out_shape, o), flat(in_shape, idx)))
    out_ids, in_ids = block_ids(out_shape, out), block_ids(in_shape, inp)
    o, i = zip(*pairs)
    assert is_function(out_ids[list(o)], in_ids[list(i)])  # a reduction never spans blocks
    assert is_function(in_ids[list(i)], out_ids[list(o)])


def test_reduce_rule_refuses_a_split_inside_the_reduced_dims():
    # Row on dim 2 of [4, 6, 8] reducing dim 1: a block would hold part of each reduction.
    assert reduce_rule((4, 6, 8), (4, 1, 8), frozenset({1}), StitchSchedule(2, 2, ROW)) is None
    assert reduce_rule((4, 6, 8), (4, 1, 8), frozenset({1}), StitchSchedule(0, 2, ROW)) is not None
    assert reduce_rule((4, 6, 8), (4, 1, 8), frozenset({1}), StitchSchedule(2, 4, COLUMN)) is not None


def _layer_norm_graph():
    shapes_ = {"x": (4, 8, 16), "m": (4, 8, 1), "d": (4, 8, 16), "q": (4, 8, 16), "v": (4, 8, 1),
               "y": (4, 8, 16), "ax": (1,), "t": (4, 16, 8)}
    return ecg([("ReduceMean", ["x", "ax"], ["m"]), ("Sub", ["x", "m"], ["d"]),
                ("Mul", ["d", "d"], ["q"]), ("ReduceMean", ["q", "ax"], ["v"]),
                ("Div", ["d", "v"], ["y"]), ("Transpose", ["y"], ["t"])],
               shapes_, ["x"], ["t"], {"ax": np.array([-1], dtype=np.int64)})


def test_propagation_agrees_through_a_stitched_layer_norm():
    graph = _layer_norm_graph()
    norm = {op.id for op in graph.ops if op.op_type != "Transpose"}
    found = {r.blocks: r for r in satisfiable(graph, norm, 64, (ROW,))}
    assert set(found) == {1, 2, 4, 8, 16, 32}  # rows of [4, 8]: never inside the reduced dim
    schedules = found[8].schedules
    for tensor in ("m", "d", "q", "v", "y"):
        assert schedules[tensor].blocks(graph.tensors[tensor].shape) == 8
    # A transpose with default (reversed) permutation moves dim 0: only one block passes it.
    graph = graph.with_ops([op if op.op_type != "Transpose" else
                            type(op)(**{**op.__dict__, "attrs": {}}) for op in graph.ops])
    everything = {op.id for op in graph.ops}
    assert [r.blocks for r in satisfiable(graph, everything, 64, (ROW,))] == [1]
    root = {"t": StitchSchedule(0, 2, ROW)}
    assert propagate(graph, everything, root) is None


# --- the performance library ---------------------------------------------------------------

class _Library:
    fallback = None

    def __init__(self, measured):
        self.measured = measured

    def latency(self, graph, op_ids):
        return Estimate(1e-5 * len(op_ids), COST_MODEL)

    def schedules(self, graph, op_ids):
        return [({STITCH_KEY: b, "threads": 2, "kernel": "h"}, s) for b, s in self.measured]

    def record(self, *args, **kwargs):
        raise NotImplementedError


def test_imbalance_of_static_chunks():
    assert imbalance(1, 4) == 4 and imbalance(4, 4) == 1 and imbalance(6, 4) == 8 / 6
    assert imbalance(0, 4) == 1  # unstitched: dynamic chunks


def test_tuning_ranks_by_the_model_until_every_shortlisted_schedule_was_measured():
    graph = _layer_norm_graph()
    norm = {op.id for op in graph.ops if op.op_type != "Transpose"}
    resolved = satisfiable(graph, norm, 64, (ROW,))
    model_only = PerformanceLibrary(graph, _Library([]), threads=2, shortlist=2).tune(norm, resolved)
    assert [c.blocks for c in model_only] == [2, 4, 0]
    assert {c.estimate.source for c in model_only} == {COST_MODEL}
    measured = [(2, 3e-6), (4, 1e-6), (0, 2e-6)]
    ranked = PerformanceLibrary(graph, _Library(measured), threads=2, shortlist=2).tune(norm, resolved)
    assert [c.blocks for c in ranked] == [4, 0, 2]
    assert {c.estimate.source for c in ranked} == {MEASURED}
    partly = PerformanceLibrary(graph, _Library(measured[:1]), threads=2, shortlist=2).tune(norm, resolved)
    assert [c.blocks for c in partly] == [2, 4, 0]  # never a measured figure against a modelled one


# --- the partitioner -----------------------------------------------------------------------

def _attention_like_graph():
    """MatMul → Add bias → Softmax → MatMul: the library calls bound the stitched Softmax."""
    shapes_ = {"x": (8, 32), "w": (32, 32), "a": (8, 32), "b": (32,), "c": (8, 32), "s": (8, 32),
               "w2": (32, 16), "y": (8, 16)}
    rng = np.random.default_rng(0)
    return ecg([("MatMul", ["x", "w"], ["a"]), ("Add", ["a", "b"], ["c"]),
                ("Softmax", ["c"], ["s"]), ("MatMul", ["s", "w2"], ["y"])],
               shapes_, ["x"], ["y"],
               {"w": rng.standard_normal((32, 32)).astype(np.float32),
                "b": rng.standard_normal(32).astype(np.float32),
                "w2": rng.standard_normal((32, 16)).astype(np.float32)})


def test_library_calls_are_boundaries_and_the_softmax_is_stitched():
    graph = _attention_like_graph()
    plan = FusionStitching(Constraints(threads=2))(graph, _Library([]))
    kinds = [[graph.op_by_id[o].op_type for o in b.op_ids] for b in plan.blocks]
    assert kinds == [["MatMul"], ["Add", "Softmax"], ["MatMul"]]
    stitched = plan.block_of["op2"]
    assert plan.schedules == {stitched: {STITCH_KEY: 2}}  # one chunk per thread
    assert {STITCH_KEY: 0} in plan.schedule_candidates[stitched]


def test_scratch_budget_stops_a_fusion_that_would_stitch_through_too_much():
    graph = _layer_norm_graph()
    wide = FusionStitching(Constraints(threads=2))(graph, _Library([]))
    tight = FusionStitching(Constraints(threads=2, scratch_bytes=64))(graph, _Library([]))
    assert len(wide.blocks) < len(tight.blocks)
    assert any("scratch" in d.reason for d in tight.decisions if not d.fused)


@settings(max_examples=100, deadline=None)
@given(graph=random_dags(), seed=st.integers(0, 1000))
def test_fusions_never_hold_a_library_call_with_anything_else(graph, seed):
    plan = partitioner("fusionstitching")(graph, RandomLatencies(seed))
    for block in plan.blocks:
        ops = [graph.op_by_id[i] for i in block.op_ids]
        if any(op.compute_intensive for op in ops):
            assert len(ops) == 1
        assert not any(op.mapping == M.MANY_TO_MANY and op.compute_intensive for op in ops[1:])


def test_empty_tensors_get_no_schedule_of_zero_blocks():
    # A zero-size dim makes some splits cut nothing: those are not schedules (no division by 0).
    assert all(s.blocks((0, 4)) >= 1 for s in schedule_space((0, 4), 64))
    assert with_partition((3, 0), (ROW, 0)) is None
    graph = ecg([("Relu", ["x"], ["y"])], {"x": (3, 0), "y": (3, 0)}, ["x"], ["y"])
    assert [r.blocks for r in satisfiable(graph, {"op0"}, 64)] == [1, 3]


# --- Column schedules ----------------------------------------------------------------------

def _column_norm_graph(rows=64, columns=96):
    """Statistics over axis 0 (the rows) and the normalised tensor: column reductions."""
    shapes_ = {"x": (rows, columns), "m": (1, columns), "d": (rows, columns),
               "q": (rows, columns), "v": (1, columns), "y": (rows, columns), "ax": (1,)}
    return ecg([("ReduceMean", ["x", "ax"], ["m"]), ("Sub", ["x", "m"], ["d"]),
                ("Mul", ["d", "d"], ["q"]), ("ReduceMean", ["q", "ax"], ["v"]),
                ("Div", ["d", "v"], ["y"])],
               shapes_, ["x"], ["y"], {"ax": np.array([0], dtype=np.int64)})


def test_a_column_reduction_passes_column_schedules_only_even_on_a_fusion_input():
    graph = _column_norm_graph()
    everything = {op.id for op in graph.ops}
    keys = {r.key for r in satisfiable(graph, everything, 256)}
    assert (COLUMN, 96) in keys and (COLUMN, 2) in keys
    assert {b for kind, b in keys if kind is ROW} == {1}  # a Row split would cut the reduced rows
    # The first ReduceMean reads x from outside the fusion: its own rule still holds.
    alone = {r.key for r in satisfiable(graph, {"op0"}, 256)}
    assert {b for kind, b in alone if kind is ROW} == {1} and (COLUMN, 96) in alone


def test_column_reduction_fusion_gets_a_column_schedule_and_a_row_one_gets_row():
    graph = _column_norm_graph()
    plan = FusionStitching(Constraints(threads=2))(graph, _Library([]))
    assert len(plan.blocks) == 1
    block = plan.blocks[0].id
    assert plan.schedules[block] == {STITCH_KEY: 2, COLUMNS_KEY: 96}  # a chunk of 48 per thread
    assert {STITCH_KEY: 0, COLUMNS_KEY: 0} in plan.schedule_candidates[block]
    report = fusion_report(graph, plan, {}, len(graph.ops))
    assert report["blocks"][0]["schedule"]["sched_type"] == "column"
    rows = FusionStitching(Constraints(threads=2))(_attention_like_graph(), _Library([]))
    assert all(COLUMNS_KEY not in s for s in rows.schedules.values())


def test_the_report_names_an_unstitched_schedule_as_the_kernel_runs_it():
    graph = _column_norm_graph()
    plan = FusionStitching(Constraints(threads=2))(graph, _Library([]))
    block = plan.blocks[0].id
    unstitched = replace(plan, schedules={block: {STITCH_KEY: 0, COLUMNS_KEY: 0}})
    report = fusion_report(graph, unstitched, {}, len(graph.ops))
    assert report["blocks"][0]["schedule"]["sched_type"] == "none"


def test_measured_row_and_column_schedules_rank_against_each_other():
    graph = _column_norm_graph()
    everything = {op.id for op in graph.ops}
    resolved = satisfiable(graph, everything, 256)
    library = PerformanceLibrary(graph, _Library([]), threads=2, shortlist=2)
    modelled = library.tune(everything, resolved)
    assert [(c.sched_type, c.blocks) for c in modelled] == [("column", 2), ("column", 4),
                                                             ("none", 0)]

    class _Measured(_Library):
        def schedules(self, graph, op_ids):
            return [({STITCH_KEY: 2, COLUMNS_KEY: 96, "threads": 2}, 5e-6),
                    ({STITCH_KEY: 4, COLUMNS_KEY: 96, "threads": 2}, 3e-6),
                    ({STITCH_KEY: 0, COLUMNS_KEY: 96, "threads": 2}, 1e-6)]

    measured = PerformanceLibrary(graph, _Measured([]), threads=2, shortlist=2)
    assert [c.key for c in measured.tune(everything, resolved)] == [(0, 0), (4, 96), (2, 96)]


def test_narrow_column_chunks_rank_behind_the_unstitched_kernel():
    graph = _column_norm_graph(columns=7)  # 7 blocks of one column each: no vector lanes filled
    everything = {op.id for op in graph.ops}
    ranked = PerformanceLibrary(graph, _Library([]), threads=2, shortlist=2).tune(
        everything, satisfiable(graph, everything, 256))
    assert [(c.sched_type, c.blocks) for c in ranked] == [("none", 0), ("column", 7)]
