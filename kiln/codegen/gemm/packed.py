"""The packed GEMM (GotoBLAS): packed operands, cache blocks as parallel tasks, the backend's
register-blocked micro-kernel over the panels, and the fused epilogue per cache block."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

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
    select,
    sub,
    substitute,
)
from kiln.codegen.indexing import Index
from kiln.codegen.gemm.blocking import Blocking, blocking, round_up
from kiln.codegen.microkernel import (
    MicroKernel,
    TileEpilogue,
    fewer_rows,
    rows_evict_each_other,
    padding_tiles,
    tile_for,
)
from kiln.codegen.gemm.packing import (
    OperandSide,
    Packed,
    a_rows_in_place,
    b_block_copy,
    b_copied_by_tasks,
    b_rows,
    constant_panels,
    rows_across_batch,
    rows_contiguous_along_the_sum,
    scratch_panels,
    scratch_rows,
)
from kiln.codegen.gemm.group import group_gemm
from kiln.codegen.gemm.register_epilogue import register_epilogue
from kiln.codegen.gemm.spec import Contraction, batch_of, results, stride_of, tile_epilogue
from kiln.codegen.schedule import Schedule

# The most a task copies of B into a local array (a quarter of a 1 MiB L2, as intensive fusion's
# tiles): larger blocks of a run-time B are copied once by a stage of their own.
TASK_COPY_BYTES = 1 << 18


def micro_kernel(ctx: StageCtx, dtype: str) -> MicroKernel:
    s = ctx.schedule
    return tile_for((), dtype, s.vector_bytes, s.gemm_mr, s.gemm_nr)


# The share of a product's work another tile must save over the schedule's to replace it: on Zen 3
# a 4 × 24 tile ran 2–4% longer per FMA than a 6 × 16 one (ResNet-50 took 1.04× as long with 4 × 24
# tiles for its 64, 128, … output channels, 66, 132, … rows in 6 × 16 tiles).
TILE_SAVING = 1 / 16
# (On Zen 4 7 × 48 tiles took ResNet-50's 1 × 1 convs onto 14 × 14, 196 rows, 1.03× the time
# of 12 × 32 ones, 204 rows: 4 % less padding did not pay for a slower tile.)


def least_padding_tile(uk: MicroKernel, rows: int) -> MicroKernel:
    """Of the target's tile, those as fast per step of the sum and those of a row fewer
    (`padding_tiles`), the one whose panels pad A's `rows` least (columns cost about the same for
    every tile: the last panel runs a kernel of just its vectors), if it saves more than
    `TILE_SAVING` of the work; else the schedule's. On Zen 3 a 1 × 1 conv of 16 output channels
    over 112 × 112 pixels took 0.9× the time in 4 × 24 tiles as in 6 × 16 ones (18 rows, an
    eighth of the work wasted).
    (An A read in place runs a kernel of just the last rows instead.)"""
    mr, nr = min(padding_tiles(uk), key=lambda t: round_up(rows, t[0]))
    if round_up(rows, mr) >= (1 - TILE_SAVING) * round_up(rows, uk.mr):
        return uk
    return replace(uk, mr=mr, nr=nr)


def packed_applies(ctx: StageCtx, spec: Contraction) -> bool:
    s = ctx.schedule
    return (spec.dtype in ("float32", "float64") and spec.k > 0 and s.vector_bytes > 0
            and (spec.m >= s.gemm_min_m or _vector_times_weights(ctx, spec))
            and spec.n >= s.gemm_min_n)


# The vectors of a matrix-vector product's one-row tile: each step of the sum is one broadcast and
# this many FMAs into accumulators of their own, enough to cover an FMA's latency on two pipes
# (4 cycles × 2 on Zen 3 and recent Intel cores).
ROW_TILE_VECTORS = 8


def _vector_times_weights(ctx: StageCtx, spec: Contraction) -> bool:
    """One row times a constant matrix (a classifier head, a decoder's step): a packed GEMM of
    one-row tiles (`_row_tile`) over the weights pre-packed in panels. On Zen 3 (2 threads,
    CPU-time medians) a 1 × 768 by 768 product took 0.5× the time of the ikj loop nest, which
    keeps its accumulators in a local array, loaded and stored at every step of the sum."""
    if spec.m != 1 or math.prod(spec.batch) != 1:
        return False
    probe = spec.b(Index(spec.b_batch, flat=iconst(0)), ctx.var("pk", spec.k), ctx.var("pj", spec.n))
    return (probe.op == "load" and probe.name in ctx.graph.tensors
            and ctx.graph.tensors[probe.name].is_constant)


def _row_tile(uk: MicroKernel) -> MicroKernel:
    return replace(uk, mr=1, nr=ROW_TILE_VECTORS * uk.lanes)


# A one-row product reads each weight once: with at most this many bytes of them it runs on one
# thread. On a 2-vCPU Zen 3 (wall time, interleaved, other processes running) 1 × 768 by 768 and
# 1 × 512 by 1000 took 0.42–0.5× the time on one thread as on two, whose second thread's wake-up
# cost more than its half of a ~35 µs stream (the runner's best tenth: 34 µs on one thread, 39 on
# two); 1 × 1280 by 1000 (5 MB) 0.63×, yet 1 × 2048 by 1000 (8 MB) halved on two threads when
# both ran at once.
SERIAL_ROW_WEIGHT_BYTES = 1 << 22


def _serial(spec: Contraction, rows: int, itemsize: int) -> bool:
    return rows == 1 and spec.k * spec.n * itemsize <= SERIAL_ROW_WEIGHT_BYTES


@dataclass(frozen=True)
class _Product:
    """The product the tasks compute: its micro-kernel, packed operands, whether its rows run
    across the batch (`folded`), and its cache blocks."""

    uk: MicroKernel
    a: Packed
    b: Packed | None  # None until a task's copy of its block takes its place
    b_by_tasks: bool  # B copied block by block by the tasks, into a local array
    folded: bool
    rows: int  # the product's rows: M, or batch × M when folded
    batches: int  # products of `rows` rows: the batch, or 1 when folded
    blk: Blocking
    blocks: tuple[int, int, int]  # (row blocks, column blocks, slices of the sum)
    streams: bool = False  # row panels outermost, each over long runs of columns (`_streaming`)


@dataclass(frozen=True)
class _Task:
    """One parallel task's loop variables and the expressions built on them: task `p` = (batch
    `b`, row block, column block) starting at (`i0`, `j0`); slice `kb` of the sum, `kc` long
    from `k0`; micro-tile (`ip`, `jp`) of the block at (`i`, `j`) of the product, in the local
    array `tile`."""

    p: Expr
    b: Expr
    i0: Expr
    j0: Expr
    kb: Expr
    k0: Expr
    kc: Expr
    ip: Expr
    jp: Expr
    i: Expr
    j: Expr
    tile: str
    accumulate: Expr
    row_of: Callable[[Expr], tuple[Expr, Expr]]  # (batch, row of the batch) of a product row


def packed_gemm(ctx: StageCtx, spec: Contraction, packed_a: Packed | None = None) -> None:
    """`spec` as a packed GEMM, or on a GPU (work-groups in the schedule) as the work-group tiled
    one; `packed_a`: A already in constant panels of the micro-kernel's rows."""
    uk = micro_kernel(ctx, spec.dtype)
    if ctx.schedule.gemm_work_group > 0:  # a GPU's: work-groups staging tiles in local memory
        group_gemm(ctx, spec, uk, packed_a)
        return
    product = _streaming(ctx, spec, _product(ctx, spec, uk, packed_a))
    task = _task(ctx, spec, product)
    b_copy: list[ir.Stmt] = []
    if product.b_by_tasks:
        b_copy, product = _b_copied_by_task(ctx, spec, product, task)
    _stage(ctx, spec, product, task, *_tile_update(ctx, spec, product, task), b_copy)


