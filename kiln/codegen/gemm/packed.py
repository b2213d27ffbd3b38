"""The packed GEMM (GotoBLAS): packed operands, cache blocks as parallel tasks, the backend's
register-blocked micro-kernel over the panels, and the fused epilogue per micro-tile from L1."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    add,
    array_load,
    const,
    floordiv,
    iconst,
    imin,
    index_compare,
    load,
    logical_and,
    modulo,
    mul,
    sub,
    substitute,
)
from kiln.codegen.indexing import Index
from kiln.codegen.gemm.blocking import blocking
from kiln.codegen.microkernel import MicroKernel, tile_for
from kiln.codegen.gemm.packing import (
    OperandSide,
    Packed,
    a_rows_in_place,
    b_block_copy,
    b_copied_by_tasks,
    b_rows,
    constant_panels,
    scratch_panels,
)
from kiln.codegen.gemm.group import group_gemm
from kiln.codegen.gemm.spec import Contraction, batch_of, results, stride_of, tile_epilogue

# The most a task copies of B into a local array (a quarter of a 1 MiB L2, as intensive fusion's
# tiles): larger blocks of a run-time B are copied once by a stage of their own.
TASK_COPY_BYTES = 1 << 18


def micro_kernel(ctx: StageCtx, dtype: str) -> MicroKernel:
    s = ctx.schedule
    return tile_for((), dtype, s.vector_bytes, s.gemm_mr, s.gemm_nr)


def packed_applies(ctx: StageCtx, spec: Contraction) -> bool:
    s = ctx.schedule
    return (spec.dtype in ("float32", "float64") and spec.k > 0 and s.vector_bytes > 0
            and spec.m >= s.gemm_min_m and spec.n >= s.gemm_min_n)


def packed_gemm(ctx: StageCtx, spec: Contraction, packed_a: Packed | None = None) -> None:
    """`spec` as a packed GEMM, or on a GPU (work-groups in the schedule) as the work-group tiled
    one; `packed_a`: A already in constant panels of the micro-kernel's rows."""
    s = ctx.schedule
    uk = micro_kernel(ctx, spec.dtype)
    if s.gemm_work_group > 0:  # a GPU's: work-groups staging tiles in local memory
        group_gemm(ctx, spec, uk, packed_a)
        return
    a = OperandSide("a", spec.a, spec.a_batch, spec.m)
    b_side = OperandSide("b", lambda bi, j, k: spec.b(bi, k, j), spec.b_batch, spec.n)
    packed_a = (packed_a or constant_panels(ctx, spec, a, uk.mr) or a_rows_in_place(ctx, spec, a)
                or scratch_panels(ctx, spec, a, uk.mr))
    packed_b = constant_panels(ctx, spec, b_side, uk.nr)
    copied_by_tasks = packed_b is None and b_copied_by_tasks(ctx, spec, b_side, uk.nr)
    bt = math.prod(spec.batch)
    # one weight matrix for a batch of row-major A whose batches follow each other: one product
    # of batch × M rows (no partial panel per batch; ConvNeXt's 7 × 7 × 768 is 49 rows, not 7 × 7)
    folded = (bt > 1 and packed_a.in_place and spec.a_batch == spec.batch
              and math.prod(spec.b_batch) <= 1 and packed_a.batch_ld == spec.m * packed_a.ld)
    rows, batches = (bt * spec.m, 1) if folded else (spec.m, bt)
    blk = blocking(rows, spec.n, spec.k, batches, uk, s.gemm_mc, s.gemm_nc, s.gemm_kc)
    itemsize = 4 if spec.dtype == "float32" else 8
    copied_by_tasks = copied_by_tasks and blk.kc * blk.nc * itemsize <= TASK_COPY_BYTES
    packed_b = packed_b or (None if copied_by_tasks else b_rows(ctx, spec, b_side, uk.nr))
    row_blocks, col_blocks, k_blocks = (-(-rows // blk.mc), -(-spec.n // blk.nc),
                                        -(-spec.k // blk.kc))
    tasks = batches * row_blocks * col_blocks
    p = ctx.var("p", tasks)
    b, rb, cb = Index((batches, row_blocks, col_blocks), flat=p).dims
    i0, j0 = mul(rb, blk.mc), mul(cb, blk.nc)
    tile = ctx.name("ct")
    row_panels = imin(iconst(blk.mc // uk.mr), floordiv(sub(iconst(rows + uk.mr - 1), i0), uk.mr))
    col_panels = imin(iconst(blk.nc // uk.nr), floordiv(sub(iconst(spec.n + uk.nr - 1), j0), uk.nr))

    def row_of(g: Expr) -> tuple[Expr, Expr]:
        """(batch, row of the batch) of row `g` of the product."""
        return (floordiv(g, spec.m), modulo(g, spec.m)) if folded else (b, g)

    kb = ctx.var("kb", k_blocks)
    k0 = mul(kb, blk.kc)
    kc = iconst(blk.kc) if spec.k % blk.kc == 0 else imin(iconst(blk.kc), sub(iconst(spec.k), k0))
    a_flat = batch_of(spec, b, spec.a_batch).flat if spec.a_batch and not folded else iconst(0)
    b_flat = batch_of(spec, b, spec.b_batch).flat if spec.b_batch and not folded else iconst(0)
    ip, jp = ctx.var("ip", blk.mc // uk.mr), ctx.var("jp", blk.nc // uk.nr)

    a_start = add(i0, mul(ip, uk.mr))
    b_copy: list[ir.Stmt] = []
    if copied_by_tasks:  # the task's block of B, copied for each slice of the sum
        copy = ctx.name("bc")
        b_copy = b_block_copy(ctx, spec, copy, blk.nc, batch_of(spec, b, spec.b_batch), (k0, kc),
                              j0)
        packed_b = Packed(copy, lambda _b, _k0, j: sub(j, j0), blk.nc)
        ctx.info["b_operand"] = "copied by the tasks"
    b_offset = packed_b.offset(b_flat, k0, add(j0, mul(jp, uk.nr)))
    c_offset = add(mul(ip, uk.mr * blk.nc), mul(jp, uk.nr))
    accumulate = index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool")

    def update(kernel: MicroKernel, a_buffer: str, a_offset: Expr) -> ir.MicroKernelCall:
        return ir.MicroKernelCall(kernel, kc, a_buffer, a_offset, packed_b.buffer, b_offset,
                                  packed_b.ld, tile, c_offset, blk.nc, accumulate)

    edge_decl: list[ir.Stmt] = []
    edge_pack: list[ir.Stmt] = []
    if packed_a.in_place:
        a_whole = (replace(uk, lda=packed_a.ld), packed_a.buffer,
                   packed_a.offset(a_flat, k0, a_start))
        call = update(*a_whole)
        full_rows = rows // uk.mr * uk.mr
        if full_rows < rows:  # the last, partial panel: its rows copied into a local panel
            edge = ctx.name("ae")
            edge_decl = [ir.DeclArray(edge, spec.dtype, uk.mr * blk.kc)]
            edge_pack = [ir.If(index_compare("eq", rb, row_blocks - 1),
                               _edge_panel(ctx, spec, edge, uk, (full_rows, rows), row_of, k0, kc))]
            call = ir.If(index_compare("lt", a_start, full_rows), [call],
                         [update(uk, edge, iconst(0))])
    else:
        a_whole = (uk, packed_a.buffer, packed_a.offset(a_flat, k0, a_start))
        call = update(*a_whole)
    # each micro-tile's results go through the epilogue right after its last update, from L1
    j_start = add(j0, mul(jp, uk.nr))
    if folded:
        epilogue = _folded_epilogue(ctx, spec, blk.nc, tile, (i0, a_start, uk.mr, rows),
                                    (j0, j_start, uk.nr), row_of)
    else:
        epilogue = tile_epilogue(ctx, spec, blk.nc, tile, b, (i0, a_start, uk.mr),
                                 (j0, j_start, uk.nr))
    if k_blocks > 1:
        epilogue = ir.If(index_compare("eq", kb, k_blocks - 1), [epilogue])
    tile_update: list[ir.Stmt] = [call, epilogue]
    output = _output_rows(ctx, spec, None if folded else b)
    if output is not None:  # whole micro-tiles update the output itself: no copy through L1
        buffer, at, ldc = output
        kernel, a_buffer, a_offset = a_whole
        whole = logical_and(index_compare("le", add(a_start, uk.mr), rows),
                            index_compare("le", add(j_start, uk.nr), spec.n))
        direct = ir.MicroKernelCall(kernel, kc, a_buffer, a_offset, packed_b.buffer, b_offset,
                                    packed_b.ld, buffer, at(a_start, j_start), ldc, accumulate)
        tile_update = [ir.If(whole, [direct], tile_update)]
        ctx.info["whole_tiles"] = "stored by the micro-kernel"
    compute = ir.Loop(jp, iconst(0), col_panels, [ir.Loop(ip, iconst(0), row_panels, tile_update)])
    copy_decl = [ir.DeclArray(packed_b.buffer, spec.dtype, blk.kc * blk.nc)] if b_copy else []
    body = [ir.DeclArray(tile, spec.dtype, blk.mc * blk.nc), *edge_decl, *copy_decl,
            ir.Loop(kb, iconst(0), iconst(k_blocks), [*edge_pack, *b_copy, compute])]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), packed GEMM",
              [ir.Loop(p, iconst(0), iconst(tasks), body, parallel=1,
                       grain="one" if s.gemm_omp_schedule == "dynamic" else "even")],
              bt * spec.m * spec.n * spec.k)
    ctx.info.update(form="packed", micro_kernel=f"{uk.mr}x{uk.nr}", vector_bytes=uk.vector_bytes,
                    mc=blk.mc, nc=blk.nc, kc=blk.kc, tasks=tasks, product_rows=rows)


def _edge_panel(ctx: StageCtx, spec: Contraction, edge: str, uk: MicroKernel,
                extent: tuple[int, int], row_of: Callable[[Expr], tuple[Expr, Expr]], k0: Expr,
                kc: Expr) -> list[ir.Stmt]:
    """edge[k·mr + r] = A[first + r, k0 + k] for the `kc` sums of the block, `extent` = (first,
    rows); the rows past the product's repeat its last one (their results are never stored)."""
    first, rows = extent
    r, k = ctx.var("r", uk.mr), ctx.var("k", spec.k)
    batch, row = row_of(imin(add(iconst(first), r), iconst(rows - 1)))
    value = spec.a(batch_of(spec, batch, spec.a_batch), row, add(k0, k))
    return [ir.Loop(r, iconst(0), iconst(uk.mr), [
        ir.Loop(k, iconst(0), kc, [ir.ArrayStore(edge, add(mul(k, uk.mr), r), value)], simd=True)])]


def _folded_epilogue(ctx: StageCtx, spec: Contraction, ldc: int, tile: str,
                     rows: tuple[Expr, Expr, int, int], cols: tuple[Expr, Expr, int],
                     row_of: Callable[[Expr], tuple[Expr, Expr]]) -> ir.Loop:
    """`tile_epilogue` for a product whose rows run across the batch: (block start, tile start,
    tile rows, product rows); each row's batch and row within it found once per row."""
    (i0, i_lo, mr, total_rows), (j0, j_lo, nr) = rows, cols
    g, j = ctx.var("g", total_rows), ctx.var("j", spec.n)
    batch, i = row_of(g)
    total = array_load(tile, spec.dtype, add(mul(sub(g, i0), ldc), sub(j, j0)))
    stmts = results(ctx, spec, total, batch, i, j)
    return ir.Loop(g, i_lo, imin(add(i_lo, mr), iconst(total_rows)), [
        ir.Loop(j, j_lo, imin(add(j_lo, nr), iconst(spec.n)), stmts, simd=True)])


def _output_rows(ctx: StageCtx, spec: Contraction,
                 b: Expr | None) -> tuple[str, Callable[[Expr, Expr], Expr], int] | None:
    """Where a micro-kernel can leave whole tiles itself: when the epilogue only stores each sum,
    unchanged, into one output whose rows are contiguous, (buffer, offset of (row, column) in
    batch `b`, row stride); b None: rows run across the batch (a folded product), so one batch's
    rows must follow the previous one's. None when anything else happens to the results (bias,
    activation, another layout)."""
    batch = ctx.var("pb", math.prod(spec.batch)) if b is None else b
    i, j = ctx.var("i", spec.m), ctx.var("j", spec.n)
    total = array_load(ctx.name("sum"), spec.dtype, iconst(0))
    stmts = results(ctx, spec, total, batch, i, j)
    if (len(stmts) != 2 or not isinstance(stmts[0], ir.Let) or stmts[0].value is not total
            or not isinstance(stmts[1], ir.Store) or stmts[1].value is not stmts[0].local):
        return None
    store = stmts[1]
    probe = load(store.buffer, spec.dtype, store.offset)
    row = stride_of(probe, i) if spec.m > 1 else spec.n
    if stride_of(probe, j) != 1 or row is None or row < spec.n:
        return None
    if b is None and stride_of(probe, batch) != spec.m * row:
        return None
    fixed = {batch: iconst(0)} if b is None else {}
    return store.buffer, lambda x, y: substitute(store.offset, {**fixed, i: x, j: y}), row
