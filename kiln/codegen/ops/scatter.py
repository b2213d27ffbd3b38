"""Data-dependent writes: ScatterElements, Scatter, ScatterND, MaxUnpool.

The result is built in scratch — a parallel copy of `data` (zeros for MaxUnpool), then the updates
applied one after another in index order, so repeated indices resolve as in the reference (last
write wins, or the reduction combines them) — and then handed element by element to the block's
epilogue.
"""
from __future__ import annotations

import math

from kiln.codegen import ir
from kiln.codegen.expr import Expr, binary, const, iconst, load, var
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage
from kiln.codegen.ops.common import axis_of, wrapped

COMBINE = {"add": "add", "mul": "mul", "max": "max", "min": "min"}


def _combine(reduction: str, old: Expr, new: Expr) -> Expr:
    return new if reduction == "none" else binary(COMBINE[reduction], old, new)


def _scatter(ctx: StageCtx, initial, updates: int, writes) -> None:
    """Copy `initial(index)` into scratch, run `writes(buffer)` sequentially, emit the result."""
    out = ctx.out()
    if out.numel == 0:
        return
    buffer = ctx.scratch(out.dtype, out.numel)
    q = var(ctx.name("q"), out.numel)
    fill = ir.Loop(q, iconst(0), iconst(out.numel),
                   [ir.Store(buffer, q, initial(Index(out.shape, flat=q)))], parallel=1, simd=True)
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id}): copy", [fill], out.numel)
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id}): updates", writes(buffer), ctx.tensor(updates).numel)
    e = var(ctx.name("q"), out.numel)
    emit = ctx.results({0: (Index(out.shape, flat=e), load(buffer, out.dtype, e))})
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id}): result",
              [ir.Loop(e, iconst(0), iconst(out.numel), emit, parallel=1, simd=True)], out.numel)


@stage("ScatterElements", "Scatter")
def _scatter_elements(ctx: StageCtx) -> None:
    shape = ctx.shape(0)
    axis = axis_of(ctx.attr("axis", 0), len(shape))
    reduction = ctx.attr("reduction", "none")
    index_shape = ctx.shape(1)
    count = math.prod(index_shape)

    def writes(buffer: str) -> list[ir.Stmt]:
        u = var(ctx.name("u"), max(count, 1))
        at = Index(index_shape, flat=u)
        dims = list(at.dims)
        dims[axis] = wrapped(ctx.operand(1, at), shape[axis])
        target = Index(shape, dims=dims).flat
        value = _combine(reduction, load(buffer, ctx.out().dtype, target), ctx.operand(2, at))
        return [ir.Loop(u, iconst(0), iconst(count), [ir.Store(buffer, target, value)])]

    _scatter(ctx, lambda index: ctx.operand(0, index), 2, writes)


@stage("ScatterND")
def _scatter_nd(ctx: StageCtx) -> None:
    shape = ctx.shape(0)
    index_shape = ctx.shape(1)
    k = index_shape[-1]
    slots = math.prod(index_shape[:-1])
    tail = shape[k:]
    slice_size = math.prod(tail)
    reduction = ctx.attr("reduction", "none")

    def writes(buffer: str) -> list[ir.Stmt]:
        u = var(ctx.name("u"), max(slots * slice_size, 1))
        slot, inner = Index((slots, slice_size), flat=u).dims
        lead = Index(index_shape[:-1], flat=slot).dims
        position = [wrapped(ctx.operand(1, Index(index_shape, dims=[*lead, iconst(j)])), shape[j])
                    for j in range(k)]
        target = Index(shape, dims=[*position, *Index(tail, flat=inner).dims]).flat
        update = ctx.operand(2, Index(ctx.shape(2), flat=u))
        value = _combine(reduction, load(buffer, ctx.out().dtype, target), update)
        return [ir.Loop(u, iconst(0), iconst(slots * slice_size), [ir.Store(buffer, target, value)])]

    _scatter(ctx, lambda index: ctx.operand(0, index), 2, writes)


@stage("MaxUnpool")
def _max_unpool(ctx: StageCtx) -> None:
    out = ctx.out()
    count = ctx.tensor(0).numel

    def writes(buffer: str) -> list[ir.Stmt]:
        u = var(ctx.name("u"), max(count, 1))
        at = Index(ctx.shape(0), flat=u)
        target = wrapped(ctx.operand(1, at), out.numel)
        return [ir.Loop(u, iconst(0), iconst(count), [ir.Store(buffer, target, ctx.operand(0, at))])]

    _scatter(ctx, lambda index: const(0, out.dtype), 0, writes)
