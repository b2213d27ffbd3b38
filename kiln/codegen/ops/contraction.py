"""Contractions: MatMul (batched, broadcast batch dims), Gemm, and Einsum in matrix form.

All of them lower to one loop nest over C[b, i, j] = Σ_k A[b, i, k] · B[b, k, j]:

* `packed` (float contractions of at least `gemm_min_m` rows and `gemm_min_n` columns): a
  GotoBLAS-style GEMM. A is packed into panels of `mr` rows and B into panels of `nr` columns —
  at compile time when constant (weights are pre-packed), else once per call by a parallel loop
  nest that evaluates the operand's fused prologue once per element (an implicit-GEMM
  convolution's im2col happens there). Each parallel task owns a cache block of `mc` rows ×
  `nc` columns and runs the register-blocked micro-kernel (`kiln.codegen.microkernel`) over its
  panels for each slice of `kc` along the sum; each finished micro-tile goes through the fused
  epilogue straight into the outputs while it is in L1.
* `ikj`: parallel over (batch, block of `matmul_tile_m` rows); for each column tile of
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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.microkernel import MicroKernel, tile_for
from kiln.codegen.expr import (
    Expr,
    NotEvaluable,
    acc,
    add,
    array_load,
    binary,
    const,
    evaluate_index,
    floordiv,
    iconst,
    imin,
    index_compare,
    load,
    modulo,
    mul,
    select,
    sub,
    substitute,
    var,
)
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage

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


def _results(ctx: StageCtx, spec: Contraction, total: Expr, b: Expr, i: Expr,
             j: Expr) -> list[ir.Stmt]:
    value = spec.finish(total, b, i, j)
    if spec.store is not None:
        return spec.store(b, i, j, value)
    return ctx.results({0: (spec.out(b, i, j), value)})


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
    if _packed_applies(ctx, spec):
        _packed(ctx, spec)
        return
    probe_b = var(ctx.name("pb"), max(math.prod(spec.b_batch), 1))
    probe_k, probe_j = var(ctx.name("pk"), max(spec.k, 1)), var(ctx.name("pj"), spec.n)
    b_probe = spec.b(Index(spec.b_batch, flat=probe_b), probe_k, probe_j)
    a_probe = spec.a(Index(spec.a_batch, flat=var(ctx.name("pa"), max(math.prod(spec.a_batch), 1))),
                     var(ctx.name("pi"), spec.m), probe_k)
    dot_ok = stride_of(b_probe, probe_k) == 1 and stride_of(a_probe, probe_k) == 1
    if spec.n < ctx.schedule.gemm_min_n and dot_ok:
        _dot(ctx, spec)  # few columns: vectorise along the sum instead
    elif stride_of(b_probe, probe_j) == 1:
        _ikj(ctx, spec, spec.b)
    elif (packed := _constant_packed(ctx, spec, b_probe, probe_b, probe_k, probe_j)) is not None:
        _ikj(ctx, spec, packed)
    elif dot_ok:
        _dot(ctx, spec)
    else:
        _ikj(ctx, spec, _pack_in_scratch(ctx, spec))


# --- packed GEMM ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packed:
    """Where the micro-kernel finds an operand: `buffer + offset(batch, k0, x0)` is the panel of
    rows (A) or columns (B) from x0 at sum index k0, its rows `ld` elements apart."""

    buffer: str
    offset: Callable[[Expr, Expr, Expr], Expr]
    ld: int


def _panels(buffer: str, panels: int, k: int, unit: int) -> Packed:
    """Panel layout: element (b, x, k) at ((b·panels + x // unit)·K + k)·unit + x % unit."""
    return Packed(buffer, lambda b, k0, x0: mul(add(mul(add(mul(b, panels), floordiv(x0, unit)), k),
                                                    k0), unit), unit)


@dataclass(frozen=True)
class Blocking:
    mc: int
    nc: int
    kc: int


def _micro_kernel(ctx: StageCtx, dtype: str) -> MicroKernel:
    s = ctx.schedule
    return tile_for((), dtype, s.vector_bytes, s.gemm_mr, s.gemm_nr)


def _packed_applies(ctx: StageCtx, spec: Contraction) -> bool:
    s = ctx.schedule
    return (spec.dtype in ("float32", "float64") and spec.k > 0 and s.vector_bytes > 0
            and spec.m >= s.gemm_min_m and spec.n >= s.gemm_min_n)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def blocking(m: int, n: int, k: int, batch: int, uk: MicroKernel, mc: int, nc: int,
             kc: int, min_tasks: int = 8) -> Blocking:
    """Cache blocks of whole micro-tiles, split evenly (no thin leftover block), and enough
    parallel tasks (blocks × batch) to keep `min_tasks` threads' worth of work queued. Each
    block along N reads all of A and each block along M all of B, so every halving goes to the
    axis that adds the fewer re-read elements: N for a transformer's activations times its
    weights, M for a late convolution's weights (megabytes) times a 7×7 image."""
    def even(total: int, limit: int, unit: int) -> int:
        parts = -(-total // max(limit, unit))
        return _round_up(-(-total // parts), unit)

    def halved(size: int, unit: int) -> int:
        return _round_up(size // 2, unit)

    kc = -(-k // -(-k // max(kc, 1)))
    mc, nc = even(m, mc, uk.mr), even(n, nc, uk.nr)
    while batch * -(-m // mc) * -(-n // nc) < min_tasks and (mc > uk.mr or nc > uk.nr):
        more_rows = -(-m // halved(mc, uk.mr)) - -(-m // mc) if mc > uk.mr else math.inf
        more_cols = -(-n // halved(nc, uk.nr)) - -(-n // nc) if nc > uk.nr else math.inf
        if more_rows * n < more_cols * m:  # extra row blocks re-read B (k × n), columns A (m × k)
            mc = halved(mc, uk.mr)
        else:
            nc = halved(nc, uk.nr)
    return Blocking(mc, nc, kc)


Operand = Callable[[Index, Expr, Expr], Expr]  # (batch index, row of A / column of B, k) -> value


@dataclass(frozen=True)
class OperandSide:
    """One operand of the product as the packer sees it: its value at (batch index, row of A or
    column of B, k), its batch shape, and its extent along the panel axis (M or N)."""

    name: str
    value: Operand
    batch: tuple[int, ...]
    extent: int

    def probes(self, ctx: StageCtx, k: int) -> tuple[Expr, Expr, Expr, Expr]:
        """(probe value, batch var, panel-axis var, k var)."""
        pb = ctx.var("pb", max(math.prod(self.batch), 1))
        px, pk = ctx.var("px", max(self.extent, 1)), ctx.var("pk", k)
        return self.value(Index(self.batch, flat=pb), px, pk), pb, px, pk


def _constant_panels(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> Packed | None:
    """A constant operand (weights) packed at compile time in panels of `unit` rows of A
    (columns of B), past the extent zero; None if the operand is not a constant."""
    nb, panels = max(math.prod(side.batch), 1), -(-side.extent // unit)
    probe, *probes = side.probes(ctx, spec.k)
    grid = np.meshgrid(np.arange(nb), np.arange(panels * unit), np.arange(spec.k), indexing="ij")
    clamped = [grid[0], np.minimum(grid[1], side.extent - 1), grid[2]]
    values = constant_values(ctx, probe, tuple(probes), clamped)
    if values is None:
        return None
    values = np.where(grid[1] < side.extent, values, 0).astype(values.dtype)
    panelled = values.reshape(nb, panels, unit, spec.k).transpose(0, 1, 3, 2)
    ctx.info[f"{side.name}_operand"] = "pre-packed constant"
    return _panels(ctx.derived(np.ascontiguousarray(panelled)), panels, spec.k, unit)


def _scratch_panels(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> Packed:
    """The operand packed in panels (the layout of `_panels`, past the extent zero) once per call
    by a parallel loop nest, which evaluates the operand's fused prologue once per element."""
    nb, panels = max(math.prod(side.batch), 1), -(-side.extent // unit)
    probe, _, px, _ = side.probes(ctx, spec.k)
    total = nb * panels
    name = ctx.scratch(spec.dtype, total * spec.k * unit)
    q, r, k = ctx.var("q", total), ctx.var("r", unit), ctx.var("k", spec.k)
    bb, panel = Index((nb, panels), flat=q).dims
    x = add(mul(panel, unit), r)
    element = side.value(Index(side.batch, flat=bb), imin(x, iconst(side.extent - 1)), k)
    if side.extent % unit:
        element = select(index_compare("lt", x, side.extent), element, const(0, spec.dtype))
    store = ir.Store(name, add(mul(add(mul(q, spec.k), k), unit), r), element)
    if stride_of(probe, px) == 1:  # contiguous along the panel axis: read along it
        nest = ir.Loop(k, iconst(0), iconst(spec.k), [ir.Loop(r, iconst(0), iconst(unit), [store],
                                                               simd=True)])
    else:
        nest = ir.Loop(r, iconst(0), iconst(unit), [ir.Loop(k, iconst(0), iconst(spec.k), [store],
                                                            simd=True)])
    ctx.stage(f"pack operand {side.name.upper()} of {ctx.op.id} in panels",
              [ir.Loop(q, iconst(0), iconst(total), [nest], parallel=1)], total * spec.k * unit)
    ctx.info[f"{side.name}_operand"] = "packed in scratch"
    return _panels(name, panels, spec.k, unit)


def _b_rows(ctx: StageCtx, spec: Contraction, side: OperandSide, nr: int) -> Packed:
    """B computed at run time, read by the micro-kernel as row-major rows of `ld` elements: in
    place when it is a plain row-major load whose rows are whole panels, else copied once into
    scratch rows padded to whole panels, by a loop nest along B's rows (an implicit-GEMM
    convolution's im2col: contiguous along output pixels, its loops split by output row)."""
    probe, pb, pj, pk = side.probes(ctx, spec.k)
    nb = max(math.prod(spec.b_batch), 1)
    row = stride_of(probe, pk)
    if stride_of(probe, pj) == 1 and row is not None and row >= spec.n and spec.n % nr == 0:
        offset = probe.args[0]
        ctx.info["b_operand"] = "read in place"
        return Packed(probe.name, lambda b, k0, j0: substitute(offset, {pb: b, pk: k0, pj: j0}), row)
    ld = _round_up(spec.n, nr)
    name = ctx.scratch(spec.dtype, nb * spec.k * ld)
    q, j = ctx.var("q", nb * spec.k), ctx.var("j", spec.n)
    bb, k = Index((nb, spec.k), flat=q).dims
    rows = [ir.Loop(j, iconst(0), iconst(spec.n), [
        ir.Store(name, add(mul(q, ld), j), spec.b(Index(spec.b_batch, flat=bb), k, j))], simd=True)]
    if ld > spec.n:  # the last panel's columns past N: zeros
        pad = ctx.var("j", ld - spec.n, spec.n)
        rows.append(ir.Loop(pad, iconst(spec.n), iconst(ld),
                            [ir.Store(name, add(mul(q, ld), pad), const(0, spec.dtype))]))
    ctx.stage(f"pack operand B of {ctx.op.id} in rows",
              [ir.Loop(q, iconst(0), iconst(nb * spec.k), rows, parallel=1)], nb * spec.k * ld)
    ctx.info["b_operand"] = "packed in scratch rows"
    return Packed(name, lambda b, k0, j0: add(mul(add(mul(b, spec.k), k0), ld), j0), ld)


def _packed(ctx: StageCtx, spec: Contraction) -> None:
    s = ctx.schedule
    uk = _micro_kernel(ctx, spec.dtype)
    a = OperandSide("a", spec.a, spec.a_batch, spec.m)
    b_side = OperandSide("b", lambda bi, j, k: spec.b(bi, k, j), spec.b_batch, spec.n)
    packed_a = _constant_panels(ctx, spec, a, uk.mr) or _scratch_panels(ctx, spec, a, uk.mr)
    packed_b = _constant_panels(ctx, spec, b_side, uk.nr) or _b_rows(ctx, spec, b_side, uk.nr)
    bt = math.prod(spec.batch)
    blk = blocking(spec.m, spec.n, spec.k, bt, uk, s.gemm_mc, s.gemm_nc, s.gemm_kc)
    row_blocks, col_blocks, k_blocks = (-(-spec.m // blk.mc), -(-spec.n // blk.nc),
                                        -(-spec.k // blk.kc))
    tasks = bt * row_blocks * col_blocks
    p = ctx.var("p", tasks)
    b, rb, cb = Index((bt, row_blocks, col_blocks), flat=p).dims
    i0, j0 = mul(rb, blk.mc), mul(cb, blk.nc)
    tile = ctx.name("ct")
    row_panels = imin(iconst(blk.mc // uk.mr), floordiv(sub(iconst(spec.m + uk.mr - 1), i0), uk.mr))
    col_panels = imin(iconst(blk.nc // uk.nr), floordiv(sub(iconst(spec.n + uk.nr - 1), j0), uk.nr))

    kb = ctx.var("kb", k_blocks)
    k0 = mul(kb, blk.kc)
    kc = iconst(blk.kc) if spec.k % blk.kc == 0 else imin(iconst(blk.kc), sub(iconst(spec.k), k0))
    a_flat = _batch_of(spec, b, spec.a_batch).flat if spec.a_batch else iconst(0)
    b_flat = _batch_of(spec, b, spec.b_batch).flat if spec.b_batch else iconst(0)
    ip, jp = ctx.var("ip", blk.mc // uk.mr), ctx.var("jp", blk.nc // uk.nr)

    call = ir.MicroKernelCall(
        uk, kc, packed_a.buffer, packed_a.offset(a_flat, k0, add(i0, mul(ip, uk.mr))),
        packed_b.buffer, packed_b.offset(b_flat, k0, add(j0, mul(jp, uk.nr))), packed_b.ld,
        tile, add(mul(ip, uk.mr * blk.nc), mul(jp, uk.nr)), blk.nc,
        index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool"))
    # each micro-tile's results go through the epilogue right after its last update, from L1
    epilogue = _packed_epilogue(ctx, spec, blk, tile, b, (i0, add(i0, mul(ip, uk.mr)), uk.mr),
                                (j0, add(j0, mul(jp, uk.nr)), uk.nr))
    if k_blocks > 1:
        epilogue = ir.If(index_compare("eq", kb, k_blocks - 1), [epilogue])
    compute = ir.Loop(jp, iconst(0), col_panels,
                      [ir.Loop(ip, iconst(0), row_panels, [call, epilogue])])
    body = [ir.DeclArray(tile, spec.dtype, blk.mc * blk.nc),
            ir.Loop(kb, iconst(0), iconst(k_blocks), [compute])]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), packed GEMM",
              [ir.Loop(p, iconst(0), iconst(tasks), body, parallel=1,
                       omp_schedule=s.gemm_omp_schedule)],
              bt * spec.m * spec.n * spec.k)
    ctx.info.update(form="packed", micro_kernel=f"{uk.mr}x{uk.nr}", vector_bytes=uk.vector_bytes,
                    mc=blk.mc, nc=blk.nc, kc=blk.kc, tasks=tasks)


def _packed_epilogue(ctx: StageCtx, spec: Contraction, blk: Blocking, tile: str, b: Expr,
                     rows: tuple[Expr, Expr, int], cols: tuple[Expr, Expr, int]) -> ir.Loop:
    """Results of the tile (rows, cols) = (block start, tile start, tile size) through the fused
    epilogue, the inner loop along the output's contiguous axis."""
    (i0, i_lo, mr), (j0, j_lo, nr) = rows, cols
    i, j = ctx.var("i", spec.m), ctx.var("j", spec.n)
    total = array_load(tile, spec.dtype, add(mul(sub(i, i0), blk.nc), sub(j, j0)))
    stmts = _results(ctx, spec, total, b, i, j)
    i_end = imin(add(i_lo, mr), iconst(spec.m))
    j_end = imin(add(j_lo, nr), iconst(spec.n))
    offset = spec.out(b, i, j).flat
    rows_inner = (spec.store is None and spec.m > 1
                  and stride_of(load("probe", spec.dtype, offset), i) == 1)
    if rows_inner:
        return ir.Loop(j, j_lo, j_end, [ir.Loop(i, i_lo, i_end, stmts, simd=True)])
    return ir.Loop(i, i_lo, i_end, [ir.Loop(j, j_lo, j_end, stmts, simd=True)])


def _batch_of(spec: Contraction, b: Expr, shape: tuple[int, ...]) -> Index:
    return broadcast(Index(spec.batch, flat=b), shape)


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


def _constant_packed(ctx: StageCtx, spec: Contraction, probe: Expr, pb: Expr, pk: Expr,
                     pj: Expr) -> BOperand | None:
    """A constant B read through an index remap: gather it once at compile time."""
    nb = max(math.prod(spec.b_batch), 1)
    grid = np.meshgrid(np.arange(nb), np.arange(spec.k), np.arange(spec.n), indexing="ij")
    packed = constant_values(ctx, probe, (pb, pk, pj), grid)
    if packed is None:
        return None
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
        a_value = spec.a(_batch_of(spec, b, spec.a_batch), i, k)
        b_value = b_operand(_batch_of(spec, b, spec.b_batch), k, j)
        current = array_load(tile, spec.dtype, slot(i, j))
        return [ir.ArrayStore(tile, slot(i, j),
                              binary("add", current, binary("mul", a_value, b_value)))]

    def epilogue(i: Expr, j: Expr) -> list[ir.Stmt]:
        total = array_load(tile, spec.dtype, slot(i, j))
        return _results(ctx, spec, total, b, i, j)

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
    product = binary("mul", spec.a(_batch_of(spec, b, spec.a_batch), i, k),
                     spec.b(_batch_of(spec, b, spec.b_batch), k, j))
    k_loop = ir.Loop(k, iconst(0), iconst(spec.k), [ir.Assign(total, binary("add", total, product))],
                     simd=True, reductions=(("+", total),))
    body = [ir.DeclAcc(total, const(0, spec.dtype)), k_loop,
            *_results(ctx, spec, total, b, i, j)]
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


# --- Einsum ------------------------------------------------------------------------------------------
def einsum_terms(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Operand and output subscripts with `...` replaced by private letters (one per broadcast
    dim, right-aligned across operands); the implicit output is every letter used once, sorted."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    widths = [len(s) - (len(t) - 3) if "..." in t else 0 for t, s in zip(terms, shapes)]
    width = max(widths, default=0)
    hidden = [chr(0x100 + i) for i in range(width)]
    expanded = [t.replace("...", "".join(hidden[width - w:])) for t, w in zip(terms, widths)]
    if arrow:
        output = rhs.replace("...", "".join(hidden))
    else:
        counts = {ch: sum(t.count(ch) for t in expanded) for t in expanded for ch in t}
        named = sorted(ch for ch, n in counts.items() if n == 1 and ch not in hidden)
        output = "".join(hidden) + "".join(named)
    return expanded, output


def _einsum_check(op, graph) -> str | None:
    shapes = [graph.tensors[t].shape for t in op.present_inputs()]
    try:
        terms, _ = einsum_terms(op.attrs["equation"], shapes)
    except (KeyError, ValueError):
        return "unreadable equation"
    if any(len(t) != len(s) for t, s in zip(terms, shapes)):
        return "equation does not match the operand ranks"
    return None


def _letter_sizes(terms: list[str], shapes: list[tuple[int, ...]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for letter, n in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    return sizes


def _operand_index(term: str, shape: tuple[int, ...], values: dict[str, Expr]) -> Index:
    return Index(shape, dims=[values[ch] if n > 1 else iconst(0) for ch, n in zip(term, shape)])


@stage("Einsum", check=_einsum_check)
def _einsum(ctx: StageCtx) -> None:
    operands = list(range(len(ctx.op.inputs)))
    shapes = [ctx.tensor(i).shape for i in operands]
    terms, output = einsum_terms(ctx.attr("equation"), shapes)
    sizes = _letter_sizes(terms, shapes)
    if len(terms) == 2 and _matrix_form(ctx, terms, output, shapes, sizes):
        return
    _generic_einsum(ctx, terms, output, shapes, sizes)


def _matrix_form(ctx: StageCtx, terms: list[str], output: str, shapes, sizes) -> bool:
    a, b = terms
    if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(output)) != len(output):
        return False
    if any(n != sizes[ch] for t, s in zip(terms, shapes) for ch, n in zip(t, s)):
        return False  # broadcast size-1 dims: the generic nest handles them
    if any(ch not in output and ch not in (b if ch in a else a) for ch in a + b):
        return False  # a letter summed within one operand
    batch = [ch for ch in output if ch in a and ch in b]
    m_letters = [ch for ch in a if ch in output and ch not in b]
    n_letters = [ch for ch in b if ch in output and ch not in a]
    k_letters = [ch for ch in a if ch in b and ch not in output]
    batch_shape = tuple(sizes[ch] for ch in batch)
    m_shape, n_shape = tuple(sizes[ch] for ch in m_letters), tuple(sizes[ch] for ch in n_letters)
    k_shape = tuple(sizes[ch] for ch in k_letters)
    out_shape = ctx.out().shape

    def letters(bi: Index, names, flat: Expr, shape) -> dict[str, Expr]:
        values = dict(zip(batch, bi.dims))
        values.update(zip(names, Index(shape, flat=flat).dims))
        return values

    def a_at(bi: Index, i: Expr, k: Expr) -> Expr:
        values = letters(bi, m_letters, i, m_shape)
        values.update(zip(k_letters, Index(k_shape, flat=k).dims))
        return ctx.operand(0, _operand_index(a, shapes[0], values))

    def b_at(bi: Index, k: Expr, j: Expr) -> Expr:
        values = letters(bi, n_letters, j, n_shape)
        values.update(zip(k_letters, Index(k_shape, flat=k).dims))
        return ctx.operand(1, _operand_index(b, shapes[1], values))

    def out(bf: Expr, i: Expr, j: Expr) -> Index:
        values = letters(Index(batch_shape, flat=bf), m_letters, i, m_shape)
        values.update(zip(n_letters, Index(n_shape, flat=j).dims))
        return _operand_index(output, out_shape, values)

    contraction(ctx, Contraction(batch_shape, math.prod(m_shape), math.prod(n_shape),
                                 math.prod(k_shape), batch_shape, batch_shape, a_at, b_at, out,
                                 _identity_finish, ctx.out().dtype))
    return True


def _generic_einsum(ctx: StageCtx, terms: list[str], output: str, shapes, sizes) -> None:
    out = ctx.out()
    if out.numel == 0:
        return
    summed = [ch for ch in dict.fromkeys("".join(terms)) if ch not in output]
    p = ctx.var("p", out.numel)
    values = dict(zip(output, Index(out.shape, flat=p).dims))
    loops = [(ch, ctx.var("s", sizes[ch])) for ch in summed]
    values.update(loops)
    product = None
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        v = ctx.operand(i, _operand_index(term, shape, values))
        product = v if product is None else binary("mul", product, v)
    total = acc(ctx.name("sum"), out.dtype)
    body: list[ir.Stmt] = [ir.Assign(total, binary("add", total, product))]
    for position, (ch, v) in enumerate(reversed(loops)):
        inner = position == 0
        body = [ir.Loop(v, iconst(0), iconst(sizes[ch]), body, simd=inner,
                        reductions=(("+", total),) if inner else ())]
    stmts = [ir.DeclAcc(total, const(0, out.dtype)), *body,
             *ctx.results({0: (Index(out.shape, flat=p), total)})]
    work = out.numel * math.prod(sizes[ch] for ch in summed)
    ctx.stage(f"einsum ({ctx.op.id})", [ir.Loop(p, iconst(0), iconst(out.numel), stmts,
                                                parallel=1)], work)
