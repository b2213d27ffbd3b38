"""The packed GEMM (GotoBLAS): packed operands, cache blocks as parallel tasks, the backend's
register-blocked micro-kernel over the panels, and the fused epilogue per micro-tile from L1."""
from __future__ import annotations

import math


from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    add,
    const,
    floordiv,
    iconst,
    imin,
    index_compare,
    mul,
    sub,
)
from kiln.codegen.indexing import Index
from kiln.codegen.gemm.blocking import blocking
from kiln.codegen.microkernel import MicroKernel, tile_for
from kiln.codegen.gemm.packing import (
    OperandSide,
    Packed,
    b_rows,
    constant_panels,
    scratch_panels,
)
from kiln.codegen.gemm.group import group_gemm
from kiln.codegen.gemm.spec import Contraction, batch_of, tile_epilogue


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
    packed_a = (packed_a or constant_panels(ctx, spec, a, uk.mr)
                or scratch_panels(ctx, spec, a, uk.mr))
    packed_b = constant_panels(ctx, spec, b_side, uk.nr) or b_rows(ctx, spec, b_side, uk.nr)
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
    a_flat = batch_of(spec, b, spec.a_batch).flat if spec.a_batch else iconst(0)
    b_flat = batch_of(spec, b, spec.b_batch).flat if spec.b_batch else iconst(0)
    ip, jp = ctx.var("ip", blk.mc // uk.mr), ctx.var("jp", blk.nc // uk.nr)

    call = ir.MicroKernelCall(
        uk, kc, packed_a.buffer, packed_a.offset(a_flat, k0, add(i0, mul(ip, uk.mr))),
        packed_b.buffer, packed_b.offset(b_flat, k0, add(j0, mul(jp, uk.nr))), packed_b.ld,
        tile, add(mul(ip, uk.mr * blk.nc), mul(jp, uk.nr)), blk.nc,
        index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool"))
    # each micro-tile's results go through the epilogue right after its last update, from L1
    epilogue = tile_epilogue(ctx, spec, blk.nc, tile, b, (i0, add(i0, mul(ip, uk.mr)), uk.mr),
                             (j0, add(j0, mul(jp, uk.nr)), uk.nr))
    if k_blocks > 1:
        epilogue = ir.If(index_compare("eq", kb, k_blocks - 1), [epilogue])
    compute = ir.Loop(jp, iconst(0), col_panels,
                      [ir.Loop(ip, iconst(0), row_panels, [call, epilogue])])
    body = [ir.DeclArray(tile, spec.dtype, blk.mc * blk.nc),
            ir.Loop(kb, iconst(0), iconst(k_blocks), [compute])]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), packed GEMM",
              [ir.Loop(p, iconst(0), iconst(tasks), body, parallel=1,
                       grain="one" if s.gemm_omp_schedule == "dynamic" else "even")],
              bt * spec.m * spec.n * spec.k)
    ctx.info.update(form="packed", micro_kernel=f"{uk.mr}x{uk.nr}", vector_bytes=uk.vector_bytes,
                    mc=blk.mc, nc=blk.nc, kc=blk.kc, tasks=tasks)
