"""Contractions: the choice of loop nest for C[b, i, j] = Σ_k A[b, i, k] · B[b, k, j].

Every contraction lowers to one loop nest over C[b, i, j] = Σ_k A[b, i, k] · B[b, k, j]:

* `packed` (float contractions of at least `gemm_min_m` rows and `gemm_min_n` columns): a
  GotoBLAS-style GEMM. A constant operand (weights) is packed at compile time, A into panels
  of `mr` rows, B into panels of `nr` columns. A run-time A that is a plain row-major load is
  read in place by a row-reading micro-kernel (a batch of such A times one weight matrix is one
  product of batch × M rows); a run-time B that is a plain matrix is read in place when its rows
  are whole panels, else copied block by block by the GEMM's own tasks; an operand with a fused
  prologue (arithmetic, an implicit-GEMM convolution's im2col) is packed once per call by a
  parallel loop nest that evaluates the prologue once per element. Each parallel task owns a
  cache block of `mc` rows × `nc` columns and runs the register-blocked micro-kernel
  (`kiln.codegen.microkernel`) over its panels for each slice of `kc` along the sum (longer
  than the schedule's while the task's blocks fit in L2; the last partial panels by kernels of
  just their rows and columns; a tile of half the rows where A's rows would evict each other
  from L1); each finished micro-tile goes through the fused epilogue straight into the outputs
  while it is in L1 (whole tiles of a product with no epilogue are accumulated in the output by the
  micro-kernel itself). On GPU targets (`Schedule.gemm_work_group`)
  the same contractions run as the work-group tiled GEMM (`group`): tiles of A and B staged in
  a work-group's local memory, a register tile per work-item, the epilogue from registers.
* `ikj`: parallel over (batch, block of `matmul_tile_m` rows); for each column tile of
  `matmul_tile_n`, accumulators acc[rows][cols] on the stack; for k: for each row, A[i, k] is
  evaluated once (through the prologue) and the vectorised inner loop does
  acc[r][j] += a · B[k, j] over contiguous B. Then the epilogue runs on acc.
* `dot`: when B is contiguous along k instead (a transposed operand, Q·Kᵀ) and A is a plain load,
  each C element is a vectorised dot product.

A constant B (weights, also read through a remap: Gemm's transB, a transposed weight) is gathered
at compile time into panels of the `ikj` tile's columns, so that each tile streams its panel; any
other B must be a plain contiguous load for `ikj`, or is packed into scratch by a first loop nest
(a prologue with arithmetic is evaluated there once, not M times).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    acc,
    add,
    array_load,
    binary,
    const,
    floordiv,
    iconst,
    imin,
    load,
    modulo,
    mul,
    sub,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.gemm.packed import packed_applies, packed_gemm
from kiln.codegen.gemm.spec import (
    BOperand,
    Contraction,
    batch_of,
    constant_values,
    results,
    stride_of,
)


def contraction(ctx: StageCtx, spec: Contraction) -> None:
    bt = math.prod(spec.batch)
    if bt * spec.m * spec.n == 0:
        return
    if packed_applies(ctx, spec):
        packed_gemm(ctx, spec)
        return
    probe_b = var(ctx.name("pb"), max(math.prod(spec.b_batch), 1))
    probe_k, probe_j = var(ctx.name("pk"), max(spec.k, 1)), var(ctx.name("pj"), spec.n)
    b_probe = spec.b(Index(spec.b_batch, flat=probe_b), probe_k, probe_j)
    a_probe = spec.a(Index(spec.a_batch, flat=var(ctx.name("pa"), max(math.prod(spec.a_batch), 1))),
                     var(ctx.name("pi"), spec.m), probe_k)
    dot_ok = stride_of(b_probe, probe_k) == 1 and stride_of(a_probe, probe_k) == 1
    if spec.n < ctx.schedule.gemm_min_n and dot_ok:
        _dot(ctx, spec)  # few columns: vectorise along the sum instead
    elif (panels := _constant_panels(ctx, spec, b_probe, probe_b, probe_k, probe_j)) is not None:
        _ikj(ctx, spec, panels)
    elif stride_of(b_probe, probe_j) == 1:
        _ikj(ctx, spec, _whole_rows(spec.b))
    elif dot_ok:
        _dot(ctx, spec)
    else:
        _ikj(ctx, spec, _whole_rows(_pack_in_scratch(ctx, spec)))


# B as an ikj tile reads it: (B-batch index, k, j, the tile's column block) -> value
TileOperand = Callable[[Index, Expr, Expr, Expr], Expr]


def _whole_rows(operand: BOperand) -> TileOperand:
    return lambda bb, k, j, _cb: operand(bb, k, j)


def _constant_panels(ctx: StageCtx, spec: Contraction, probe: Expr, pb: Expr, pk: Expr,
                     pj: Expr) -> TileOperand | None:
    """A constant B gathered at compile time into panels of an ikj tile's columns, each panel's
    K rows one after the other (past N: zeros): a tile reads one contiguous stream of B instead
    of K short runs a row of B apart (a matrix-vector product reads nothing else)."""
    width = _tile(spec.n, ctx.schedule.matmul_tile_n)
    nb, panels = max(math.prod(spec.b_batch), 1), -(-spec.n // width)
    grid = np.meshgrid(np.arange(nb), np.arange(spec.k), np.arange(panels * width), indexing="ij")
    values = constant_values(ctx, probe, (pb, pk, pj),
                             [grid[0], grid[1], np.minimum(grid[2], spec.n - 1)])
    if values is None:
        return None
    values = np.where(grid[2] < spec.n, values, 0).astype(values.dtype)
    panelled = values.reshape(nb, spec.k, panels, width).transpose(0, 2, 1, 3)
    name = ctx.derived(np.ascontiguousarray(panelled))
    ctx.info["b_operand"] = "constant in column panels"
    return lambda bb, k, j, cb: load(name, spec.dtype, add(
        mul(add(mul(add(mul(bb.flat, panels), cb), spec.k), k), width), sub(j, mul(cb, width))))


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


def _ikj(ctx: StageCtx, spec: Contraction, b_operand: TileOperand) -> None:
    """Output tiles of `matmul_tile_m` rows × `matmul_tile_n` columns in parallel; per tile,
    accumulators on the stack and, for each k, a vectorised update of every row."""
    s = ctx.schedule
    mr = min(s.matmul_tile_m, spec.m)
    nb = _tile(spec.n, s.matmul_tile_n)
    row_blocks, col_blocks = -(-spec.m // mr), -(-spec.n // nb)
    bt = math.prod(spec.batch)
    tiles = bt * row_blocks * col_blocks
    p = ctx.var("p", tiles)
    b, rb, cb = Index((bt, row_blocks, col_blocks), flat=p).dims
    i0, j0 = mul(rb, mr), mul(cb, nb)
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
        a_value = spec.a(batch_of(spec, b, spec.a_batch), i, k)
        b_value = b_operand(batch_of(spec, b, spec.b_batch), k, j, cb)
        current = array_load(tile, spec.dtype, slot(i, j))
        return [ir.ArrayStore(tile, slot(i, j),
                              binary("add", current, binary("mul", a_value, b_value)))]

    def epilogue(i: Expr, j: Expr) -> list[ir.Stmt]:
        total = array_load(tile, spec.dtype, slot(i, j))
        return results(ctx, spec, total, b, i, j)

    k_loop = ir.Loop(k, iconst(0), iconst(spec.k), [over_tile(accumulate)])
    body = [ir.DeclArray(tile, spec.dtype, mr * nb), zero, k_loop, over_tile(epilogue)]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), ikj",
              [ir.Loop(p, iconst(0), iconst(tiles), body, parallel=1)],
              bt * spec.m * spec.n * max(spec.k, 1))
    ctx.info.update(form="ikj", tile_m=mr, tile_n=nb)


def _dot(ctx: StageCtx, spec: Contraction) -> None:
    bt = math.prod(spec.batch)
    p = ctx.var("p", bt * spec.m)
    b, i = floordiv(p, spec.m), modulo(p, spec.m)
    j, k = ctx.var("j", spec.n), ctx.var("k", max(spec.k, 1))
    total = acc(ctx.name("sum"), spec.dtype)
    product = binary("mul", spec.a(batch_of(spec, b, spec.a_batch), i, k),
                     spec.b(batch_of(spec, b, spec.b_batch), k, j))
    k_loop = ir.Loop(k, iconst(0), iconst(spec.k), [ir.Assign(total, binary("add", total, product))],
                     simd=True, reductions=(("+", total),))
    body = [ir.DeclAcc(total, const(0, spec.dtype)), k_loop,
            *results(ctx, spec, total, b, i, j)]
    loop = ir.Loop(p, iconst(0), iconst(bt * spec.m), [ir.Loop(j, iconst(0), iconst(spec.n), body)],
                   parallel=1)
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), dot", [loop],
              bt * spec.m * spec.n * max(spec.k, 1))
    ctx.info.update(form="dot")
