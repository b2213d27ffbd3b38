"""Ops that walk data in order: CumSum/CumProd (prefix scans), TopK (selection) and Det
(elimination).

Both run one sequential walk per line along the axis, lines in parallel. TopK keeps the best k
(value, index) pairs of a line in scratch, sorted, by passing each element down the list and
swapping wherever it wins (ties go to the lower index, as in onnxruntime), which needs no
data-dependent loop bounds and costs n·k comparisons per line.
"""
from __future__ import annotations

import math

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    INDEX,
    Expr,
    acc,
    add,
    as_index,
    binary,
    const,
    iconst,
    load,
    local,
    logical_and,
    logical_or,
    make,
    mul,
    select,
    sub,
    unary,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage
from kiln.codegen.ops.common import axis_of, needs_const_inputs
from kiln.ecg import Graph, Op


def _lines(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _at(shape: tuple[int, ...], axis: int, line: Expr, position: Expr) -> Index:
    """Element `position` along `axis` of line `line` (lines enumerate the other dims)."""
    outer, _, inner = _lines(shape, axis)
    o, i = Index((outer, inner), flat=line).dims
    return Index(shape, flat=add(mul(add(mul(o, shape[axis]), position), inner), i))


@stage("CumSum", "CumProd")
def _cumulative(ctx: StageCtx) -> None:
    """A constant axis gives one loop nest; a run-time axis one nest per possible axis, chosen
    by the axis value when the kernel runs."""
    shape, out = ctx.tensor(0).shape, ctx.out()
    if out.numel == 0:
        return
    rank = len(shape)
    axis = ctx.const(1)
    if axis is not None:
        nest = _scan_nest(ctx, axis_of(int(axis.reshape(-1)[0]), rank))
        ctx.stage(f"{ctx.op.op_type} ({ctx.op.id})", [nest], out.numel)
        return
    chosen = as_index(ctx.operand(1, Index(ctx.tensor(1).shape, flat=iconst(0))))
    branches: list[ir.Stmt] = []
    for a in range(rank):
        nest = _scan_nest(ctx, a)
        nest.parallel = int(out.numel >= ctx.schedule.parallel_min_work)
        hit = logical_or(make("eq", BOOL, (chosen, iconst(a))),
                         make("eq", BOOL, (chosen, iconst(a - rank))))
        branches.append(ir.If(hit, [nest]))
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id}), run-time axis", branches, out.numel)


def _scan_nest(ctx: StageCtx, axis: int) -> ir.Loop:
    shape, out = ctx.tensor(0).shape, ctx.out()
    outer, n, inner = _lines(shape, axis)
    line = ctx.var("l", outer * inner)
    step = ctx.var("s", n)
    position = sub(iconst(n - 1), step) if ctx.attr("reverse", 0) else step
    index = _at(shape, axis, line, position)
    op = "add" if ctx.op.op_type == "CumSum" else "mul"
    running = acc(ctx.name("acc"), out.dtype)
    body: list[ir.Stmt] = []
    value: Expr = running
    if ctx.attr("exclusive", 0):
        value = local(ctx.name("before"), out.dtype)
        body.append(ir.Let(value, running))
    body.append(ir.Assign(running, binary(op, running, ctx.operand(0, index))))
    body += ctx.results({0: (index, value)})
    identity = const(0 if op == "add" else 1, out.dtype)
    return ir.Loop(line, iconst(0), iconst(outer * inner),
                   [ir.DeclAcc(running, identity), ir.Loop(step, iconst(0), iconst(n), body)],
                   parallel=1)


def _topk_check(op: Op, graph: Graph) -> str | None:
    return needs_const_inputs(1)(op, graph)


@stage("TopK", check=_topk_check)
def _topk(ctx: StageCtx) -> None:
    shape = ctx.tensor(0).shape
    dtype = ctx.tensor(0).dtype
    axis = axis_of(ctx.attr("axis", -1), len(shape))
    k = int(ctx.const(1).reshape(-1)[0])
    outer, n, inner = _lines(shape, axis)
    lines = outer * inner
    if lines * k == 0:
        return
    largest = ctx.attr("largest", 1)
    values, indices = ctx.scratch(dtype, lines * k), ctx.scratch(INDEX, lines * k)
    line = ctx.var("l", lines)
    slot_var = ctx.var("k", k)
    slot = add(mul(line, k), slot_var)
    worst = _worst(dtype, largest)
    init = ir.Loop(slot_var, iconst(0), iconst(k),
                   [ir.Store(values, slot, worst), ir.Store(indices, slot, iconst(n))])
    element = ctx.var("e", n)
    carry_v, carry_i = acc(ctx.name("cv"), dtype), acc(ctx.name("ci"), INDEX)
    take = [ir.DeclAcc(carry_v, ctx.operand(0, _at(shape, axis, line, element))),
            ir.DeclAcc(carry_i, element)]
    pos = ctx.var("k", k)
    here = add(mul(line, k), pos)
    held_v, held_i = local(ctx.name("hv"), dtype), local(ctx.name("hi"), INDEX)
    wins = local(ctx.name("w"), BOOL)
    better = make("gt" if largest else "lt", BOOL, (carry_v, held_v))
    tie = logical_and(make("eq", BOOL, (carry_v, held_v)), make("lt", BOOL, (carry_i, held_i)))
    swap = [ir.Let(held_v, load(values, dtype, here)), ir.Let(held_i, load(indices, INDEX, here)),
            ir.Let(wins, logical_or(better, tie)),
            ir.Store(values, here, select(wins, carry_v, held_v)),
            ir.Store(indices, here, select(wins, carry_i, held_i)),
            ir.Assign(carry_v, select(wins, held_v, carry_v)),
            ir.Assign(carry_i, select(wins, held_i, carry_i))]
    walk = ir.Loop(element, iconst(0), iconst(n),
                   take + [ir.Loop(pos, iconst(0), iconst(k), swap)])
    out_shape = ctx.out(0).shape
    rank_var = ctx.var("k", k)
    at = add(mul(line, k), rank_var)
    out_index = _at(out_shape, axis, line, rank_var)
    results: dict[int, tuple[Index, Expr]] = {0: (out_index, load(values, dtype, at)),
                                               1: (out_index, load(indices, INDEX, at))}
    emit = ir.Loop(rank_var, iconst(0), iconst(k), ctx.results(results))
    ctx.stage(f"TopK ({ctx.op.id})", [ir.Loop(line, iconst(0), iconst(lines), [init, walk, emit],
                                              parallel=1)], lines * n * k)


