"""A contraction C[b, i, j] = Σ_k A[b, i, k] · B[b, k, j] as the GEMM code sees it: operands and
results as index functions, whatever op (MatMul, Gemm, Einsum, an implicit-GEMM convolution, a
recurrence's gates) it comes from."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    NotEvaluable,
    add,
    array_load,
    evaluate_index,
    iconst,
    imin,
    load,
    mul,
    sub,
    substitute,
)
from kiln.codegen.indexing import Index, broadcast


AOperand = Callable[[Index, Expr, Expr], Expr]  # (A-batch index, i, k) -> value
BOperand = Callable[[Index, Expr, Expr], Expr]  # (B-batch index, k, j) -> value


@dataclass
class Contraction:
    batch: tuple[int, ...]  # output batch shape
    m: int
    n: int
    k: int
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    a: AOperand
    b: BOperand
    out: Callable[[Expr, Expr, Expr], Index]  # (flat batch, i, j) -> output index
    finish: Callable[[Expr, Expr, Expr, Expr], Expr]  # (sum, flat batch, i, j) -> result
    dtype: str
    # where results go when not to the op's output `out` (a kernel's private scratch):
    # (flat batch, i, j, value) -> statements
    store: Callable[[Expr, Expr, Expr, Expr], list[ir.Stmt]] | None = None


def results(ctx: StageCtx, spec: Contraction, total: Expr, b: Expr, i: Expr,
             j: Expr) -> list[ir.Stmt]:
    value = spec.finish(total, b, i, j)
    if spec.store is not None:
        return spec.store(b, i, j, value)
    return ctx.results({0: (spec.out(b, i, j), value)})


def batch_of(spec: Contraction, b: Expr, shape: tuple[int, ...]) -> Index:
    return broadcast(Index(spec.batch, flat=b), shape)


def stride_of(e: Expr, v: Expr) -> int | None:
    """If `e` is a buffer load, how far its offset moves when `v` grows by one."""
    if e.op != "load":
        return None
    offset = e.args[0]
    moved = substitute(offset, {v: add(v, 1)})
    delta = sub(moved, offset)
    return delta.value if delta.is_const else None


def constant_values(ctx: StageCtx, probe: Expr, probes: tuple[Expr, ...],
                    grid: list[np.ndarray]) -> np.ndarray | None:
    """The elements a load `probe` of a constant reads at every point of `grid` (one array per
    probe variable), gathered at compile time; None if `probe` is not such a load or its index
    cannot be evaluated."""
    if probe.op != "load" or probe.name not in ctx.graph.tensors:
        return None
    source = ctx.graph.tensors[probe.name]
    if not source.is_constant:
        return None
    try:
        offsets = evaluate_index(probe.args[0], dict(zip(probes, grid)))
    except NotEvaluable:
        return None
    return source.data.reshape(-1)[np.broadcast_to(offsets, grid[0].shape)]


def tile_epilogue(ctx: StageCtx, spec: Contraction, ldc: int, tile: str, b: Expr,
                  rows: tuple[Expr, Expr, int], cols: tuple[Expr, Expr, int]) -> list[ir.Stmt]:
    """Results of the tile (rows, cols) = (block start, tile start, tile size) through the fused
    epilogue, the inner loop along the output's contiguous axis; the local array `tile` holds the
    block from its start, rows `ldc` apart. Where the output runs along the tile's rows (a conv
    with its pixels as the product's rows) and the tile spans whole vectors both ways, it is
    copied transposed first (`ir.Transpose`), so that the epilogue reads it along its loop: read
    down its columns one element at a time, a 7 × 7 conv's block spent a fifth of its time there."""
    (i0, i_lo, mr), (j0, j_lo, nr) = rows, cols
    i, j = ctx.var("i", spec.m), ctx.var("j", spec.n)
    i_end = imin(add(i_lo, mr), iconst(spec.m))
    j_end = imin(add(j_lo, nr), iconst(spec.n))
    offset = spec.out(b, i, j).flat
    rows_inner = (spec.store is None and spec.m > 1
                  and stride_of(load("probe", spec.dtype, offset), i) == 1)
    total = array_load(tile, spec.dtype, add(mul(sub(i, i0), ldc), sub(j, j0)))
    outer, inner = ((j, j_lo, j_end), (i, i_lo, i_end)) if rows_inner else (
        (i, i_lo, i_end), (j, j_lo, j_end))
    copy: list[ir.Stmt] = []
    s = ctx.schedule
    lanes = s.vector_bytes // np.dtype(spec.dtype).itemsize
    if rows_inner and s.vector_bytes and not s.gemm_work_group and min(mr, nr) >= lanes:
        transposed, ld = ctx.name("tt"), -(-mr // lanes) * lanes
        copy = [ir.DeclArray(transposed, spec.dtype, nr * ld),
                ir.Transpose(spec.dtype, tile, add(mul(sub(i_lo, i0), ldc), sub(j_lo, j0)), ldc,
                             transposed, iconst(0), ld, sub(i_end, i_lo), sub(j_end, j_lo),
                             s.vector_bytes)]
        total = array_load(transposed, spec.dtype, add(mul(sub(j, j_lo), ld), sub(i, i_lo)))
    stmts = results(ctx, spec, total, b, i, j)
    return [*copy, ir.Loop(outer[0], outer[1], outer[2],
                           [_vector_loop(ctx, inner[0], inner[1], inner[2], stmts)])]


def _vector_loop(ctx: StageCtx, v: Expr, start: Expr, stop: Expr, body: list[ir.Stmt]) -> ir.Loop:
    """The simd loop of `v` over [start, stop); counted from 0 when it runs a fixed number of
    times (a whole micro-tile's row), so that the C compiler sees the count: with bounds it must
    subtract at run time it adds a remainder loop and checks to every row of every tile."""
    extent = sub(stop, start)
    if not extent.is_const:
        return ir.Loop(v, start, stop, body, simd=True)
    counted = ctx.var(v.name.rstrip("0123456789"), extent.value)
    ir.map_exprs(body, lambda e: substitute(e, {v: add(start, counted)}))
    return ir.Loop(counted, iconst(0), extent, body, simd=True)
