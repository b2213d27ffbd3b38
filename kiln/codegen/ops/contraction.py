"""Contractions: MatMul (batched, broadcast batch dims), Gemm, and Einsum in matrix form.

All of them lower to one loop nest over C[b, i, j] = Σ_k A[b, i, k] · B[b, k, j]:

* `ikj` (default): parallel over (batch, block of `matmul_tile_m` rows); for each column tile of
  `matmul_tile_n`, accumulators acc[rows][cols] on the stack; for k: for each row, A[i, k] is
  evaluated once (through the prologue) and the vectorised inner loop does
  acc[r][j] += a · B[k, j] over contiguous B. Then the epilogue runs on acc.
* `dot`: when B is contiguous along k instead (a transposed operand, Q·Kᵀ) and A is a plain load,
  each C element is a vectorised dot product.

B must be a plain contiguous load for `ikj`. A constant B read through a remap (Gemm's transB,
a transposed weight) becomes a derived constant packed at compile time; any other B is packed into
scratch by a first loop nest (a prologue with arithmetic is evaluated there once, not M times).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    Expr, NotEvaluable, acc, add, array_load, binary, const, evaluate_index, iconst, imin, load,
    modulo, floordiv, mul, sub, substitute, var)
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.lower import StageCtx
from kiln.codegen.ops import stage

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


def stride_of(e: Expr, v: Expr) -> int | None:
    """If `e` is a buffer load, how far its offset moves when `v` grows by one."""
    if e.op != "load":
        return None
    offset = e.args[0]
    moved = substitute(offset, {v: add(v, 1)})
    delta = sub(moved, offset)
    return delta.value if delta.is_const else None


def contraction(ctx: StageCtx, spec: Contraction) -> None:
    bt = math.prod(spec.batch)
    if bt * spec.m * spec.n == 0:
        return
    probe_b = var(ctx.name("pb"), max(math.prod(spec.b_batch), 1))
    probe_k, probe_j = var(ctx.name("pk"), max(spec.k, 1)), var(ctx.name("pj"), spec.n)
    b_probe = spec.b(Index(spec.b_batch, flat=probe_b), probe_k, probe_j)
    a_probe = spec.a(Index(spec.a_batch, flat=var(ctx.name("pa"), max(math.prod(spec.a_batch), 1))),
                     var(ctx.name("pi"), spec.m), probe_k)
    if stride_of(b_probe, probe_j) == 1:
        _ikj(ctx, spec, spec.b)
    elif (packed := _constant_packed(ctx, spec, b_probe, probe_b, probe_k, probe_j)) is not None:
        _ikj(ctx, spec, packed)
    elif stride_of(b_probe, probe_k) == 1 and stride_of(a_probe, probe_k) == 1:
        _dot(ctx, spec)
    else:
        _ikj(ctx, spec, _pack_in_scratch(ctx, spec))


def _batch_of(spec: Contraction, b: Expr, shape: tuple[int, ...]) -> Index:
    return broadcast(Index(spec.batch, flat=b), shape)


def _constant_packed(ctx: StageCtx, spec: Contraction, probe: Expr, pb: Expr, pk: Expr,
                     pj: Expr) -> BOperand | None:
    """A constant B read through an index remap: gather it once at compile time."""
    if probe.op != "load" or probe.name not in ctx.graph.tensors:
        return None
    source = ctx.graph.tensors[probe.name]
    if not source.is_constant:
        return None
    nb = max(math.prod(spec.b_batch), 1)
    grid = np.meshgrid(np.arange(nb), np.arange(spec.k), np.arange(spec.n), indexing="ij")
    try:
        offsets = evaluate_index(probe.args[0], dict(zip((pb, pk, pj), grid)))
    except NotEvaluable:
        return None
    packed = source.data.reshape(-1)[np.broadcast_to(offsets, grid[0].shape)]
    name = ctx.derived(packed.reshape(nb, spec.k, spec.n))
    ctx.info["b_operand"] = "derived constant"
    return lambda bb, k, j: load(name, spec.dtype, add(mul(add(mul(bb.flat, spec.k), k), spec.n), j))


def _pack_in_scratch(ctx: StageCtx, spec: Contraction) -> BOperand:
    nb = max(math.prod(spec.b_batch), 1)
    total = nb * spec.k * spec.n
    name = ctx.scratch(spec.dtype, total)
    q = ctx.var("q", total)
    bb, k, j = Index((nb, spec.k, spec.n), flat=q).dims
    value = spec.b(Index(spec.b_batch, flat=bb), k, j)
    loop = ir.Loop(q, iconst(0), iconst(total), [ir.Store(name, q, value)], parallel=1, simd=True)
    ctx.stage(f"pack operand B of {ctx.op.id}", [loop], total)
    ctx.info["b_operand"] = "packed in scratch"
    return lambda bbi, kk, jj: load(name, spec.dtype, add(mul(add(mul(bbi.flat, spec.k), kk),
                                                              spec.n), jj))


def _tile(n: int, limit: int) -> int:
    """A tile size ≤ limit: n itself if it fits, else a divisor of n of at least limit/2."""
    if n <= limit:
        return n
    for t in range(limit, limit // 2 - 1, -1):
        if n % t == 0:
            return t
    return limit


def _ikj(ctx: StageCtx, spec: Contraction, b_operand: BOperand) -> None:
    s = ctx.schedule
    mr = min(s.matmul_tile_m, spec.m)
    nb = _tile(spec.n, s.matmul_tile_n)
    row_blocks, col_blocks = -(-spec.m // mr), -(-spec.n // nb)
    bt = math.prod(spec.batch)
    p = ctx.var("p", bt * row_blocks)
    b, i0 = floordiv(p, row_blocks), mul(modulo(p, row_blocks), mr)
    jb = ctx.var("jb", col_blocks)
    j0 = mul(jb, nb)
    i_end = imin(add(i0, mr), iconst(spec.m))
    j_end = imin(add(j0, nb), iconst(spec.n))
    tile = ctx.name("acc")

    def slot(i: Expr, j: Expr) -> Expr:
        return add(mul(sub(i, i0), nb), sub(j, j0))

    def over_tile(body: Callable[[Expr, Expr], list[ir.Stmt]]) -> ir.Loop:
        """Rows and columns of the tile, as absolute (i, j) with the ranges of the whole output."""
        i, j = ctx.var("i", spec.m), ctx.var("j", spec.n)
        return ir.Loop(i, i0, i_end, [ir.Loop(j, j0, j_end, body(i, j), simd=True)])

    zero = over_tile(lambda i, j: [ir.ArrayStore(tile, slot(i, j), const(0, spec.dtype))])
    k = ctx.var("k", max(spec.k, 1))

    def accumulate(i: Expr, j: Expr) -> list[ir.Stmt]:
        a_value = spec.a(_batch_of(spec, b, spec.a_batch), i, k)
        b_value = b_operand(_batch_of(spec, b, spec.b_batch), k, j)
        current = array_load(tile, spec.dtype, slot(i, j))
        return [ir.ArrayStore(tile, slot(i, j),
                              binary("add", current, binary("mul", a_value, b_value)))]

    def epilogue(i: Expr, j: Expr) -> list[ir.Stmt]:
        total = array_load(tile, spec.dtype, slot(i, j))
        return ctx.results({0: (spec.out(b, i, j), spec.finish(total, b, i, j))})

    k_loop = ir.Loop(k, iconst(0), iconst(spec.k), [over_tile(accumulate)])
    tile_loop = ir.Loop(jb, iconst(0), iconst(col_blocks), [zero, k_loop, over_tile(epilogue)])
    body = [ir.DeclArray(tile, spec.dtype, mr * nb), tile_loop]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), ikj",
              [ir.Loop(p, iconst(0), iconst(bt * row_blocks), body, parallel=1)],
              bt * spec.m * spec.n * max(spec.k, 1))
    ctx.info.update(form="ikj", tile_m=mr, tile_n=nb)


def _dot(ctx: StageCtx, spec: Contraction) -> None:
    bt = math.prod(spec.batch)
    p = ctx.var("p", bt * spec.m)
    b, i = floordiv(p, spec.m), modulo(p, spec.m)
    j, k = ctx.var("j", spec.n), ctx.var("k", max(spec.k, 1))
    total = acc(ctx.name("sum"), spec.dtype)
    product = binary("mul", spec.a(_batch_of(spec, b, spec.a_batch), i, k),
                     spec.b(_batch_of(spec, b, spec.b_batch), k, j))
    k_loop = ir.Loop(k, iconst(0), iconst(spec.k), [ir.Assign(total, binary("add", total, product))],
                     simd=True, reductions=(("+", total),))
    body = [ir.DeclAcc(total, const(0, spec.dtype)), k_loop,
            *ctx.results({0: (spec.out(b, i, j), spec.finish(total, b, i, j))})]
    loop = ir.Loop(p, iconst(0), iconst(bt * spec.m), [ir.Loop(j, iconst(0), iconst(spec.n), body)],
                   parallel=1)
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), dot", [loop],
              bt * spec.m * spec.n * max(spec.k, 1))
    ctx.info.update(form="dot")


# --- the ops ---------------------------------------------------------------------------------------
def _identity_finish(total: Expr, b: Expr, i: Expr, j: Expr) -> Expr:
    return total


@stage("MatMul")
def _matmul(ctx: StageCtx) -> None:
    a_shape, b_shape = ctx.tensor(0).shape, ctx.tensor(1).shape
    a2 = (1, *a_shape) if len(a_shape) == 1 else a_shape
    b2 = (*b_shape, 1) if len(b_shape) == 1 else b_shape
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
    out_shape = ctx.out().shape

    def a_at(bi: Index, i: Expr, kk: Expr) -> Expr:
        return ctx.operand(0, Index(a2, dims=[*bi.dims, i, kk]).reshaped(a_shape))

    def b_at(bi: Index, kk: Expr, j: Expr) -> Expr:
        return ctx.operand(1, Index(b2, dims=[*bi.dims, kk, j]).reshaped(b_shape))

    def out(b: Expr, i: Expr, j: Expr) -> Index:
        return Index(out_shape, flat=add(mul(add(mul(b, m), i), n), j))

    contraction(ctx, Contraction(batch, m, n, k, a2[:-2], b2[:-2], a_at, b_at, out,
                                 _identity_finish, ctx.out().dtype))


@stage("Gemm")
def _gemm(ctx: StageCtx) -> None:
    a_shape, b_shape = ctx.tensor(0).shape, ctx.tensor(1).shape
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    m, k = (a_shape[1], a_shape[0]) if trans_a else a_shape
    n = b_shape[0] if trans_b else b_shape[1]
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    dtype = ctx.out().dtype

    def a_at(_: Index, i: Expr, kk: Expr) -> Expr:
        return ctx.operand(0, Index(a_shape, dims=[kk, i] if trans_a else [i, kk]))

    def b_at(_: Index, kk: Expr, j: Expr) -> Expr:
        return ctx.operand(1, Index(b_shape, dims=[j, kk] if trans_b else [kk, j]))

    def out(_: Expr, i: Expr, j: Expr) -> Index:
        return Index((m, n), dims=[i, j])

    def finish(total: Expr, _: Expr, i: Expr, j: Expr) -> Expr:
        result = total if alpha == 1 else binary("mul", const(alpha, dtype), total)
        if ctx.has(2) and beta != 0:
            c = ctx.operand(2, broadcast(Index((m, n), dims=[i, j]), ctx.tensor(2).shape))
            result = binary("add", result, c if beta == 1 else binary("mul", const(beta, dtype), c))
        return result

    contraction(ctx, Contraction((), m, n, k, (), (), a_at, b_at, out, finish, dtype))