def _worst(dtype: str, largest: int) -> Expr:
    if dtype in FLOAT_TYPES:
        return const(-math.inf if largest else math.inf, dtype)
    info = np.iinfo(np.dtype(dtype)) if dtype != BOOL else None
    if info is None:
        return const(0 if largest else 1, dtype)
    return const(info.min if largest else info.max, dtype)


@stage("Det")
def _det(ctx: StageCtx) -> None:
    """Determinants by Gaussian elimination with partial pivoting, one matrix per thread, on a
    copy in scratch."""
    shape, out = ctx.shape(0), ctx.out()
    n = shape[-1]
    matrices = out.numel
    if matrices == 0:
        return
    dtype = out.dtype
    work = ctx.scratch(dtype, matrices * n * n)
    m = var(ctx.name("m"), matrices)

    def at(row: Expr, col: Expr) -> Expr:
        return add(mul(m, n * n), mul(row, n), col)

    def element(row: Expr, col: Expr) -> Expr:
        return load(work, dtype, at(row, col))

    q = var(ctx.name("q"), n * n)
    copy = ir.Loop(q, iconst(0), iconst(n * n),
                   [ir.Store(work, add(mul(m, n * n), q),
                             ctx.operand(0, Index(shape, flat=add(mul(m, n * n), q))))], simd=True)
    det = acc(ctx.name("det"), dtype)
    k = var(ctx.name("k"), n)
    best, pivot_row = acc(ctx.name("best"), dtype), acc(ctx.name("piv"), INDEX)
    i = var(ctx.name("i"), n)
    magnitude = local(ctx.name("mag"), dtype)
    wins = local(ctx.name("w"), BOOL)
    search = ir.Loop(i, k, iconst(n), [
        ir.Let(magnitude, make("abs", dtype, (element(i, k),))),
        ir.Let(wins, make("gt", BOOL, (magnitude, best))),
        ir.Assign(pivot_row, select(wins, i, pivot_row)),
        ir.Assign(best, select(wins, magnitude, best))])
    j = var(ctx.name("j"), n)
    upper, lower = local(ctx.name("u"), dtype), local(ctx.name("l"), dtype)
    swap = ir.Loop(j, iconst(0), iconst(n), [
        ir.Let(upper, element(k, j)), ir.Let(lower, element(pivot_row, j)),
        ir.Store(work, at(k, j), lower), ir.Store(work, at(pivot_row, j), upper)])
    pivot = local(ctx.name("pivot"), dtype)
    r, c = var(ctx.name("r"), n), var(ctx.name("c"), n)
    factor = local(ctx.name("f"), dtype)
    eliminate = ir.Loop(r, add(k, 1), iconst(n), [
        ir.Let(factor, binary("div", element(r, k), pivot)),
        ir.Loop(c, k, iconst(n), [ir.Store(work, at(r, c), binary(
            "sub", element(r, c), binary("mul", factor, element(k, c))))], simd=True)])
    step = ir.Loop(k, iconst(0), iconst(n), [
        ir.DeclAcc(best, const(-1, dtype)), ir.DeclAcc(pivot_row, k), search, swap,
        ir.Assign(det, select(make("ne", BOOL, (pivot_row, k)), unary("neg", det), det)),
        ir.Let(pivot, element(k, k)), ir.Assign(det, binary("mul", det, pivot)),
        ir.If(make("ne", BOOL, (pivot, const(0, dtype))), [eliminate])])
    body = [copy, ir.DeclAcc(det, const(1, dtype)), step,
            *ctx.results({0: (Index(out.shape, flat=m), det)})]
    ctx.stage(f"Det ({ctx.op.id})", [ir.Loop(m, iconst(0), iconst(matrices), body, parallel=1)],
              matrices * n * n * n)
