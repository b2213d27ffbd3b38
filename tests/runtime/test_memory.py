"""The memory plan: no two buffers live at once share bytes, space is reused, weights are packed."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.codegen import Kernel
from kiln.ecg import Graph, Op, Tensor
from kiln.errors import KilnError
from kiln.plan import FusionPlan
from kiln.plan.blocks import build_plan
from kiln.runtime.memory import ALIGNMENT, ArenaBuffer, place, plan_memory, weights_blob
from tests.runtime.handmade import chain, mlp


def block_kernels(plan: FusionPlan, scratch: int = 0) -> list[Kernel]:
    """One kernel per block reading the block's inputs and writing its outputs (no source)."""
    return [Kernel(f"k{i}_{b.name}", b.id, "", (*b.inputs, *b.outputs), b.outputs,
                   scratch_bytes=scratch * i)
            for i, b in enumerate(plan.blocks)]


@st.composite
def random_plans(draw) -> FusionPlan:
    n = draw(st.integers(1, 30))
    tensors = {"x": Tensor("x", (draw(st.integers(1, 300)),), "float32"),
               "w": Tensor("w", (7,), "float32", data=np.ones(7, np.float32))}
    ops = []
    for i in range(n):
        available = ["x", "w"] + [op.outputs[0] for op in ops]
        inputs = tuple(draw(st.lists(st.sampled_from(available), min_size=1, max_size=3)))
        out = f"t{i}"
        tensors[out] = Tensor(out, (draw(st.integers(0, 5000)),), "float32")
        ops.append(Op(f"op{i}", "Add" if len(inputs) > 1 else "Relu", inputs, (out,)))
    consumed = {t for op in ops for t in op.inputs}
    extra = draw(st.lists(st.sampled_from([op.outputs[0] for op in ops]), max_size=2))
    outputs = [op.outputs[0] for op in ops if op.outputs[0] not in consumed] + extra
    graph = Graph(tensors, ops, ["x"], outputs)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    bounds = [0, *cuts, n]
    groups = [[f"op{i}" for i in range(a, b)] for a, b in itertools.pairwise(bounds)]
    return build_plan(graph, groups, "random")


def reads_and_writes(kernels: list[Kernel], memory) -> dict[str, tuple[int, int]]:
    ordered = [kernels[i] for i in memory.kernel_order]
    first = {t: i for i, k in enumerate(ordered) for t in k.outputs}
    last = {}
    for i, k in enumerate(ordered):
        for t in k.args:
            last[t] = max(last.get(t, -1), i)
    return {t: (i, last[t]) for t, i in first.items()}


@settings(max_examples=150, deadline=None)
@given(plan=random_plans())
def test_live_buffers_never_overlap(plan):
    kernels = block_kernels(plan)
    memory = plan_memory(plan, kernels)
    arena = list(memory.arena)
    assert {b.tensor for b in arena} == {t for k in kernels for t in k.outputs} - set(plan.graph.outputs)
    lifetimes = reads_and_writes(kernels, memory)
    for b in arena:
        assert b.offset % ALIGNMENT == 0
        assert (b.first, b.last) == lifetimes[b.tensor]
        assert b.nbytes == plan.graph.tensors[b.tensor].nbytes
        assert b.offset + b.nbytes <= memory.arena_bytes
    for a, b in itertools.combinations(arena, 2):
        if a.nbytes and b.nbytes and a.overlaps_in_time(b):
            assert not a.overlaps_in_space(b), (a, b)
    assert memory.arena_bytes <= sum(-(-b.nbytes // ALIGNMENT) * ALIGNMENT for b in arena)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 20), st.integers(0, 20)),
                max_size=40))
def test_place_separates_every_pair_alive_together(specs):
    intervals = [(f"t{i}", size, min(a, b), max(a, b)) for i, (size, a, b) in enumerate(specs)]
    placed = place(intervals)
    assert sorted(b.tensor for b in placed) == sorted(t for t, *_ in intervals)
    for a, b in itertools.combinations(placed, 2):
        if a.nbytes and b.nbytes and a.overlaps_in_time(b):
            assert not a.overlaps_in_space(b)


