"""Direct 2-D convolution with output pixels as the GEMM's rows and output channels in the vector
lanes: C[i, m] = Σ_k A[i, k] · W[k, m], where A[i, k = (c, ky, kx)] is read in place from the
zero-padded, stride-phase-split copy of the input that `conv_direct` makes, at
`copy + bases[i] + rows[k]`: `rows[k]` the tap's offset there (`conv_direct._phase_grid`),
`bases[i]` the grid position oy·wq + ox of valid output pixel i = oy·ow + ox. Only valid pixels
are rows, so nothing is computed for the grid's columns past the output's (`conv_direct` computes
wq − ow of them per row, and pads the last panel of pixels to whole vectors: on a 7 × 7 image 64
columns' work for 49 pixels).

The weights are packed at compile time in panels of `nr` output channels (B), each step of the
sum broadcasts `mr` pixels and FMAs them against the panel's vectors (the pixel-rows
micro-kernel, `kiln.codegen.microkernel.pixel_rows_source`); the last, ragged tile of pixels and
panel of channels run kernels of just their rows and vectors, so no product is wasted when the
channels per group are whole vectors (the only case taken). Each task runs the whole sum for its
tiles, so a tile's bias and call-free activation (ReLU, Clip: `register_epilogue`) are applied in
registers and the tile is stored transposed into the output (a column is one channel's `mr`
consecutive pixels); an epilogue that reads another tensor or calls a function runs in a pass of
its own over the raw sums, along the pixels (as `conv._by_pixels`).

As `conv_direct`'s tasks do, each task copies the window of the padded grid its block of pixels
reads (the grid rows they span, and the taps' reach below) per slice of the sum, when that is
small and copies little twice (`conv_direct.TASK_COPY_SHARE`); its `bases` are then relative to
its block's first grid row. On Zen 3 grouped 3 × 3 convs at 7 × 7 and 14 × 14 took 0.86-0.97x
the time that way as with the whole input copied first."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import Refused, StageCtx
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
    modulo,
    mul,
    sub,
    substitute,
)
from kiln.codegen.gemm.blocking import Blocking, blocking, round_up
from kiln.codegen.gemm.packed import least_padding_tile, micro_kernel, spread_ahead
from kiln.codegen.gemm.register_epilogue import register_epilogue
from kiln.codegen.gemm.spec import stride_of
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import MicroKernel, TileEpilogue, same_work_tiles
from kiln.codegen.ops.conv_direct import (
    _copy_input,
    _copy_window,
    _phase_grid,
    TaskWindow,
    _task_window,
    balanced_split,
    computed_columns,
    copied_by_tasks,
    direct_tile,
    slice_tiles,
)
from kiln.codegen.ops.conv_window import ConvOperands, Window, constant_weights

MAX_ROWS = 8  # a row's broadcasts read off a pointer of its own: general registers for them all

# The pixel-rows kernel's extra cost per product over the direct one's, per cache line its
# broadcasts move to per step of the sum (`_lines_per_step`): the direct kernel's vector loads
# stream whole lines, the broadcasts' scattered reads do not (and the direct kernel's copy of the
# input stays in L2 by tasks, the pixel-rows kernel's whole copy does not). On Zen 3, CPU time
# at 1 and 2 threads: grouped 3 × 3 convs of 64 channels a group at 7 × 7 and 14 × 14 (the
# direct kernel computes 1.31 and 1.14 times the products) took 0.86-0.96x the time; 5 × 5
# ones at 7 × 7 and 14 × 14, 0.57-0.73x that of the transposed GEMM on a packed im2col; 1 × 1
# convs of stride 2 (a new plane at every step), 1.13-1.3x.
PIXEL_ROWS_OVERHEAD = 3 / 8

# The direct kernel's extra cost per product on a grid of several stride phases, when the sum
# runs over enough input channels onto a small enough image, split in enough GEMMs (images ×
# groups) that the pixel-rows kernel's tasks copy their own windows of the input: on Zen 3,
# 3 × 3 convs of stride 2 with 8 and 17 groups of 64 channels onto 14 × 14 and 7 × 7 took
# 0.77-0.91x the time by the pixel-rows kernel at 1 thread, 0.81-0.85x at 2. Elsewhere the
# phases count against the pixel-rows kernel, each one's lines per step: at 2 threads ungrouped
# 3 × 3 convs of stride 2 (128-512 channels onto 28 × 28 to 7 × 7, the whole input copied
# first) took 1.04-1.6x the time by it (0.83-1.08x at 1 thread), 3 groups onto 28 × 28 1.05x,
# stems (3 input channels, 7 × 7 and 3 × 3 of stride 2) 1.05-1.06x, and 3 × 3 convs of stride
# 2 onto 56 × 56 (64 and 128 channels) 1.12-1.24x at 1 thread.
DIRECT_PHASES_OVERHEAD = 1 / 4
PHASES_OVERHEAD_MIN_CHANNELS = 16
PHASES_OVERHEAD_MIN_GEMMS = 4
PHASES_OVERHEAD_MAX_PIXELS = 1024
# On AVX-512 (a Zen 4 class host) ungrouped convs count too, onto at most so many pixels: in
# ResNet-50 (whole model, per kernel, 1 thread) its 3 × 3 convs of stride 2 onto 14 × 14 and
# 7 × 7 (256 and 512 channels) took 0.88× and 0.93× the time by the pixel-rows kernel as by the
# direct kernel and the transposed GEMM (single convs at 2 threads, fastest of interleaved runs:
# 0.98× and 0.95×); the one onto 28 × 28 (128) 0.99×, but 1.13× at 2 threads. ConvNeXt-T's
# 2 × 2 conv of stride 2 onto 7 × 7 (384 to 768 channels): 0.6× at 1 and 2 threads. Only with the
# epilogue in registers: LeViT-128's 3 × 3 of stride 2 onto 14 × 14, its output transposed into
# tokens (the raw sums in a pass of their own), took 1.3-1.6×.
UNGROUPED_PHASES_OVERHEAD_MAX_PIXELS = {64: 256}


def _lines_per_step(w: Window) -> float:
    """The rows of the padded copy a tile's broadcasts start on per step of the sum: the taps
    of a channel read (phase plane, row shift) pairs, each a run of the tile's pixels, shared
    by the taps on it; a 1 × 1 conv reads a new plane at every step."""
    (sh, sw), (dh, dw) = w.strides, w.dilations
    taps = [(ky, kx) for ky in range(w.kernel[0]) for kx in range(w.kernel[1])]
    runs = {((ky * dh) % sh, (kx * dw) % sw, ky * dh // sh) for ky, kx in taps}
    return len(runs) / len(taps)


def pixel_rows_tile(base: MicroKernel, pixels: int) -> MicroKernel:
    """Of the tiles as fast per step as the target's (`same_work_tiles`), the target's own if it
    has at most `MAX_ROWS` rows, else the first such one (AVX-512's 12 × 32 as 8 × 48); then,
    as for a GEMM's rows, the tile that pads the `pixels` least (`least_padding_tile`): a 7 × 7
    image's 49 in 7 × 48 tiles, not six of 8 × 48 and a tile of one row (ResNet-50's 3 × 3 convs
    of 512 channels onto 7 × 7 took 0.98× the time in the model, on Zen 4)."""
    tiles = [t for t in same_work_tiles(base) if t[0] <= MAX_ROWS]
    mr, nr = tiles[0] if tiles else (min(base.mr, MAX_ROWS), base.nr)
    chosen = least_padding_tile(replace(base, mr=mr, nr=nr), pixels)
    return replace(chosen, pixel_rows=True)


def pixel_rows_applies(ctx: StageCtx, w: Window, channels_out: int, dtype: str) -> bool:
    """A 2-D float conv on a CPU with GEMM micro-kernels (`conv_direct.direct_applies` holds)
    whose output channels per group are whole vectors: the last panel's vectors hold only
    channels, so its bias loads stay inside the tensor."""
    return (len(w.kernel) == 2 and dtype in ("float32", "float64")
            and channels_out % micro_kernel(ctx, dtype).lanes == 0)


def pixel_rows_wins(ctx: StageCtx, w: Window, channels_out: int, dtype: str,
                    channels_in: int, gemms: int, in_registers: bool = True) -> bool:
    """Whether the pixel-rows kernel computes fewer products than `conv_direct`'s (its tile,
    its grid's columns past the output's, its last panel's whole vectors), after
    `PIXEL_ROWS_OVERHEAD` for each line its broadcasts move to per step. A grid of several
    stride phases costs the direct kernel `DIRECT_PHASES_OVERHEAD` on a sum over at least
    `PHASES_OVERHEAD_MIN_CHANNELS` input channels (`channels_in`, per group) onto at most
    `PHASES_OVERHEAD_MAX_PIXELS` in at least `PHASES_OVERHEAD_MIN_GEMMS` (`gemms`: images ×
    groups), or in fewer onto at most `UNGROUPED_PHASES_OVERHEAD_MAX_PIXELS` of the target's
    vector width when the pixel-rows kernel stores its tiles through the epilogue
    (`in_registers`); else (a stem, a large image, an ungrouped conv) it costs the pixel-rows
    kernel its lines in every phase. Both read a copy of the input; the sum's length cancels."""
    base = micro_kernel(ctx, dtype)
    uk = direct_tile(base, w, channels_out)
    grid, _ = _phase_grid(w, 1, 1)
    direct = (round_up(channels_out, uk.mr)
              * computed_columns(w.out_size[0] * grid.wq, uk.nr, uk.lanes))
    lines = _lines_per_step(w)
    max_pixels = (PHASES_OVERHEAD_MAX_PIXELS if gemms >= PHASES_OVERHEAD_MIN_GEMMS
                  else UNGROUPED_PHASES_OVERHEAD_MAX_PIXELS.get(base.vector_bytes, 0)
                  if in_registers else 0)
    if channels_in >= PHASES_OVERHEAD_MIN_CHANNELS and math.prod(w.out_size) <= max_pixels:
        direct *= 1 + DIRECT_PHASES_OVERHEAD * (len(grid.phases) > 1)
    else:
        lines *= len(grid.phases)
    overhead = 1 + PIXEL_ROWS_OVERHEAD * lines
    return math.prod(w.out_size) * channels_out * overhead < direct


