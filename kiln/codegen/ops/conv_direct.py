"""Direct 2-D convolution as a GEMM that reads its B operand in place: no materialised im2col.

The input of each (image, group) is copied once, zero-padded, into scratch, split into the stride
phases its taps read: phase (py, px) holds padded rows py, py + sh, … and columns px, px + sw, …
as a grid of `hq` × `wq`. An output pixel (oy, ox) is numbered j = oy·wq + ox over that grid's
width, so tap (ky, kx) of input channel c reads element j + offset(c, ky, kx) of the copy: for a
fixed (c, ky, kx) the pixels' inputs are contiguous, whatever the stride. The convolution is then
C[m, j] = Σ_(c,ky,kx) W[m, c, ky, kx] · copy[offset(c, ky, kx) + j], a GEMM whose B row k starts
at a compile-time offset: the packed weights are the A panels, and the indirect micro-kernel
(`kiln.codegen.microkernel`) reads B row k at `copy + rows[k]` straight from the padded input.

The columns ox ≥ ow of each grid row are computed and dropped (wq − ow of them per row: a few per
cent at 56 × 56, more on 7 × 7 images); the last, partial panel of pixels runs a kernel of just
its vectors. Each finished cache block's valid pixels go through the fused epilogue from L2, one
output row at a time. The copy is about the input's size (im2col's is kh·kw times it), and its
loop evaluates a fused input prologue once per element.

Each task copies the window of the grid it reads itself, per slice of the sum (the slice's
channels, the grid rows of its pixels and the taps' reach below them), into a local array, when
that fits `TASK_COPY_BYTES`: a stage copying the whole input first leaves a large image's copy in
memory (a stride-2 conv from 112 × 112 × 128: 6.6 MB), and its B rows, each a stream of its own
(channels × phases × rows of the taps), miss the caches there. On Zen 3 that conv (2 groups of
64) took 0.8× the time with the tasks' copies; a halo of rows is copied twice.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    BOOL,
    Expr,
    add,
    array_load,
    binary,
    clamp,
    const,
    floordiv,
    iconst,
    imax,
    imin,
    index_compare,
    logical_and,
    mul,
    select,
    sub,
    walk,
)
from kiln.codegen.gemm.blocking import Blocking, blocking, round_up
from kiln.codegen.gemm.packed import TASK_COPY_BYTES, micro_kernel, stores_bound
from kiln.codegen.gemm.packing import OperandSide, constant_panels, scratch_panels
from kiln.codegen.gemm.spec import BOperand, Contraction, batch_of
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import MicroKernel, same_work_tiles
from kiln.codegen.ops.conv_window import ConvOperands, Window



@dataclass(frozen=True)
class PhaseGrid:
    """Where the padded, phase-split copy keeps each element, per (image, group) segment of
    `segment` elements: channel c, phase p, row r, column q at ((c·phases + p)·hq + r)·wq + q."""

    phases: tuple[tuple[int, int], ...]  # (row phase, column phase) that some tap reads
    hq: int
    wq: int
    channels: int
    segment: int  # elements per (image, group), the tail past the last channel zeroed

    @property
    def channel_stride(self) -> int:
        return len(self.phases) * self.hq * self.wq


def _phase_grid(w: Window, channels: int, nr: int, plane_rows: int = 0
                ) -> tuple[PhaseGrid, np.ndarray]:
    """The copy's layout and the row-offset table: offset of (c, ky, kx), flattened like the
    weights' (c, ky, kx), plus the pixel j it is added to. `plane_rows`: planes of so many grid
    rows (a task's window of the grid) instead of the whole grid's."""
    (oh, ow), (kh, kw) = w.out_size, w.kernel
    (sh, sw), (dh, dw) = w.strides, w.dilations
    rows_needed = (oh - 1) * sh + (kh - 1) * dh + 1
    cols_needed = (ow - 1) * sw + (kw - 1) * dw + 1
    hq, wq = plane_rows or -(-rows_needed // sh), -(-cols_needed // sw)
    taps = [(ky, kx) for ky in range(kh) for kx in range(kw)]
    phases = tuple(sorted({((ky * dh) % sh, (kx * dw) % sw) for ky, kx in taps}))
    plane = hq * wq
    tap_offsets = np.array([phases.index(((ky * dh) % sh, (kx * dw) % sw)) * plane
                            + (ky * dh) // sh * wq + (kx * dw) // sw for ky, kx in taps])
    channel_stride = len(phases) * plane
    rows = (np.arange(channels)[:, None] * channel_stride + tap_offsets[None, :]).reshape(-1)
    pixels = round_up(oh * wq, nr)
    segment = round_up(max(channels * channel_stride, int(rows.max()) + pixels), 16)
    return PhaseGrid(phases, hq, wq, channels, segment), rows.astype(np.int32)


def direct_columns(w: Window, nr: int) -> int:
    """The direct conv's GEMM columns: output rows × the phase grid's width, in whole panels of
    `nr` (the grid's columns past the output's are computed and dropped)."""
    grid, _ = _phase_grid(w, 1, nr)
    return round_up(w.out_size[0] * grid.wq, nr)


def computed_columns(n: int, nr: int, lanes: int) -> int:
    """The columns `n` pixels cost in panels of `nr`: the last, partial panel runs a kernel of
    just its vectors."""
    return n // nr * nr + round_up(n % nr, lanes)


def direct_tile(base: MicroKernel, w: Window, channels_out: int) -> MicroKernel:
    """The indirect micro-kernel's shape. Of the tiles with as many accumulators as the target's
    `base` tile (as many FMAs per step of the sum), no more loads per step (`mr` broadcasts and
    `nr / lanes` vectors: the FMAs stay the bound) and room in the register file, the one whose
    tiles hold the fewest products: the output channels rounded up to `mr`, the phase grid's
    pixels to `nr`, the last panel's to whole vectors (`computed_columns`). On a stem's 64
    output channels 12 rows waste an eighth of the work, 8 rows none. Ties go to `base` (6 × 64
    measured no faster than 12 × 32 on as many products)."""
    grid, _ = _phase_grid(w, 1, 1)
    pixels = w.out_size[0] * grid.wq
    mr, nr = min(same_work_tiles(base),
                 key=lambda t: (round_up(channels_out, t[0])
                                * computed_columns(pixels, t[1], base.lanes),
                                t != (base.mr, base.nr)))
    return MicroKernel(base.dtype, mr, nr, base.vector_bytes, indirect=True)


def direct_applies(ctx: StageCtx, w: Window, acc_dtype: str) -> bool:
    """A 2-D float convolution on a target with GEMM micro-kernels, small enough for int32
    row offsets. Not on a GPU (work-group tiled GEMMs): there the implicit GEMM's copy into local
    memory reads the input through the im2col index map, which needs no padded copy."""
    s = ctx.schedule
    return (len(w.kernel) == 2 and acc_dtype in ("float32", "float64") and s.vector_bytes > 0
            and s.gemm_work_group == 0
            and ctx.graph.tensors[ctx.op.inputs[0]].numel < 2 ** 30)


def _copy_input(ctx: StageCtx, w: Window, grid: PhaseGrid, ops: ConvOperands,
                in_shape: tuple[int, ...], group: int, dtype: str) -> str:
    """The zero-padded, phase-split copy of the input, one parallel loop over (image, group,
    channel, row), a vector loop over each phase's columns; the segments' tails are zeroed."""
    segments = in_shape[0] * group
    name = ctx.scratch(dtype, segments * grid.segment)
    q = ctx.var("q", segments * grid.channels * grid.hq)
    b, c, r = Index((segments, grid.channels, grid.hq), flat=q).dims

    def store(p: int, u: Expr, value: Expr) -> ir.Stmt:
        at = add(mul(b, grid.segment),
                 mul(add(mul(add(mul(c, len(grid.phases)), p), grid.hq), r), grid.wq), u)
        return ir.Store(name, at, value)

    body = _phase_rows(ctx, w, grid, ops, in_shape, dtype, (b, group), (c, r), store)
    loops = [ir.Loop(q, iconst(0), iconst(segments * grid.channels * grid.hq), body, parallel=1,
                     grain="chunks")]
    used = grid.channels * grid.channel_stride
    if grid.segment > used:
        t = ctx.var("t", segments * (grid.segment - used))
        tb, tu = Index((segments, grid.segment - used), flat=t).dims
        loops.append(ir.Loop(t, iconst(0), iconst(segments * (grid.segment - used)),
                             [ir.Store(name, add(mul(tb, grid.segment), used, tu),
                                       const(0, dtype))]))
    ctx.stage(f"pad input of {ctx.op.id} into stride phases", loops,
              segments * grid.segment)
    return name


def _phase_rows(ctx: StageCtx, w: Window, grid: PhaseGrid, ops: ConvOperands,
                in_shape: tuple[int, ...], dtype: str, image_group: tuple[Expr, int],
                channel_row: tuple[Expr, Expr],
                store: Callable[[int, Expr, Expr], ir.Stmt]) -> list[ir.Stmt]:
    """One vector loop per phase over the columns of one row of the phase grid: the input's
    value there, or 0 in the padding, given to `store(phase, column, value)`. `image_group` =
    (image·group index, groups), `channel_row` = (channel within the group, grid row)."""
    batch, channels = in_shape[:2]
    b, group = image_group
    c, r = channel_row
    n, g = floordiv(b, group), sub(b, mul(floordiv(b, group), group))
    (sh, sw), (ph, pw), (ih, iw) = w.strides, w.pad_begin, w.in_size
    loops: list[ir.Stmt] = []
    for p, (py, px) in enumerate(grid.phases):
        u = ctx.var("u", grid.wq)
        y, x = sub(add(mul(r, sh), py), ph), sub(add(mul(u, sw), px), pw)
        inside = logical_and(logical_and(index_compare("ge", y, 0), index_compare("lt", y, ih)),
                             logical_and(index_compare("ge", x, 0), index_compare("lt", x, iw)))
        value = ops.once(Index((batch, channels, ih, iw),
                               dims=[n, add(mul(g, grid.channels), c), clamp(y, 0, ih - 1),
                                     clamp(x, 0, iw - 1)]))
        loops.append(ir.Loop(u, iconst(0), iconst(grid.wq),
                             [store(p, u, select(inside, value, const(0, dtype)))],
                             simd=True))
    return loops


def direct_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                group: int, in_shape: tuple[int, ...], im2col: BOperand) -> None:
    """The convolution as an indirect GEMM per (image, group) over the padded copy (module
    docstring). `ops` is how the conv reads its operands (`kiln.codegen.ops.conv.ConvOperands`),
    `im2col` its B operand as a plain contraction would read it (what the copy and the row
    offsets stand for)."""
    s = ctx.schedule
    out, dtype = ctx.out(), ops.acc_dtype
    batch, channels = out.shape[0], in_shape[1]
    cg, mg = channels // group, w_shape[0] // group
    (oh, ow), taps = w.out_size, math.prod(w.kernel)
    uk = direct_tile(micro_kernel(ctx, dtype), w, mg)
    grid, row_offsets = _phase_grid(w, cg, uk.nr)
    pixels, k_total = round_up(oh * grid.wq, uk.nr), cg * taps

    def a_at(bi: Index, i: Expr, k: Expr) -> Expr:
        (g,) = bi.dims
        return ops.read_w(Index(w_shape, flat=add(mul(add(mul(g, mg), i), k_total), k)))

    spec = Contraction((batch, group), mg, pixels, k_total, (group,), (batch, group), a_at,
                       im2col, lambda b, i, j: Index(out.shape, flat=j),
                       lambda total, b, i, j: total, dtype)
    side = OperandSide("a", a_at, (group,), mg)
    packed_a = constant_panels(ctx, spec, side, uk.mr) or scratch_panels(ctx, spec, side, uk.mr)

    bt = batch * group
    window_name = ctx.name("xw")
    itemsize = np.dtype(dtype).itemsize
    nc = _block_columns(ctx, k_total, mg, bt * mg * oh * ow * itemsize, itemsize)

    def split(balance: bool) -> tuple[Blocking, int, TaskWindow, bool]:
        blk = blocking(mg, pixels, k_total, bt, uk, s.gemm_mc, nc, s.gemm_kc, balance=balance)
        tasks = bt * -(-mg // blk.mc) * -(-pixels // blk.nc)
        window = _task_window(window_name, w, grid, blk, taps, k_total)
        return (blk, tasks, window,
                copied_by_tasks(window, tasks * -(-k_total // blk.kc), grid, bt * cg, dtype))

    blk, tasks, window, by_tasks = balanced_split(split, bt * mg * pixels * k_total)
    row_blocks, col_blocks = -(-mg // blk.mc), -(-pixels // blk.nc)
    k_blocks = -(-k_total // blk.kc)
    if by_tasks:
        copy, segment, offsets = window.name, 0, window.row_offsets
    else:
        copy, segment = _copy_input(ctx, w, grid, ops, in_shape, group, dtype), grid.segment
        offsets = row_offsets
    rows = ctx.derived(offsets)
    p = ctx.var("p", tasks)
    b, rb, cb = Index((bt, row_blocks, col_blocks), flat=p).dims
    i0, j0 = mul(rb, blk.mc), mul(cb, blk.nc)
    tile = ctx.name("ct")
    row_panels = imin(iconst(blk.mc // uk.mr), floordiv(sub(iconst(mg + uk.mr - 1), i0), uk.mr))
    col_panels = imin(iconst(blk.nc // uk.nr), floordiv(sub(iconst(pixels), j0), uk.nr))
    kb, k0, kc, ip, jp, i_lo, j_lo = slice_tiles(ctx, blk, uk, k_total, i0, j0)
    first_row = floordiv(j0, grid.wq)  # of the grid, in the task's window
    b_at = sub(j_lo, mul(first_row, grid.wq)) if by_tasks else add(mul(b, segment), j_lo)

    def call(kernel: MicroKernel) -> ir.MicroKernelCall:
        return ir.MicroKernelCall(
            kernel, kc, packed_a.buffer,
            packed_a.offset(batch_of(spec, b, (group,)).flat, k0, i_lo),
            copy, b_at, 0, tile,
            add(mul(ip, uk.mr * blk.nc), mul(jp, uk.nr)), blk.nc,
            index_compare("gt", kb, 0) if k_blocks > 1 else const(False, BOOL), rows, k0)

    # the last, partial panel of pixels runs a kernel of just its vectors
    full = oh * grid.wq // uk.nr * uk.nr
    edge = (computed_columns(oh * grid.wq, uk.nr, uk.lanes) - full) % uk.nr
    update: ir.Stmt = call(uk)
    if edge:
        update = ir.If(index_compare("lt", j_lo, full), [update], [call(replace(uk, nr=edge))])
        ctx.info["column_edge_kernel"] = f"{uk.mr}x{edge}"
    # the epilogue runs once per block, not per micro-tile: a micro-tile's nr pixels are split
    # across output rows into runs too short for a vector loop (a SiLU's exp ran in scalar code)
    epilogue = _epilogue(ctx, w, grid, ops, tile, blk.nc, (b, i0, j0),
                         (mul(row_panels, uk.mr), mul(col_panels, uk.nr)), mg, group)
    if k_blocks > 1:
        epilogue = ir.If(index_compare("eq", kb, k_blocks - 1), [epilogue])
    compute = ir.Loop(jp, iconst(0), col_panels, [ir.Loop(ip, iconst(0), row_panels, [update])])
    per_slice: list[ir.Stmt] = [compute, epilogue]
    body: list[ir.Stmt] = [ir.DeclArray(tile, dtype, blk.mc * blk.nc)]
    if by_tasks:
        body.append(ir.DeclArray(copy, dtype, window.elements))
        per_slice[:0] = _copy_window(ctx, w, grid, window, ops, in_shape, group, dtype,
                                     (b, first_row, k0), (blk.kc, k_total, taps))
        ctx.info["input_copy"] = "by the tasks"
    body.append(ir.Loop(kb, iconst(0), iconst(k_blocks), per_slice))
    ctx.stage(f"conv ({ctx.op.id}), direct over the padded input",
              [ir.Loop(p, iconst(0), iconst(tasks), body, parallel=1,
                       grain=s.task_grain)],
              bt * mg * pixels * k_total)
    ctx.info.update(form="direct GEMM", micro_kernel=f"{uk.mr}x{uk.nr}", mc=blk.mc, nc=blk.nc,
                    kc=blk.kc, tasks=tasks, grid=f"{len(grid.phases)}x{grid.hq}x{grid.wq}")


def _block_columns(ctx: StageCtx, k_total: int, channels: int, output_bytes: int,
                   itemsize: int) -> int:
    """The pixels per block to start the split from: the schedule's, or where storing the
    results bounds the conv (`stores_bound`: a stem's 3 × 3 × 3 taps), as many as a block's sums
    fill a quarter of L2 with (the block's epilogue then stores each channel's pixels in one long
    run, not a tile's width per output row: `kiln.codegen.gemm.packed._streaming`). On the
    AVX-512 Xeon, MobileNetV2's stem (3 to 32 channels, stride 2, 224 × 224) took 0.7× the time
    with blocks of 2016 pixels as with 288 (a standalone harness, 2 threads)."""
    s = ctx.schedule
    if not stores_bound(s, k_total, output_bytes):
        return s.gemm_nc
    return max(s.gemm_nc, s.gemm_l2_bytes // 4 // (min(channels, s.gemm_mc) * itemsize))


# The tasks copy their windows of the input themselves while that copies at most this many times
# the elements of one copy of the whole input (rows of the grid next to a task's pixels are
# copied again, and each block of output channels copies its window again): on Zen 3 grouped
# 3 × 3 convs took 0.8–0.96× the time at 1.2–1.9 times the elements (stride 2 from 112 × 112,
# 56 × 56, 28 × 28 and 14 × 14; stride 1 on 28 × 28 and 14 × 14); 1.0–1.2× at 2.1 (stride 1 on
# 56 × 56) and 1.0–1.07× at 3.2 and 5.1 (ResNet-50's stride-2 convs, 2 and 3 blocks of rows).
TASK_COPY_SHARE = 2


# The fewest products a task of a balanced split may keep (`balanced_split`).
MIN_BALANCED_TASK_PRODUCTS = 1 << 21


def balanced_split(split: Callable[[bool], tuple[Blocking, int, TaskWindow, bool]],
                   products: int) -> tuple[Blocking, int, TaskWindow, bool]:
    """`split(balance)` = (blocking, tasks, task window, whether the tasks copy their windows)
    with tasks that split evenly over 2, 4, … threads (`blocking`'s `balance`, as the packed
    GEMM's), unless only the unbalanced split lets the tasks copy their own windows of the input
    (more, smaller tasks copy more of it again) or the balanced tasks would each keep fewer than
    `MIN_BALANCED_TASK_PRODUCTS` of the conv's `products`. On AVX-512 ResNet-50's 1 × 1 conv of
    stride 2 from 28 × 28 went from 11 tasks to 22 and its 3 × 3 ones onto 7 × 7 (pixels as
    rows) from 11 to 22, 7M products each: by their tiles' work, 94% of 2 threads' time busy
    before, 98-99% after (89% and 95-96% at 4 threads); at 1 thread the CPU time stayed within
    noise (0.97-1.04×). LeViT-128's 3 × 3 stem convs of stride 2 would have gone from 9 and 10
    tasks to 68 and 40 of 0.1-0.2M products: the first took 1.45× the time at 2 threads."""
    balanced = split(True)
    if products < MIN_BALANCED_TASK_PRODUCTS * balanced[1]:
        return split(False)
    if balanced[3]:
        return balanced
    unbalanced = split(False)
    return unbalanced if unbalanced[3] else balanced


def slice_tiles(ctx: StageCtx, blk: Blocking, uk: MicroKernel, k_total: int, i0: Expr,
                j0: Expr) -> tuple[Expr, Expr, Expr, Expr, Expr, Expr, Expr]:
    """A task's loop variables over its block from row `i0` and column `j0`: the slice of the
    sum `kb`, its start `k0` and length `kc` (the last may be shorter), the micro-tile panels
    `ip`, `jp` and the first row `i_lo` and column `j_lo` of the tile they point at."""
    kb = ctx.var("kb", -(-k_total // blk.kc))
    k0 = mul(kb, blk.kc)
    kc = (iconst(blk.kc) if k_total % blk.kc == 0
          else imin(iconst(blk.kc), sub(iconst(k_total), k0)))
    ip, jp = ctx.var("ip", blk.mc // uk.mr), ctx.var("jp", blk.nc // uk.nr)
    return kb, k0, kc, ip, jp, add(i0, mul(ip, uk.mr)), add(j0, mul(jp, uk.nr))


@dataclass(frozen=True)
class TaskWindow:
    """A task's copy of the padded, phase-split input: for each slice of the sum, the channels
    its rows read, each as planes of the `plane_rows` grid rows from the task's first one (all
    its pixels read), in the layout of `PhaseGrid`; row offsets relative to the slice's first
    channel."""

    name: str
    plane_rows: int
    channels: int  # the most channels a slice of the sum reads
    channel_stride: int
    elements: int
    row_offsets: np.ndarray


def copied_by_tasks(window: TaskWindow, copies: int, grid: PhaseGrid, planes: int,
                    dtype: str) -> bool:
    """Whether the tasks copy their own windows (`copies` of them: tasks × slices of the sum)
    instead of a stage copying the input (`planes` channel planes of `grid`) first: a window
    within `TASK_COPY_BYTES`, and all of them together at most `TASK_COPY_SHARE` times the
    input."""
    return (window.elements * np.dtype(dtype).itemsize <= TASK_COPY_BYTES
            and copies * window.channels * window.channel_stride
            <= TASK_COPY_SHARE * planes * grid.channel_stride)


def _task_window(name: str, w: Window, grid: PhaseGrid, blk: Blocking, taps: int,
                 k_total: int, output_rows: int = 0) -> TaskWindow:
    """The window of the copy a task of `blk.nc` grid pixels reads per slice of `blk.kc`: from
    pixel j0 − (j0 mod wq) of its first grid row, up to nc + wq pixels plus the taps' largest
    row shift (and a column shift under wq) below. A row of B past a plane's end reads the next
    plane (or the tail) only for pixels dropped from the output. `output_rows`: a task's pixels
    span at most so many grid rows (instead of those nc pixels from any column can)."""
    (kh, _), (sh, _), (dh, _) = w.kernel, w.strides, w.dilations
    wq = grid.wq
    spanned = output_rows or (blk.nc + 2 * wq - 2) // wq + 1
    plane_rows = spanned + (kh - 1) * dh // sh
    window, offsets = _phase_grid(w, grid.channels, 1, plane_rows)
    slices = range(0, k_total, blk.kc)
    first = np.array([k0 // taps for k0 in slices])
    channels = max((min(k_total, k0 + blk.kc) - 1) // taps - k0 // taps + 1 for k0 in slices)
    relative = offsets - np.repeat(first, blk.kc)[:k_total] * window.channel_stride
    elements = channels * window.channel_stride + blk.nc + wq
    return TaskWindow(name, plane_rows, channels, window.channel_stride, elements,
                      relative.astype(np.int32))


def _copy_window(ctx: StageCtx, w: Window, grid: PhaseGrid, window: TaskWindow,
                 ops: ConvOperands, in_shape: tuple[int, ...], group: int, dtype: str,
                 at: tuple[Expr, Expr, Expr], sum_slices: tuple[int, int, int]) -> list[ir.Stmt]:
    """The loops that fill a task's window (`_task_window`) for the slice of the sum from k0:
    `at` = (image·group, first grid row, k0), `sum_slices` = (kc, K, taps)."""
    b, first_row, k0 = at
    kc, k_total, taps = sum_slices
    c0 = floordiv(k0, taps)
    count = sub(add(floordiv(sub(imin(iconst(k_total), add(k0, kc)), 1), taps), 1), c0)
    c = ctx.var("c", window.channels)
    r = ctx.var("r", window.plane_rows)

    def store(p: int, u: Expr, value: Expr) -> ir.Stmt:
        slot = add(mul(add(mul(add(mul(c, len(grid.phases)), p), window.plane_rows), r),
                       grid.wq), u)
        return ir.ArrayStore(window.name, slot, value)

    stores = _phase_rows(ctx, w, grid, ops, in_shape, dtype, (b, group),
                         (add(c0, c), add(first_row, r)), store)
    # past the slice's channels, zeros: the dropped pixels' reads stay finite
    t = ctx.var("t", window.elements)
    tail = ir.Loop(t, mul(count, window.channel_stride), iconst(window.elements),
                   [ir.ArrayStore(window.name, t, const(0, dtype))], simd=True)
    return [ir.Loop(c, iconst(0), count, [ir.Loop(r, iconst(0), iconst(window.plane_rows),
                                                  stores)]), tail]


def _epilogue(ctx: StageCtx, w: Window, grid: PhaseGrid, ops: ConvOperands, tile: str,
              ldc: int, block: tuple[Expr, Expr, Expr], extent: tuple[Expr, Expr], mg: int,
              group: int) -> ir.Loop:
    """The valid pixels of the block (image·group b, first channel i0, first grid pixel j0) of
    `extent` = (channels, grid pixels), held in `tile` rows `ldc` apart, through the fused
    epilogue: per channel, the grid rows its pixels touch, and in each the columns below ow."""
    out = ctx.out()
    (oh, ow), wq = w.out_size, grid.wq
    b, i0, j0 = block
    n, g = floordiv(b, group), sub(b, mul(floordiv(b, group), group))
    i, oy, ox = ctx.var("i", mg), ctx.var("y", oh), ctx.var("x", ow)
    j_hi = add(j0, extent[1])
    y_lo = floordiv(j0, wq)
    y_hi = imin(floordiv(add(j_hi, wq - 1), wq), iconst(oh))
    x_lo = imax(sub(j0, mul(oy, wq)), iconst(0))
    x_hi = imin(sub(j_hi, mul(oy, wq)), iconst(ow))
    m = add(mul(g, mg), i)
    slot = add(mul(sub(i, i0), ldc), sub(add(mul(oy, wq), ox), j0))
    total = array_load(tile, ops.acc_dtype, slot)
    stores = ctx.results({0: (Index(out.shape, dims=[n, m, oy, ox]), ops.finish(total, m))})
    columns = ir.Loop(ox, x_lo, x_hi, stores, simd=True)
    return ir.Loop(i, i0, imin(add(i0, extent[0]), iconst(mg)),
                   [ir.Loop(oy, y_lo, y_hi, [columns])])


PLANE_BYTES = 1 << 18  # a depthwise plane's padded copy and sums live on the stack up to this
REGISTERS = 32  # vector registers on AVX-512 and NEON (AVX2 has 16: it spills a little sooner)


def calls_function(stmts: list[ir.Stmt]) -> bool:
    """Whether the statements call a function (a transcendental: exp, tanh, …)."""
    return any(e.op == "call" for e in walk(ir.all_exprs(stmts)))


def depthwise_plane_applies(ctx: StageCtx, w: Window, x_channels: int, group: int,
                            acc_dtype: str) -> bool:
    """A 2-D float conv whose output channels each read one input channel, with planes small
    enough for the stack."""
    if len(w.kernel) != 2 or x_channels // group != 1 or acc_dtype not in ("float32", "float64"):
        return False
    grid, _ = _phase_grid(w, 1, 1)
    itemsize = np.dtype(acc_dtype).itemsize
    return (grid.segment + w.out_size[0] * grid.wq) * itemsize <= PLANE_BYTES


def depthwise_plane(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                    group: int, in_shape: tuple[int, ...]) -> None:
    """A depthwise conv (any channel multiplier), parallel over (image, output channel) planes.
    Per plane, the input plane is copied zero-padded and split into stride phases on the stack
    (as `direct_conv`'s copy, one channel), so every tap of every output pixel reads inside it:
    one vector loop over the pixels of the grid, j = oy·wq + ox, sums all kh·kw taps at
    j + offset(tap) with no border cases and contiguous reads at any stride. The fused epilogue
    then runs over each output row's ow valid pixels (over the whole plane, its rows packed
    densely first, when they are narrower than two vectors or, under an epilogue that calls a
    function, not a whole number of vectors); rows of two vectors or more under an epilogue
    with no call skip the plane of sums, each row's window sums stored through the epilogue at
    once."""
    out, dtype = ctx.out(), ops.acc_dtype
    batch, m_total = out.shape[0], out.shape[1]
    mg = m_total // group
    (oh, ow), (kh, kw) = w.out_size, w.kernel
    (sh, sw), (ph, pw), (ih, iw) = w.strides, w.pad_begin, w.in_size
    grid, offsets = _phase_grid(w, 1, 1)
    p = ctx.var("p", batch * m_total)
    n, m = Index((batch, m_total), flat=p).dims
    channel = floordiv(m, mg)
    plane, sums = ctx.name("plane"), ctx.name("sums")

    def element(r: Expr, u: Expr, py: int, px: int) -> Expr:
        y, x = sub(add(mul(r, sh), py), ph), sub(add(mul(u, sw), px), pw)
        inside = logical_and(logical_and(index_compare("ge", y, 0), index_compare("lt", y, ih)),
                             logical_and(index_compare("ge", x, 0), index_compare("lt", x, iw)))
        value = ops.once(Index(in_shape, dims=[n, channel, clamp(y, 0, ih - 1),
                                                 clamp(x, 0, iw - 1)]))
        return select(inside, value, const(0, dtype))

    # the column phases of one row phase in one loop (its reads are one contiguous run), and
    # the row phases of one grid row in one pass: the input's rows are read in order, once
    r = ctx.var("r", grid.hq)
    rows: list[ir.Stmt] = []
    for py in sorted({py for py, _ in grid.phases}):
        u = ctx.var("u", grid.wq)
        stores = [ir.ArrayStore(plane, add(mul(add(mul(iconst(phase), grid.hq), r), grid.wq), u),
                                element(r, u, py, px))
                  for phase, (qy, px) in enumerate(grid.phases) if qy == py]
        rows.append(ir.Loop(u, iconst(0), iconst(grid.wq), stores, simd=True))
    copy: list[ir.Stmt] = [ir.Loop(r, iconst(0), iconst(grid.hq), rows)]
    used = grid.channel_stride
    if grid.segment > used:
        t = ctx.var("t", grid.segment - used, used)
        copy.append(ir.Loop(t, iconst(used), iconst(grid.segment),
                            [ir.ArrayStore(plane, t, const(0, dtype))]))

    def window_sum(j: Expr, taps: list[int], total: Expr | None) -> Expr:
        for tap in taps:
            ky, kx = divmod(tap, kw)
            wv = ops.read_w(Index(w_shape, dims=[m, iconst(0), iconst(ky), iconst(kx)]))
            term = binary("mul", wv, array_load(plane, dtype, add(j, int(offsets[tap]))))
            total = term if total is None else binary("add", total, term)
        return total

    lanes = micro_kernel(ctx, dtype).lanes
    # a window with more taps than half the vector registers would spill its broadcast weights
    # (a load per tap besides the input's): then one pass over the sums per kernel row
    passes = [list(range(kh * kw))]
    if kh * kw > REGISTERS // 2:
        passes = [list(range(ky * kw, (ky + 1) * kw)) for ky in range(kh)]
    oy, ox = ctx.var("y", oh), ctx.var("x", ow)
    in_rows = ctx.results({0: (Index(out.shape, dims=[n, m, oy, ox]), ops.finish(
        window_sum(add(mul(oy, grid.wq), ox), passes[0], None), m))})
    if len(passes) == 1 and ow >= 2 * lanes and not calls_function(in_rows):
        # rows of two vectors or more under a cheap epilogue (ReLU6): each row's window sums
        # go through it straight to the output, with no plane of sums written and read back
        # (3 × 3 on 56 × 56 and 112 × 112 planes: 0.9× the time; rows of 56 on AVX-512, three
        # vectors and a half, 0.78× at stride 1 and 0.90× at stride 2; with a SiLU's exp in
        # the same loop it ran 1.1× slower, the weights and its constants past the registers)
        ctx.info["window_sums"] = "to the output"
        compute_and_store = [ir.Loop(oy, iconst(0), iconst(oh),
                                     [ir.Loop(ox, iconst(0), iconst(ow), in_rows, simd=True)])]
        _plane_stage(ctx, [ir.DeclArray(plane, dtype, grid.segment), *copy, *compute_and_store],
                     p, grid, kh * kw)
        return
    compute: list[ir.Stmt] = []
    for number, taps in enumerate(passes):
        j = ctx.var("j", oh * grid.wq)
        total = window_sum(j, taps, array_load(sums, dtype, j) if number else None)
        compute.append(ir.Loop(j, iconst(0), iconst(oh * grid.wq),
                               [ir.ArrayStore(sums, j, total)], simd=True))

    oy, ox = ctx.var("y", oh), ctx.var("x", ow)
    row_sum = array_load(sums, dtype, add(mul(oy, grid.wq), ox))
    arrays = [ir.DeclArray(plane, dtype, grid.segment), ir.DeclArray(sums, dtype, oh * grid.wq)]
    by_rows = ctx.results({0: (Index(out.shape, dims=[n, m, oy, ox]), ops.finish(row_sum, m))})
    if oh > 1 and (ow < 2 * lanes or (ow % lanes and calls_function(by_rows))):
        # rows under two vectors would run the epilogue mostly in scalar code, and each row's
        # remainder past its last whole vector runs there too: with a call in the epilogue (a
        # SiLU's exp) the rows' sums are first packed densely, then one vector loop runs over
        # the plane (5 × 5 SiLU on 28 × 28 planes: 0.9× the time; ReLU6 on them, 1.1×)
        dense, q = ctx.name("dense"), ctx.var("q", oh * ow)
        pack = ir.Loop(oy, iconst(0), iconst(oh), [ir.Loop(ox, iconst(0), iconst(ow), [
            ir.ArrayStore(dense, add(mul(oy, ow), ox), row_sum)], simd=True)])
        value = ops.finish(array_load(dense, dtype, q), m)
        stores = ctx.results({0: (Index(out.shape, flat=add(mul(p, oh * ow), q)), value)})
        epilogue = [pack, ir.Loop(q, iconst(0), iconst(oh * ow), stores, simd=True)]
        arrays.append(ir.DeclArray(dense, dtype, oh * ow))
    else:
        epilogue = [ir.Loop(oy, iconst(0), iconst(oh),
                            [ir.Loop(ox, iconst(0), iconst(ow), by_rows, simd=True)])]
    _plane_stage(ctx, [*arrays, *copy, *compute, *epilogue], p, grid, kh * kw)


def _plane_stage(ctx: StageCtx, body: list[ir.Stmt], p: Expr, grid: PhaseGrid, taps: int) -> None:
    """The depthwise conv's stage: `body` per (image, output channel) plane `p`."""
    out = ctx.out()
    planes = out.shape[0] * out.shape[1]
    ctx.stage(f"conv ({ctx.op.id}), depthwise over padded planes",
              [ir.Loop(p, iconst(0), iconst(planes), body, parallel=1, grain="chunks")],
              out.numel * taps)
    ctx.info.update(form="depthwise planes", grid=f"{len(grid.phases)}x{grid.hq}x{grid.wq}")