def _product(ctx: StageCtx, spec: Contraction, uk: MicroKernel,
             packed_a: Packed | None) -> _Product:
    """The operands packed (or read in place) and the product's cache blocks."""
    a = OperandSide("a", spec.a, spec.a_batch, spec.m)
    b_side = OperandSide("b", lambda bi, j, k: spec.b(bi, k, j), spec.b_batch, spec.n)
    bt = math.prod(spec.batch)
    packed_across_batch = False
    if packed_a is None and spec.m < ctx.schedule.gemm_min_m:  # (`_vector_times_weights`)
        uk = _row_tile(uk)
        packed_a = a_rows_in_place(ctx, spec, a)
    elif packed_a is None:
        padded = least_padding_tile(uk, spec.m)
        packed_a = constant_panels(ctx, spec, a, padded.mr) or a_rows_in_place(ctx, spec, a)
        if packed_a is None and rows_contiguous_along_the_sum(ctx, spec, a):
            packed_a = scratch_rows(ctx, spec, a)
        elif packed_a is None and _packs_across_batch(spec):
            uk = least_padding_tile(uk, bt * spec.m)
            packed_a = scratch_panels(ctx, spec, rows_across_batch(a, spec.m), uk.mr)
            packed_across_batch = True
        elif packed_a is None or not packed_a.in_place:
            uk = padded
    packed_a = packed_a or scratch_panels(ctx, spec, a, uk.mr)
    itemsize = np.dtype(spec.dtype).itemsize
    uk = _tile_for_rows(ctx, uk, packed_a, itemsize)
    packed_b = constant_panels(ctx, spec, b_side, uk.nr)
    copied_by_tasks = packed_b is None and b_copied_by_tasks(ctx, spec, b_side, uk.lanes)
    folded = packed_across_batch or _folds_batch(spec, packed_a)
    rows, batches = (bt * spec.m, 1) if folded else (spec.m, bt)
    s = ctx.schedule
    # (balanced over thread counts; the convolutions' own GEMMs keep their blocks, unmeasured)
    blk = blocking(rows, spec.n, spec.k, batches, uk, s.gemm_mc, s.gemm_nc, s.gemm_kc,
                   balance=True)
    copied_by_tasks = copied_by_tasks and blk.kc * blk.nc * itemsize <= TASK_COPY_BYTES
    if not copied_by_tasks:  # (a task's copy of B stays as small as the schedule's slice)
        blk = replace(blk, kc=_cached_slice(spec.k, blk, itemsize, s.gemm_l2_bytes))
    packed_b = packed_b or (None if copied_by_tasks else b_rows(ctx, spec, b_side, uk.nr, uk.lanes))
    blocks = (-(-rows // blk.mc), -(-spec.n // blk.nc), -(-spec.k // blk.kc))
    return _Product(uk, packed_a, packed_b, copied_by_tasks, folded, rows, batches, blk, blocks)


def _tile_for_rows(ctx: StageCtx, uk: MicroKernel, packed_a: Packed, itemsize: int) -> MicroKernel:
    """The schedule's tile, or one of half its rows when the rows of an A read in place would
    evict each other from L1: on Zen 4 a 128 × 3072 × 768 product took 0.84× the time with 6×64
    tiles as with 12×32 ones (0.88× with A packed instead)."""
    if (not packed_a.in_place or uk.mr < 2
            or not rows_evict_each_other(uk, packed_a.ld * itemsize)):
        return uk
    ctx.info["tile_halved"] = "rows of A evict each other from L1"
    return fewer_rows(uk)


def _cached_slice(k: int, blk: Blocking, itemsize: int, cache_bytes: int) -> int:
    """The slice of the sum per pass: the schedule's, or longer (an even split of K) while a
    task's blocks of A (mc × kc) and B (kc × nc) still fit in `cache_bytes` together. Every pass
    restarts the prefetch streams of A's rows and B's panels and reloads each C tile: on Zen 4 a
    128 × 768 × 3072 product took 0.88× the time in one pass of 768 as in three of 256."""
    longest = cache_bytes // ((blk.mc + blk.nc) * itemsize)
    if longest <= blk.kc:
        return blk.kc
    return -(-k // -(-k // longest))


# The longest sum whose product `_streaming` runs row panel by row panel: each tile's sum then
# takes no longer than storing it (16 steps of 12 × 32 FMAs against 24 lines written).
STREAM_MAX_K = 128


def stores_bound(schedule: Schedule, k: int, output_bytes: int) -> bool:
    """Whether storing the results bounds a product: a short sum (at most `STREAM_MAX_K`) into
    an output larger than a quarter of L2 (the other tensors of the model's step take the rest).
    Such products and direct convs store long runs of each output row (`_streaming`,
    `kiln.codegen.ops.conv_direct`)."""
    return k <= STREAM_MAX_K and output_bytes > schedule.gemm_l2_bytes // 4


def _streaming(ctx: StageCtx, spec: Contraction, pr: _Product) -> _Product:
    """`pr` with its row panels outermost in each task, each over a long run of columns, where
    storing the results bounds the product (`stores_bound`), in one pass of the sum, and its
    micro-kernel stores whole tiles itself. Column panels outermost, each task writes all its
    block's rows at once, `mc` streams of one tile's width, more than the prefetchers follow, so
    every store misses; a row panel at a time, `mr` streams run on for the whole block (its B
    block, `kc` × `nc`, stays in L2 and its A panel in L1). On the AVX-512 Xeon, MobileNetV2's
    1 × 1 conv from 16 to 96 channels at 112 × 112 took 0.59× the time in-model
    (`bench/kernel_ab.py`, 2 threads), from 32 to 16 channels 0.9×; ResNet-50's 64 to 256 at
    56 × 56 with a residual 0.65–0.8×, 128 to 512 at 28 × 28 0.87×; Swin-T's products of
    3136 × 96 rows ran as long either way."""
    s = ctx.schedule
    itemsize = np.dtype(spec.dtype).itemsize
    if (pr.blocks[2] > 1 or pr.b_by_tasks
            or not stores_bound(s, spec.k, pr.batches * pr.rows * spec.n * itemsize)):
        return pr
    if _output_rows(ctx, spec, None if pr.folded else iconst(0), tile_operands=True) is None:
        return pr
    nc = max(s.gemm_nc, s.gemm_l2_bytes // 4 // (pr.blk.kc * itemsize))
    blk = blocking(pr.rows, spec.n, spec.k, pr.batches, pr.uk, s.gemm_mc, nc, pr.blk.kc,
                   balance=True)
    blocks = (-(-pr.rows // blk.mc), -(-spec.n // blk.nc), 1)
    return replace(pr, blk=blk, blocks=blocks, streams=True)


def _packs_across_batch(spec: Contraction) -> bool:
    """A batch of run-time A that must be packed (not read in place) times one B: packed as one
    product of batch × M rows (`rows_across_batch`)."""
    return (math.prod(spec.batch) > 1 and spec.a_batch == spec.batch
            and math.prod(spec.b_batch) <= 1)


def _folds_batch(spec: Contraction, packed_a: Packed) -> bool:
    """One weight matrix for a batch of row-major A whose batches follow each other: one product
    of batch × M rows (no partial panel per batch; ConvNeXt's 7 × 7 × 768 is 49 rows, not 7 × 7)."""
    return (math.prod(spec.batch) > 1 and packed_a.in_place and spec.a_batch == spec.batch
            and math.prod(spec.b_batch) <= 1 and packed_a.batch_ld == spec.m * packed_a.ld)


def _task(ctx: StageCtx, spec: Contraction, pr: _Product) -> _Task:
    uk, blk = pr.uk, pr.blk
    row_blocks, col_blocks, k_blocks = pr.blocks
    p = ctx.var("p", pr.batches * row_blocks * col_blocks)
    # column blocks outermost: an even split gives each thread a run of whole columns (a conv's
    # pixels), the run the kernels before and after it give that thread too
    b, cb, rb = Index((pr.batches, col_blocks, row_blocks), flat=p).dims
    i0, j0 = mul(rb, blk.mc), mul(cb, blk.nc)
    tile = ctx.name("ct")
    kb = ctx.var("kb", k_blocks)
    k0 = mul(kb, blk.kc)
    kc = iconst(blk.kc) if spec.k % blk.kc == 0 else imin(iconst(blk.kc), sub(iconst(spec.k), k0))
    ip, jp = ctx.var("ip", blk.mc // uk.mr), ctx.var("jp", blk.nc // uk.nr)
    accumulate = index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool")

    def row_of(g: Expr) -> tuple[Expr, Expr]:
        return (floordiv(g, spec.m), modulo(g, spec.m)) if pr.folded else (b, g)

    return _Task(p, b, i0, j0, kb, k0, kc, ip, jp, add(i0, mul(ip, uk.mr)),
                 add(j0, mul(jp, uk.nr)), tile, accumulate, row_of)


def _b_copied_by_task(ctx: StageCtx, spec: Contraction, pr: _Product,
                      t: _Task) -> tuple[list[ir.Stmt], _Product]:
    """The task's block of B, copied into a local array for each slice of the sum."""
    copy = ctx.name("bc")
    stmts = b_block_copy(ctx, spec, copy, pr.blk.nc, batch_of(spec, t.b, spec.b_batch),
                         (t.k0, t.kc), t.j0)
    ctx.info["b_operand"] = "copied by the tasks"
    return stmts, replace(pr, b=Packed(copy, lambda _b, _k0, j: sub(j, t.j0), pr.blk.nc))


def _operand_batches(spec: Contraction, pr: _Product, t: _Task) -> tuple[Expr, Expr]:
    """The flat batch indices of A and B in task `t`'s batch."""
    def flat(shape: tuple[int, ...]) -> Expr:
        return batch_of(spec, t.b, shape).flat if shape and not pr.folded else iconst(0)
    return flat(spec.a_batch), flat(spec.b_batch)


def _call(pr: _Product, t: _Task, b_offset: Expr, a: tuple[MicroKernel, str, Expr],
          c: tuple[str, Expr, int], next_slice: Expr | None = None) -> ir.MicroKernelCall:
    """The micro-kernel update of one tile: `a` = (kernel, A buffer, offset), `c` = (buffer,
    offset, row stride) of the results; `next_slice`: where in B the slice the block reads next
    starts (`spread_ahead`), if its tiles spread their requests for it."""
    kernel, a_buffer, a_offset = a
    ahead = None
    if next_slice is not None:
        kernel, ahead = spread_ahead(kernel, pr.uk.nr, pr.blk.mc // pr.uk.mr, pr.blk.kc,
                                     next_slice, t.ip)
    return ir.MicroKernelCall(kernel, t.kc, a_buffer, a_offset, pr.b.buffer, b_offset, pr.b.ld,
                              *c, t.accumulate,
                              ahead=None if ahead is None else (pr.b.buffer, ahead))


def spread_ahead(kernel: MicroKernel, nr: int, tiles: int, kc: int, next_slice: Expr,
                 ip: Expr) -> tuple[MicroKernel, Expr | None]:
    """The kernel of row tile `ip` of `tiles` asking for its share of the next slice (`kc` rows
    of `nr`) of B's panel, and where that share starts. A block's row tiles all read each slice
    of a panel of B; asking only `PREFETCH_STEPS` ahead, the first one pulls it from memory at
    the pace its FMAs consume it, which a panel of cold weights cannot keep up with; spread over
    all the tiles' steps the slice comes in at the slice's pace. On Zen 4 a 7 × 48 pixel-rows
    kernel over a 3 × 3 conv's weights of 512 channels, cold, ran at 0.86× the FMAs per second
    it reaches on warm ones asking `PREFETCH_STEPS` ahead, at 0.97× asking for its share; in
    ResNet-50 its 3 × 3 convs onto 7 × 7 took 0.93-0.96× the time. (One tile per block: as
    before.)"""
    if tiles < 2:
        return kernel, None
    spread = -(-nr // tiles)
    return replace(kernel, b_spread=spread), add(next_slice, mul(ip, spread * kc))


def _next_slice(spec: Contraction, pr: _Product, t: _Task) -> Expr | None:
    """Where the slice of B the block reads after this tile's starts: the next panel of the
    block at this slice, after the last one the first panel's next slice (`spread_ahead`). Only
    B in panels, not a streaming product's."""
    uk, blk = pr.uk, pr.blk
    if pr.streams or pr.b_by_tasks or pr.b.ld != uk.nr:
        return None
    col_panels = imin(iconst(blk.nc // uk.nr),
                      floordiv(sub(iconst(spec.n + uk.nr - 1), t.j0), uk.nr))
    _, b_flat = _operand_batches(spec, pr, t)
    return select(index_compare("lt", add(t.jp, 1), col_panels),
                  pr.b.offset(b_flat, t.k0, add(t.j, uk.nr)),
                  pr.b.offset(b_flat, add(t.k0, blk.kc), t.j0))


def _tile_update(ctx: StageCtx, spec: Contraction, pr: _Product,
                 t: _Task) -> tuple[list[ir.Stmt], list[ir.Stmt]]:
    """One micro-tile's update, with its epilogue when the micro-kernel can store whole tiles
    itself (only the ragged tiles go through the local array): a plain product, or one whose
    epilogue is call-free math of the sum and of values constant along the tile's rows or
    columns, which the kernel applies in registers after the last slice of the sum (no pass
    over the block: on a loaded Zen 3 with 2 threads, medians of interleaved runs, bias and
    ReLU6 on a 1 × 1 conv of 16 to 96 channels at 112 × 112 took 0.77–0.90× the CPU time; bias
    and ReLU at 56 × 56, 0.67–0.95× from 256 channels, 0.84–1.03× from 64; a BERT QKV product's
    bias 0.75–0.94×; on one thread within ±6%); and the epilogue of the whole block otherwise.
    (A SiLU in registers, its exp as vectors, took 0.88–1.27× the time of the block's pass:
    it stays there.)

    The block's epilogue runs once all its micro-tiles are done, along whole rows of the block:
    per micro-tile it would store (and read any other tensor it adds, a residual) in `mr` runs
    of `nr` elements, each in a row of its own, as many concurrent streams as the block has
    rows, more than the hardware prefetchers follow. On Zen 3 a 1 × 1 conv onto 56 × 56 pixels
    took 0.6–0.85× the time with its residual added per block; with only a bias and a ReLU,
    0.76× while other processes loaded the memory system, as long on a quiet machine; a
    transformer's products (bias, residual) ran as fast either way."""
    uk, blk = pr.uk, pr.blk
    a_flat, b_flat = _operand_batches(spec, pr, t)
    b_offset = pr.b.offset(b_flat, t.k0, t.j)
    into_tile = ((t.tile, iconst(0), uk.nr) if pr.streams
                 else (t.tile, add(mul(t.ip, uk.mr * blk.nc), mul(t.jp, uk.nr)), blk.nc))
    a_at = pr.a.offset(a_flat, t.k0, t.i)
    a_whole = (replace(uk, lda=pr.a.ld) if pr.a.in_place else uk, pr.a.buffer, a_at)
    # The last, partial panels run kernels of just their rows (of an A read in place) and of just
    # their columns' vectors: a whole panel's kernel would spend its FMAs on rows and columns
    # past the product (49 rows of 12-row panels are 60 rows' work; 96 columns of 64-column
    # panels, 128 columns').
    full_rows, full_cols = pr.rows // uk.mr * uk.mr, spec.n // uk.nr * uk.nr
    edge_rows = pr.rows - full_rows if pr.a.in_place else 0
    edge_cols = round_up(spec.n - full_cols, uk.lanes) % uk.nr

    next_slice = _next_slice(spec, pr, t)

    def update(rows: int, cols: int) -> ir.MicroKernelCall:
        kernel = replace(a_whole[0], mr=rows, nr=cols)
        return _call(pr, t, b_offset, (kernel, pr.a.buffer, a_at), into_tile, next_slice)

    def across_columns(rows: int) -> ir.Stmt:
        if not edge_cols:
            return update(rows, uk.nr)
        ctx.info["column_edge_kernel"] = f"{uk.mr}x{edge_cols}"
        return ir.If(index_compare("lt", t.j, full_cols), [update(rows, uk.nr)],
                     [update(rows, edge_cols)])

    call = across_columns(uk.mr)
    if edge_rows:
        call = ir.If(index_compare("lt", t.i, full_rows), [call], [across_columns(edge_rows)])
        ctx.info["row_edge_kernel"] = f"{edge_rows}x{uk.nr}"
    output = _output_rows(ctx, spec, None if pr.folded else t.b, tile_operands=pr.streams)
    assert output is not None or not pr.streams, "a streaming product stores whole tiles itself"
    if output is None:
        ctx.info["epilogue"] = "per block"
        return [call], _epilogue(ctx, spec, pr, t, (t.i0, t.j0), (pr.blk.mc, pr.blk.nc))
    # whole micro-tiles update the output itself: no copy through L1
    whole = logical_and(index_compare("le", add(t.i, uk.mr), pr.rows),
                        index_compare("le", add(t.j, uk.nr), spec.n))
    direct = _call(pr, t, b_offset, a_whole, (output.buffer, output.at(t.i, t.j), output.ldc),
                   next_slice)
    ctx.info["whole_tiles"] = "stored by the micro-kernel"
    if output.epilogue is not None:
        k_blocks = pr.blocks[2]
        last = (index_compare("eq", t.kb, k_blocks - 1) if k_blocks > 1
                else const(True, "bool"))
        direct = replace(direct, kernel=replace(direct.kernel, epilogue=output.epilogue),
                         operands=output.operands(t.i, t.j), finish=last)
        ctx.info["epilogue"] = "in registers"
    ragged = [call, *_epilogue(ctx, spec, pr, t, (t.i, t.j), (uk.mr, uk.nr))]
    if pr.streams:
        ctx.info["order"] = "row panels outermost"
    return [ir.If(whole, [direct], ragged)], []


def _epilogue(ctx: StageCtx, spec: Contraction, pr: _Product, t: _Task,
              start: tuple[Expr, Expr], size: tuple[int, int]) -> list[ir.Stmt]:
    """The results of `size` = (rows, columns) from `start` (a micro-tile, or the whole block)
    through the epilogue, from the block's local array, after their last update."""
    i, j = start
    # the local array holds the block from (i0, j0), or a streaming product's one tile
    (i0, j0), ldc = ((i, j), size[1]) if pr.streams else ((t.i0, t.j0), pr.blk.nc)
    if pr.folded:
        epilogue = [_folded_epilogue(ctx, spec, ldc, t.tile, (i0, i, size[0], pr.rows),
                                     (j0, j, size[1]), t.row_of)]
    else:
        epilogue = tile_epilogue(ctx, spec, ldc, t.tile, t.b, (i0, i, size[0]), (j0, j, size[1]))
    k_blocks = pr.blocks[2]
    return [ir.If(index_compare("eq", t.kb, k_blocks - 1), epilogue)] if k_blocks > 1 else epilogue


def _stage(ctx: StageCtx, spec: Contraction, pr: _Product, t: _Task, tile_update: list[ir.Stmt],
           block_epilogue: list[ir.Stmt], per_slice: list[ir.Stmt]) -> None:
    """The parallel loop over tasks: for each slice of the sum, `per_slice` (copies of its
    operands), then every micro-tile of the block, column panels outermost, then the block's
    epilogue if it has one."""
    uk, blk = pr.uk, pr.blk
    row_blocks, col_blocks, k_blocks = pr.blocks
    tasks = pr.batches * row_blocks * col_blocks
    row_panels = imin(iconst(blk.mc // uk.mr),
                      floordiv(sub(iconst(pr.rows + uk.mr - 1), t.i0), uk.mr))
    col_panels = imin(iconst(blk.nc // uk.nr),
                      floordiv(sub(iconst(spec.n + uk.nr - 1), t.j0), uk.nr))
    outer, inner = ((t.ip, row_panels), (t.jp, col_panels)) if pr.streams else (
        (t.jp, col_panels), (t.ip, row_panels))
    compute: list[ir.Stmt] = [ir.Loop(outer[0], iconst(0), outer[1],
                                      [ir.Loop(inner[0], iconst(0), inner[1], tile_update)])]
    compute += block_epilogue
    b_copied = [ir.DeclArray(pr.b.buffer, spec.dtype, blk.kc * blk.nc)] if pr.b_by_tasks else []
    tile_size = uk.mr * uk.nr if pr.streams else blk.mc * blk.nc
    body = [ir.DeclArray(t.tile, spec.dtype, tile_size), *b_copied,
            ir.Loop(t.kb, iconst(0), iconst(k_blocks), [*per_slice, *compute])]
    bt = math.prod(spec.batch)
    serial = _serial(spec, pr.rows, np.dtype(spec.dtype).itemsize)
    if serial:
        ctx.info["threads"] = "one (a short stream of weights)"
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), packed GEMM",
              [ir.Loop(t.p, iconst(0), iconst(tasks), body, parallel=0 if serial else 1,
                       grain=ctx.schedule.task_grain)],
              bt * spec.m * spec.n * spec.k)
    ctx.info.update(form="packed", micro_kernel=f"{uk.mr}x{uk.nr}", vector_bytes=uk.vector_bytes,
                    mc=blk.mc, nc=blk.nc, kc=blk.kc, tasks=tasks, product_rows=pr.rows)


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


@dataclass(frozen=True)
class _Direct:
    """Where a micro-kernel can leave whole tiles itself: the output `buffer`, the offset of
    (row, column) `at`, its row stride `ldc`; the math the kernel applies in registers first
    (None: the sums unchanged) and its operands at (row, column)."""

    buffer: str
    at: Callable[[Expr, Expr], Expr]
    ldc: int
    epilogue: TileEpilogue | None
    operands: Callable[[Expr, Expr], tuple[tuple[str, Expr], ...]]


def _output_rows(ctx: StageCtx, spec: Contraction, b: Expr | None,
                 tile_operands: bool = False) -> _Direct | None:
    """Where a micro-kernel can leave whole tiles itself: when the epilogue stores each sum, or
    call-free math of it and of values constant along the tile's rows or columns (a bias, a
    ReLU, a Clip: `register_epilogue`), into one output whose rows are contiguous, in batch `b`;
    b None: rows run across the batch (a folded product), so one batch's rows must follow the
    previous one's. With `tile_operands`, also math of another tensor read at the result's own
    element (a residual). None when anything else happens to the results (a function called,
    another layout)."""
    batch = ctx.var("pb", math.prod(spec.batch))  # (b is an expression over the task)
    i, j = ctx.var("i", spec.m), ctx.var("j", spec.n)
    total = array_load(ctx.name("sum"), spec.dtype, iconst(0))
    found = register_epilogue(results(ctx, spec, total, batch, i, j), total, (i, j, batch),
                              rows_cross_batches=b is None, tile_operands=tile_operands)
    if found is None:
        return None
    store = found.store
    probe = load(store.buffer, spec.dtype, store.offset)
    row = stride_of(probe, i) if spec.m > 1 else spec.n
    if stride_of(probe, j) != 1 or row is None or row < spec.n:
        return None
    if b is None and stride_of(probe, batch) != spec.m * row:
        return None
    fixed = {batch: iconst(0) if b is None else b}
    return _Direct(store.buffer, lambda x, y: substitute(store.offset, {**fixed, i: x, j: y}),
                   row, found.epilogue, lambda x, y: found.operands_at({**fixed, i: x, j: y}))
