"""Index-set splitting and unswitching of inner loops (`kiln.codegen.passes`): Pad, Concat and
Slice chains inside blocks compute the same as onnxruntime, and their inner vectorised loops are
left with no comparison, clamp or select on the loop variable."""
from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate, ir
from kiln.codegen.expr import add, const, iconst, imin, index_compare, load, select, var, walk
from kiln.codegen.passes import CONDITIONS, split_index_sets
from kiln.target import host_target
from tests.codegen.harness import check_model, model, plan_for, random_inputs


@st.composite
def pad_cases(draw):
    rank = draw(st.integers(2, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    pads = [draw(st.integers(0, 3)) for _ in range(2 * rank)]
    return shape, pads


@settings(max_examples=20, deadline=None)
@given(pad_cases(), st.sampled_from(["constant", "edge", "reflect"]), st.booleans())
def test_pad_with_elementwise_around(case, mode, sigmoid):
    shape, pads = case
    rank = len(shape)
    if mode == "reflect":  # reflect needs pads smaller than the dim
        pads = [min(p, shape[i % rank] - 1) for i, p in enumerate(pads)]
    spec = {"x": (shape, "float32")}
    inits = {"pads": np.array(pads, np.int64), "v": np.array(1.5, np.float32)}
    nodes = [helper.make_node("Sigmoid" if sigmoid else "Neg", ["x"], ["a"]),
             helper.make_node("Pad", ["a", "pads"] + (["v"] if mode == "constant" else []), ["p"],
                              mode=mode),
             helper.make_node("Mul", ["p", "p"], ["y"])]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=4), st.integers(-1, 1))
def test_concat_slice_chain(widths, axis):
    rank = 3
    shapes = [(2, 3, w) if axis in (-1, 2) else (2, w, 3) if axis == 1 else (w, 2, 3)
              for w in widths]
    spec = {f"x{i}": (s, "float32") for i, s in enumerate(shapes)}
    total = sum(widths)
    inits = {"starts": np.array([1], np.int64), "ends": np.array([max(2, total - 1)], np.int64),
             "axes": np.array([axis % rank], np.int64)}
    nodes = [helper.make_node("Concat", list(spec), ["c"], axis=axis),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"]),
             helper.make_node("Tanh", ["s"], ["y"])]
    check_model(model(nodes, spec, ["y"], inits), random_inputs(spec))


def _inner_simd_loops(body):
    for stmt in ir.iter_stmts(body):
        if isinstance(stmt, ir.Loop) and stmt.simd and not any(
                isinstance(s, ir.Loop) for s in ir.iter_stmts(stmt.body)):
            yield stmt


def test_padded_plane_inner_loops_have_no_conditions():
    """Swish then zero Pad (EfficientNet's stride-2 blocks): the vectorised loops neither test
    nor clamp their variable, and the padded rows are a separate loop storing zeros."""
    spec = {"x": ((1, 4, 9, 9), "float32")}
    inits = {"pads": np.array([0, 0, 1, 1, 0, 0, 2, 2], np.int64)}
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["a"]),
             helper.make_node("Pad", ["a", "pads"], ["y"])]
    m = model(nodes, spec, ["y"], inits)
    check_model(m, random_inputs(spec))
    graph = frontend.build(m, {}, "test")
    kernels = generate(plan_for(graph, "dnnfusion"), host_target())
    source = "\n".join(k.source for k in kernels)
    body = source[source.index("void k"):]
    for block in re.findall(r"#pragma omp simd\n\s*for \(int64_t (\w+) =[^\n]*\n(.*?)\n\s*\}",
                            body, re.S):
        v, text = block
        assert "?" not in text, text
    assert re.search(r"if \(v\d+\) \{", body), body


def test_split_pieces_cover_the_range_and_decide_every_condition():
    """The pass on a hand-built loop: pieces tile [0, 20) in order, and every comparison and
    clamp of the variable is folded inside each piece."""
    i = var("i", 20)
    cond = index_compare("lt", i, 13)
    clamped = imin(add(i, -2), iconst(9))
    value = select(cond, load("a", "float32", clamped), const(0, "float32"))
    loop = ir.Loop(i, iconst(0), iconst(20), [ir.Store("b", i, value)], simd=True)
    counter = iter(range(100))
    pieces = split_index_sets([loop], lambda base: f"{base}{next(counter)}")
    bounds = [(p.start.value, p.stop.value) for p in pieces]
    assert bounds[0][0] == 0 and bounds[-1][1] == 20
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    for piece in pieces:
        nodes = walk(ir.all_exprs(piece.body))
        assert not [n for n in nodes if n.op in CONDITIONS | {"select"}
                    and piece.var in n.free], piece