def test_a_chain_reuses_two_buffers():
    model = chain(10, size=1000)
    memory = plan_memory(model.plan, model.kernels)
    assert len(memory.arena) == 9
    assert memory.arena_bytes == 2 * 4032  # ping-pong between two 4000-byte (aligned) slots
    assert len({b.offset for b in memory.arena}) == 2
    assert memory.peak_bytes == memory.arena_bytes + 2 * 4000


def test_best_fit_puts_a_buffer_into_the_smallest_hole_that_fits():
    placed = {b.tensor: b for b in place([
        ("a", 2048, 0, 5), ("hole_1024", 1024, 0, 0), ("c", 512, 0, 5), ("hole_256", 256, 0, 0),
        ("e", 128, 0, 5), ("small", 100, 1, 5)])}
    assert placed["small"].offset == placed["hole_256"].offset == 2048 + 1024 + 512


def test_scratch_is_the_largest_request():
    model = chain(4)
    kernels = block_kernels(model.plan, scratch=100)
    memory = plan_memory(model.plan, kernels)
    assert memory.scratch_bytes == 320  # 300 rounded up to the alignment
    assert all(r.region != "scratch" for binding in memory.bindings for r in binding)


def test_weights_hold_referenced_constants_once_and_constant_outputs():
    model = mlp()
    graph = model.plan.graph
    w = graph.tensors["w"].data
    packed = w.T.copy()
    kernels = [*model.kernels]
    kernels[0] = Kernel(kernels[0].symbol, "b0", "", ("x", "w_packed", "h"), ("h",),
                        derived_constants={"w_packed": packed})
    kernels[2] = Kernel(kernels[2].symbol, "b2", "", ("y", "w_packed", "z"), ("z",),
                        derived_constants={"w_packed": packed})
    memory = plan_memory(model.plan, kernels)
    keys = [set(e.keys) for e in memory.weights]
    assert {"k0_matmul:w_packed", "k2_add:w_packed"} in keys  # equal contents stored once
    assert {"b"} in keys and {"c"} in keys and {"w"} not in keys  # w is no longer read
    blob = weights_blob(model.plan, kernels, memory)
    assert len(blob) == memory.weights_bytes
    entry = next(e for e in memory.weights if "c" in e.keys)
    stored = np.frombuffer(blob, np.float32, count=6, offset=entry.offset).reshape(2, 3)
    np.testing.assert_array_equal(stored, graph.tensors["c"].data)


def test_outputs_that_alias_inputs_constants_or_other_outputs_are_copied():
    model = mlp()
    memory = plan_memory(model.plan, model.kernels)
    copies = {c.output: c.source for c in memory.copies}
    assert copies[2].region == "input" and copies[2].where == 0  # x
    assert copies[3].region == "weights"  # c
    assert copies[4].region == "output" and copies[4].where == 0  # y, listed twice
    assert set(copies) == {2, 3, 4}


def test_kernels_run_in_block_order_whatever_the_list_order():
    model = chain(5)
    memory = plan_memory(model.plan, list(reversed(model.kernels)))
    assert memory.kernel_order == (4, 3, 2, 1, 0)


def test_reading_a_tensor_no_kernel_wrote_is_an_error():
    model = chain(3)
    kernels = model.kernels[:1] + model.kernels[2:]  # drop the kernel writing t2
    with pytest.raises(KilnError, match="reads t2 before any kernel writes it"):
        plan_memory(model.plan, kernels)


def test_an_output_no_kernel_writes_is_an_error():
    model = chain(3)
    with pytest.raises(KilnError, match="written by no kernel"):
        plan_memory(model.plan, model.kernels[:2])


def test_arena_buffer_overlap_helpers():
    a = ArenaBuffer("a", 0, 64, 0, 1)
    assert a.overlaps_in_time(ArenaBuffer("b", 64, 64, 1, 2))
    assert not a.overlaps_in_space(ArenaBuffer("b", 64, 64, 1, 2))
    assert not a.overlaps_in_time(ArenaBuffer("c", 0, 64, 2, 3))