def pixel_rows_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                    group: int, in_shape: tuple[int, ...]) -> bool:
    """The convolution by the pixel-rows kernel (module docstring); False, with nothing
    emitted, when the weights are not constants (they are packed at compile time)."""
    out, dtype = ctx.out(), ops.acc_dtype
    batch = out.shape[0]
    cg, mg = in_shape[1] // group, w_shape[0] // group
    k_total, pixels = cg * math.prod(w.kernel), math.prod(w.out_size)
    uk = pixel_rows_tile(micro_kernel(ctx, dtype), pixels)
    weights = _weights(ctx, ops, w_shape, group, uk.nr)
    if weights is None:
        return False
    grid, row_offsets = _phase_grid(w, cg, 1)
    (oh, ow), wq = w.out_size, grid.wq
    s, bt = ctx.schedule, batch * group
    window_name = ctx.name("xw")

    def split(balance: bool) -> tuple[Blocking, int, TaskWindow, bool]:
        blk = blocking(pixels, mg, k_total, bt, uk, s.gemm_mc, s.gemm_nc, s.gemm_kc,
                       balance=balance)
        tasks = bt * -(-mg // blk.nc) * -(-pixels // blk.mc)
        # the most grid rows a block's pixels span
        spanned = max(min(i0 + blk.mc, pixels) - 1 - (i0 - i0 % ow) for i0 in
                      range(0, pixels, blk.mc)) // ow + 1
        window = _task_window(window_name, w, grid, Blocking(blk.mc, spanned * wq, blk.kc),
                              math.prod(w.kernel), k_total, spanned)
        return (blk, tasks, window,
                copied_by_tasks(window, tasks * -(-k_total // blk.kc), grid, bt * cg, dtype))

    blk, tasks, window, by_tasks = balanced_split(split, bt * pixels * mg * k_total)
    row_blocks, col_blocks, k_blocks = -(-pixels // blk.mc), -(-mg // blk.nc), -(-k_total // blk.kc)
    first_rows = np.arange(pixels) // blk.mc * blk.mc // ow  # the grid row each block starts on
    grid_at = np.arange(pixels) // ow * wq + np.arange(pixels) % ow
    if by_tasks:  # each task's window starts on its block's first grid row
        copy, segment, row_offsets = window.name, 0, window.row_offsets
        grid_at = grid_at - first_rows * wq
    else:
        copy, segment = _copy_input(ctx, w, grid, ops, in_shape, group, dtype), grid.segment
    rows, positions = ctx.derived(row_offsets), ctx.derived(grid_at.astype(np.int32))
    packed = ctx.derived(weights)
    p = ctx.var("p", tasks)
    b, cb, rb = Index((bt, col_blocks, row_blocks), flat=p).dims
    n, g = floordiv(b, group), modulo(b, group)
    i0, j0 = mul(rb, blk.mc), mul(cb, blk.nc)
    kb, k0, kc, ip, jp, i_lo, j_lo = slice_tiles(ctx, blk, uk, k_total, i0, j0)
    target, sums = _output(ctx, ops, out.shape, uk, (n, add(mul(g, mg), j_lo), i_lo))
    tile = ctx.name("ct")
    slot = mul(add(mul(jp, blk.mc // uk.mr), ip), uk.mr * uk.nr)
    accumulate = index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool")
    finish = (index_compare("eq", kb, k_blocks - 1) if k_blocks > 1
              else const(True, "bool"))

    def call(kernel: MicroKernel) -> ir.MicroKernelCall:
        # B: the group's panels of K rows each, the last one as wide as its channels
        b_at = add(mul(g, k_total * mg), mul(j_lo, k_total), mul(k0, kernel.nr))
        kernel, ahead = spread_ahead(kernel, kernel.nr, blk.mc // uk.mr, blk.kc,
                                     add(b_at, blk.kc * kernel.nr), ip)
        return ir.MicroKernelCall(
            kernel, kc, copy, mul(b, segment), packed, b_at, kernel.nr, tile, slot,
            target.ldc, accumulate, rows, k0,
            ((positions, i_lo), (target.buffer, target.offset), *target.operands), finish,
            ahead=None if ahead is None else (packed, ahead))

    def across_panels(rows_: int) -> ir.Stmt:
        whole = replace(uk, mr=rows_, epilogue=target.epilogue)
        edge = mg % uk.nr
        if not edge:
            return call(whole)
        return ir.If(index_compare("lt", j_lo, mg - edge), [call(whole)],
                     [call(replace(whole, nr=edge))])

    update = across_panels(uk.mr)
    if pixels % uk.mr:
        update = ir.If(index_compare("lt", i_lo, pixels - pixels % uk.mr), [update],
                       [across_panels(pixels % uk.mr)])
    row_panels = imin(iconst(blk.mc // uk.mr), floordiv(sub(iconst(pixels + uk.mr - 1), i0), uk.mr))
    col_panels = imin(iconst(blk.nc // uk.nr), floordiv(sub(iconst(mg + uk.nr - 1), j0), uk.nr))
    # each tile of pixels runs through all the block's panels of channels while its scattered
    # broadcasts stay in L1; the panels' slices stream in as whole vectors (on Zen 3 the other
    # order, a panel's slice kept across the tiles, took 1.1-1.3x the time)
    compute = ir.Loop(ip, iconst(0), row_panels, [ir.Loop(jp, iconst(0), col_panels, [update])])
    per_slice: list[ir.Stmt] = [compute]
    body: list[ir.Stmt] = [ir.DeclArray(tile, dtype, blk.mc * blk.nc)]
    if by_tasks:
        body.append(ir.DeclArray(copy, dtype, window.elements))
        per_slice[:0] = _copy_window(ctx, w, grid, window, ops, in_shape, group, dtype,
                                     (b, floordiv(i0, ow), k0),
                                     (blk.kc, k_total, math.prod(w.kernel)))
        ctx.info["input_copy"] = "by the tasks"
    body.append(ir.Loop(kb, iconst(0), iconst(k_blocks), per_slice))
    ctx.stage(f"conv ({ctx.op.id}), direct with pixels as rows",
              [ir.Loop(p, iconst(0), iconst(tasks), body, parallel=1,
                       grain=s.task_grain)],
              bt * pixels * mg * k_total)
    ctx.info.update(form="direct, pixels as rows", micro_kernel=f"{uk.mr}x{uk.nr}",
                    mc=blk.mc, nc=blk.nc, kc=blk.kc, tasks=tasks,
                    grid=f"{len(grid.phases)}x{grid.hq}x{grid.wq}",
                    epilogue="in registers" if sums is None else "a pass of its own")
    if sums is not None:
        ctx.attach_info()
        epilogue_pass(ctx, ops, sums, pixels)
    return True


def _weights(ctx: StageCtx, ops: ConvOperands, w_shape: tuple[int, ...], group: int,
             nr: int) -> np.ndarray | None:
    """The weights as B panels: per group, panels of `nr` output channels (the last one as wide
    as the channels left), each K rows of its channels, one after the other; None if they are
    not constants."""
    values = constant_weights(ctx, ops, w_shape)
    if values is None:
        return None
    mg, k_total = w_shape[0] // group, values.size // w_shape[0]
    per_group = values.reshape(group, mg, k_total)
    panels = [np.ascontiguousarray(per_group[:, j:j + nr].transpose(0, 2, 1)).reshape(group, -1)
              for j in range(0, mg, nr)]
    return np.ascontiguousarray(np.concatenate(panels, axis=1).reshape(-1))


class _Target:
    """Where the kernel stores its tiles: `buffer + offset`, a column (channel) `ldc` apart;
    the epilogue it applies in registers and its operands at the tile."""

    def __init__(self, buffer: str, offset: Expr, ldc: int, epilogue: TileEpilogue,
                 operands: tuple[tuple[str, Expr], ...]):
        self.buffer, self.offset, self.ldc = buffer, offset, ldc
        self.epilogue, self.operands = epilogue, operands


def _output(ctx: StageCtx, ops: ConvOperands, shape: tuple[int, ...], uk: MicroKernel,
            at: tuple[Expr, Expr, Expr]) -> tuple[_Target, str | None]:
    """The output itself with the epilogue in registers, when `register_epilogue` takes it
    into one store contiguous along the pixels; else a scratch of raw sums in the output's
    layout (its name returned too) for `epilogue_pass`."""
    n, m, i = at
    channels, pixels = shape[1], math.prod(shape[2:])
    stored = _register_store(ctx, ops, shape)
    if stored is not None:
        found, ldc, (pi, pj, pb) = stored
        mapping = {pi: i, pj: m, pb: n}
        epilogue = found.epilogue or TileEpilogue(("total",), ())
        return _Target(found.store.buffer, substitute(found.store.offset, mapping), ldc,
                       epilogue, found.operands_at(mapping)), None
    sums = ctx.scratch(ops.acc_dtype, math.prod(shape))
    offset = add(mul(add(mul(n, channels), m), pixels), i)
    return _Target(sums, offset, pixels, TileEpilogue(("total",), ()), ()), sums


def _register_store(ctx: StageCtx, ops: ConvOperands, shape: tuple[int, ...]):
    """(the register epilogue, the output's channel stride, its axes (pixel, channel, image))
    when `register_epilogue` takes the results into one store contiguous along the pixels;
    else None."""
    channels, pixels = shape[1], math.prod(shape[2:])
    pi, pj, pb = ctx.var("i", pixels), ctx.var("j", channels), ctx.var("pb", shape[0])
    total = array_load(ctx.name("sum"), ops.acc_dtype, iconst(0))
    flat = add(mul(add(mul(pb, channels), pj), pixels), pi)
    found = register_epilogue(ctx.results({0: (Index(shape, flat=flat), ops.finish(total, pj))}),
                              total, (pi, pj, pb), rows_cross_batches=False)
    if found is None:
        return None
    probe = load(found.store.buffer, ops.acc_dtype, found.store.offset)
    ldc = stride_of(probe, pj)
    if stride_of(probe, pi) == 1 and ldc is not None and ldc >= pixels:
        return found, ldc, (pi, pj, pb)
    return None


def stores_in_registers(ctx: StageCtx, ops: ConvOperands) -> bool:
    """Whether the pixel-rows kernel applies the conv's bias and epilogue in registers and
    stores its tiles straight into the output (else the raw sums take a pass of their own)."""
    try:
        return _register_store(ctx, ops, ctx.out().shape) is not None
    except Refused:  # the fused epilogue refuses this index form: the lowering will say so
        return False


def epilogue_pass(ctx: StageCtx, ops: ConvOperands, sums: str, pixels: int) -> None:
    """The bias and the fused epilogue over the raw sums, one vector loop along each plane."""
    out = ctx.out()
    planes = out.numel // pixels
    p, x = ctx.var("p", planes), ctx.var("x", pixels)
    total = ops.finish(load(sums, ops.acc_dtype, add(mul(p, pixels), x)),
                       modulo(p, out.shape[1]))
    stores = ctx.results({0: (Index(out.shape, flat=add(mul(p, pixels), x)), total)})
    ctx.stage(f"bias and epilogue of {ctx.op.id}",
              [ir.Loop(p, iconst(0), iconst(planes), [ir.Loop(x, iconst(0), iconst(pixels),
                                                               stores, simd=True)],
                       parallel=1)], out.numel)

