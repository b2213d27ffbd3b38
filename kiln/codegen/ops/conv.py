"""Convolutions and pooling (Many-to-Many over sliding windows), any number of spatial dims.

Conv picks its loop nest from the shape:
* a 1×1, stride-1, unpadded, ungrouped conv is a matrix product (the contraction lowering);
* GEMM-sized convs (at least `conv_gemm_min_cout` output channels per group): 3×3 stride-1 ones
  on images of enough 2×2 tiles run as Winograd F(2×2, 3×3) (`conv_winograd`); other 2-D float
  ones as a direct conv, a GEMM that reads its B operand in place from a zero-padded,
  stride-phase-split copy of the input (`conv_direct`: no im2col; stems, strided and dilated
  convs included); the rest as an implicit GEMM whose B packing does the im2col;
* a 2-D conv whose direct kernel would waste many products on a small image (the phase grid's
  columns past the output's, the last panel's: 7 × 7 and 14 × 14, grouped or not), or read
  several stride phases for an image of at most 32 × 32 (strided 3 × 3s of several groups), runs
  as the direct kernel's mirror, output pixels as rows and channels in the vector lanes, reading
  the same padded copy in place (`conv_pixels`), when its cost model says so;
* a conv onto few pixels with many output channels (a late stage's 7 × 7 image, 1 × 1 or
  not) runs as the transposed GEMM instead, pixels as rows, when that wastes less of the
  micro-tile (`_pixels_as_rows`), a call-free epilogue applied as each result is stored,
  any other in a pass of its own along the pixels;
* depthwise 2-D convs over zero-padded planes on the stack (`conv_direct.depthwise_plane`), at
  any stride: reading the input in place at a stride cost more (deinterleaving shuffles, a
  scalar remainder per row) than copying it once; planes too large for the stack run with
  interior and border outputs split (`_depthwise_conv`);
* any other conv (few output channels per group, 1-D/3-D) as direct loops: parallel over
  (image, block of `conv_tile_cout` output channels, output rows); for each tile of
  `conv_tile_w` output columns, stack accumulators acc[channels][columns]; loops over input
  channel, kernel rows and kernel columns narrow their ranges to the valid input region (no
  per-element padding test), and the vectorised inner loop runs over output columns:
  acc[c][x] += w · X[.., x·stride + kx·dilation − pad].
A constant-zero Pad in front of the conv is folded into its padding; any other non-trivial input
prologue is evaluated where the input is copied, or packed into scratch once.

ConvTranspose gathers: each output element sums the input elements whose stride grid hits it;
Col2Im likewise sums the column entries of the blocks covering an image element (inline).
Pools run parallel over output rows: the pixels whose window lies inside the input along the last
dim as a vector loop over the whole window (unrolled), the others over their valid taps.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    INDEX,
    Expr,
    acc,
    add,
    array_load,
    binary,
    cast,
    clamp,
    const,
    floordiv,
    iconst,
    imax,
    imin,
    imul,
    index_compare,
    local,
    logical_and,
    make,
    modulo,
    mul,
    select,
    sub,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import InlineCtx, Refused, StageCtx
from kiln.codegen.ops.registry import inline, stage
from kiln.codegen.gemm.contraction import contraction
from kiln.codegen.gemm.spec import AOperand, BOperand, Contraction
from kiln.codegen.gemm.blocking import blocking, round_up
from kiln.codegen.gemm.packed import TASK_COPY_BYTES, least_padding_tile, micro_kernel
from kiln.codegen.ops.conv_channels import channel_lanes_applies, channel_lanes_conv
from kiln.codegen.ops.conv_direct import (
    calls_function,
    depthwise_plane,
    depthwise_plane_applies,
    direct_applies,
    direct_columns,
    direct_conv,
)
from kiln.codegen.ops.conv_pixels import (
    epilogue_pass,
    pixel_rows_applies,
    pixel_rows_conv,
    pixel_rows_wins,
    stores_in_registers,
)
from kiln.codegen.ops.conv_winograd import winograd_conv, winograd_tile_size
from kiln.codegen.ops.conv_window import (
    ConvOperands,
    Reader,
    Window,
    ceildiv,
    tap_position,
    valid_taps,
    window,
)
from kiln.ecg import Graph, Op


def _float_input(op: Op, graph: Graph) -> str | None:
    return None if graph.tensors[op.inputs[0]].dtype in FLOAT_TYPES else "floating-point input only"


# --- Conv -------------------------------------------------------------------------------------------
def _folded_pad(ctx: StageCtx) -> tuple[str, tuple[int, ...]]:
    """(tensor the conv reads, extra spatial begin padding): a constant-zero Pad producing the
    conv's input inside the block is folded into the conv's own padding."""
    x = ctx.op.inputs[0]
    pad = ctx.low.producer.get(x)
    if pad is None or pad.op_type != "Pad" or x in ctx.low.ready:
        return x, ()
    graph = ctx.graph
    rank = len(graph.tensors[x].shape)
    pads_in = pad.inputs[1] if len(pad.inputs) > 1 else None
    value_in = pad.inputs[2] if len(pad.inputs) > 2 else None
    axes_in = pad.inputs[3] if len(pad.inputs) > 3 else None
    if (pad.attrs.get("mode", "constant") != "constant" or pads_in is None or axes_in is not None
            or not graph.is_constant(pads_in)):
        return x, ()
    if value_in is not None and (not graph.is_constant(value_in)
                                 or graph.tensors[value_in].data.reshape(-1)[0] != 0):
        return x, ()
    pads = [int(v) for v in graph.tensors[pads_in].data.reshape(-1)]
    begin, end = pads[:rank], pads[rank:]
    if any(begin[:2]) or any(end[:2]) or any(v < 0 for v in pads):
        return x, ()
    return pad.inputs[0], tuple(begin[2:])


@stage("Conv", check=_float_input)
def _conv(ctx: StageCtx) -> None:
    out = ctx.out()
    read_w = ctx.reader(ctx.op.inputs[1])
    conv_stage(ctx, 1, lambda x, folded: ConvOperands(
        x, _reader_on_first_use(ctx, x), read_w, out.dtype,
        lambda total, m: _bias(ctx, 2, total, m), lambda index: ctx.builder.value(x, index)))


def _reader_on_first_use(ctx: StageCtx, tensor: str) -> Reader:
    """`ctx.reader(tensor)`, made (and its prologue packed, if it needs one) at the first read:
    a lowering that reads the input only through `ConvOperands.once` packs nothing."""
    made: list[Reader] = []

    def read(index: Index) -> Expr:
        if not made:
            made.append(ctx.reader(tensor))
        return made[0](index)
    return read


def conv_stage(ctx: StageCtx, weight: int, operands: Callable[[str, bool], ConvOperands]) -> None:
    """Lower a convolution whose input is `op.inputs[0]` and weight `op.inputs[weight]`;
    `operands(x, folded)` says how to read them (folded: a zero Pad before x was absorbed)."""
    x_shape, w_shape, out = ctx.tensor(0).shape, ctx.tensor(weight).shape, ctx.out()
    if out.numel == 0:
        return
    geometry = window(ctx.op, x_shape[2:], out.shape[2:], tuple(w_shape[2:]))
    group = ctx.attr("group", 1)
    pointwise = (all(k == 1 for k in geometry.kernel) and all(s == 1 for s in geometry.strides)
                 and not any(geometry.pad_begin) and not any(geometry.pad_end) and group == 1)
    if pointwise:
        _pointwise(ctx, w_shape, operands(ctx.op.inputs[0], False))
        return
    source, extra = _folded_pad(ctx) if ctx.op.op_type == "Conv" else (ctx.op.inputs[0], ())
    if extra:
        geometry = Window(ctx.graph.tensors[source].shape[2:], geometry.out_size, geometry.kernel,
                          geometry.strides, geometry.dilations,
                          tuple(a + b for a, b in zip(geometry.pad_begin, extra)), geometry.pad_end)
    ops = operands(source, bool(extra))
    if w_shape[0] // group >= ctx.schedule.conv_gemm_min_cout:
        in_shape = ctx.graph.tensors[ops.x].shape
        if tile := winograd_tile_size(ctx, geometry, group, ops.acc_dtype, in_shape[1]):
            winograd_conv(ctx, geometry, w_shape, ops, in_shape, tile)
        elif direct_applies(ctx, geometry, ops.acc_dtype):
            _direct_gemm(ctx, geometry, w_shape, ops, group, in_shape)
        else:
            _implicit_gemm(ctx, geometry, w_shape, ops, group)
    else:
        in_shape = ctx.graph.tensors[ops.x].shape
        if channel_lanes_applies(ctx, geometry, in_shape[1], group, w_shape[0], ops.acc_dtype):
            channel_lanes_conv(ctx, geometry, w_shape, ops, in_shape)
        elif (depthwise_plane_applies(ctx, geometry, in_shape[1], group, ops.acc_dtype)
                and not _tiny_rows_in_place(ctx, geometry, ops, in_shape[1], group)):
            depthwise_plane(ctx, geometry, w_shape, ops, group, in_shape)
        elif not _depthwise_conv(ctx, geometry, w_shape, ops, group):
            _direct_conv(ctx, geometry, w_shape, ops, group)


def _direct_gemm(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                 group: int, in_shape: tuple[int, ...]) -> None:
    """A 2-D float conv as a GEMM over the input in place or packed per call: the direct kernel
    with pixels as rows where it wastes less than the one with pixels as columns
    (`conv_pixels`); else the transposed GEMM with the im2col packed when few pixels waste the
    direct kernel's tiles (`_pixels_as_rows`); else a 1 × 1 conv (strided or padded) as the
    implicit GEMM: its im2col, packed per task, is the strided gather the direct kernel's copy
    of the input makes anyway, and the packed GEMM's tiles and in-register epilogue run on it
    (ResNet-50's 1 × 1 conv of stride 2 from 56 × 56 took 0.83× the time in the model, on
    Zen 4); else the direct kernel (`conv_direct`)."""
    mg = w_shape[0] // group
    if (pixel_rows_applies(ctx, w, mg, ops.acc_dtype)
            and pixel_rows_wins(ctx, w, mg, ops.acc_dtype, in_shape[1] // group,
                                ctx.out().shape[0] * group, stores_in_registers(ctx, ops))
            and pixel_rows_conv(ctx, w, w_shape, ops, group, in_shape)):
        return
    if _pixels_as_rows(ctx, ops.acc_dtype, mg, math.prod(w.out_size),
                       w_shape[1] * math.prod(w_shape[2:]), lambda nr: direct_columns(w, nr),
                       in_tiles=_by_pixels_in_tiles(ctx, ops, mg, math.prod(w.out_size))):
        _pixel_rows_gemm(ctx, w, w_shape, ops, group)
    elif all(k == 1 for k in w.kernel):
        _implicit_gemm(ctx, w, w_shape, ops, group)
    else:
        direct_conv(ctx, w, w_shape, ops, group, in_shape,
                    im2col(w, ops, in_shape, in_shape[1] // group))


def _implicit_gemm(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                   group: int) -> None:
    """The convolution as a matrix product per (image, group): rows are output channels (the
    weights, packed at compile time), columns output pixels, and the sum runs over (input
    channel, kernel taps). The input element of a (tap, pixel) pair — zero in the padding — is
    computed while packing the B operand (an implicit im2col, once per element), and results
    come out along pixels, the output's contiguous axis."""
    out = ctx.out()
    batch, channels = out.shape[0], ctx.graph.tensors[ops.x].shape[1]
    cg, mg = channels // group, w_shape[0] // group
    pixels = math.prod(w.out_size)
    taps = math.prod(w.kernel)
    in_shape = (batch, channels, *w.in_size)

    def a_at(bi: Index, i: Expr, k: Expr) -> Expr:
        (g,) = bi.dims
        return ops.read_w(Index(w_shape, flat=add(mul(add(mul(g, mg), i), cg * taps), k)))

    def out_index(b: Expr, i: Expr, j: Expr) -> Index:
        n, g = Index((batch, group), flat=b).dims
        return Index(out.shape, flat=add(mul(add(mul(n, group * mg), mul(g, mg), i), pixels), j))

    def finish(total: Expr, b: Expr, i: Expr, j: Expr) -> Expr:
        return ops.finish(total, add(mul(modulo(b, group), mg), i))

    contraction(ctx, Contraction((batch, group), mg, pixels, cg * taps, (group,), (batch, group),
                                 a_at, im2col(w, ops, in_shape, cg), out_index, finish,
                                 ops.acc_dtype))
    ctx.info["conv"] = "implicit GEMM"


def _pixels_as_rows(ctx: StageCtx, dtype: str, channels_out: int, pixels: int, reduction: int,
                    columns: Callable[[int], int], batch: int = 1, copied: bool = False,
                    in_tiles: bool = False) -> bool:
    """Whether a conv's GEMM does less work with the output pixels as its rows and the output
    channels as its columns than the other way round (`columns(nr)`: the pixels as that way
    lays them out, in whole panels of nr; `reduction`: the sum's length; `batch`: GEMMs per
    call). The micro-tile is mr × nr (6 × 16 on AVX2): a 7 × 7 image's 49 pixels fill 64
    columns, a quarter of the work wasted, but 54 rows. Pixels as rows pack the input's im2col
    once per call, about one micro-kernel cycle (2 FMAs of a vector: 2 × lanes products) per
    packed element, and each result costs two more: stored apart from its channel's
    neighbours, then read back by the epilogue's pass (`_by_pixels`); one with the epilogue in
    the GEMM's tiles (`in_tiles`: it calls no function), against the direct kernel (ResNet-50's
    1 × 1 conv of stride 2 from 28 × 28, in the model at 1 thread: 0.88× the time on AVX-512,
    0.90× built for AVX2; against the plain GEMM of a 1 × 1 conv of stride 1 the two cycles stay:
    with one, MobileNetV2's onto 14 × 14 took 1.04×). `copied`: the other way
    round, the input (B) is copied block by block by the GEMM's tasks, since its rows are not
    whole vectors (`kiln.codegen.gemm.packing.b_copied_by_tasks`; larger blocks than
    `TASK_COPY_BYTES` are packed once by a stage of their own): once per block of output
    channels, as many times as the task split makes such blocks (on a 14 × 14 or 7 × 7 image,
    with 2 threads, often as much work as the products)."""
    s = ctx.schedule
    if (dtype not in ("float32", "float64") or s.vector_bytes == 0 or s.gemm_work_group
            or pixels < s.gemm_min_m or channels_out < s.gemm_min_n):
        return False  # not a CPU's packed GEMM either way
    uk = micro_kernel(ctx, dtype)
    weights_uk = least_padding_tile(uk, channels_out)
    cycle = 2 * uk.lanes
    as_columns = round_up(channels_out, weights_uk.mr) * columns(weights_uk.nr) * reduction
    if copied:
        blk = blocking(channels_out, pixels, reduction, batch, weights_uk, s.gemm_mc, s.gemm_nc,
                       s.gemm_kc)
        if blk.kc * blk.nc * np.dtype(dtype).itemsize <= TASK_COPY_BYTES:
            as_columns += cycle * -(-channels_out // blk.mc) * reduction * columns(weights_uk.nr)
    as_rows = ((round_up(pixels, uk.mr) * round_up(channels_out, uk.nr) + cycle * pixels)
               * reduction + (1 if in_tiles else 2) * cycle * pixels * channels_out)
    return as_rows < as_columns


def _pixel_rows_gemm(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                     group: int) -> None:
    """The convolution as the transposed GEMM per (image, group): rows are output pixels (the
    input's im2col, packed per call), columns output channels (the weights, packed at compile
    time); each result goes to its channel's plane at its pixel."""
    out = ctx.out()
    batch, channels = out.shape[0], ctx.graph.tensors[ops.x].shape[1]
    cg, mg = channels // group, w_shape[0] // group
    pixels = math.prod(w.out_size)
    taps = math.prod(w.kernel)
    columns = im2col(w, ops, (batch, channels, *w.in_size), cg)

    def b_at(bi: Index, k: Expr, j: Expr) -> Expr:
        (g,) = bi.dims
        return ops.read_w(Index(w_shape, flat=add(mul(add(mul(g, mg), j), cg * taps), k)))

    _by_pixels(ctx, ops, (batch, group), (pixels, mg, cg * taps), ((batch, group), (group,)),
               lambda bi, i, k: columns(bi, k, i), b_at)
    ctx.info["conv"] = "implicit GEMM, pixels as rows"


def _by_pixels(ctx: StageCtx, ops: ConvOperands, batch: tuple[int, ...],
               sizes: tuple[int, int, int], operand_batches: tuple[tuple[int, ...], ...],
               a_at: AOperand, b_at: BOperand) -> None:
    """A conv as the GEMM per `batch` entry of `sizes` = (output pixels: rows, output channels
    of the entry: columns, sum), its operands' batch shapes `operand_batches`. A bias and an
    epilogue that call no function (ReLU, Clip, a residual added) run in the GEMM's tile
    epilogue, each result stored through them into its channel's plane (on Zen 3, CPU time of
    1 × 1 and strided 3 × 3 convs onto 14 × 14 and 7 × 7 with a ReLU: 0.77-1.02x at 2 threads,
    one parallel region and one pass over the output fewer; 0.93-1.1x, noisy, at 1). Else the
    raw sums go to scratch in the output's layout, then the bias and the epilogue run in one
    pass over the output, vectorised along its pixels: a micro-tile holds only `mr` pixels of a
    channel, too few for a vector loop (a SiLU's exp would run in scalar code)."""
    out = ctx.out()
    pixels, channels, reduction = sizes
    at, out_index, finish = _by_pixels_layout(ctx, ops, channels, pixels)
    if _call_free_epilogue(ctx, ops, out_index, finish):
        contraction(ctx, Contraction(batch, pixels, channels, reduction, *operand_batches, a_at,
                                     b_at, out_index, finish, ops.acc_dtype))
        return
    sums = ctx.scratch(ops.acc_dtype, out.numel)
    contraction(ctx, Contraction(
        batch, pixels, channels, reduction, *operand_batches, a_at, b_at,
        out_index, lambda total, b, i, j: total,
        ops.acc_dtype, store=lambda b, i, j, value: [ir.Store(sums, at(b, i, j), value)]))
    epilogue_pass(ctx, ops, sums, pixels)


def _by_pixels_in_tiles(ctx: StageCtx, ops: ConvOperands, channels: int, pixels: int) -> bool:
    """Whether `_by_pixels` would apply the bias and epilogue in the GEMM's tiles (entries of
    `channels` output channels by `pixels`)."""
    _, out_index, finish = _by_pixels_layout(ctx, ops, channels, pixels)
    try:
        return _call_free_epilogue(ctx, ops, out_index, finish)
    except Refused:  # the fused epilogue takes no results by pixels: nor would `_by_pixels`
        return False


def _by_pixels_layout(ctx: StageCtx, ops: ConvOperands, channels: int, pixels: int) -> tuple[
        Callable[[Expr, Expr, Expr], Expr], Callable[[Expr, Expr, Expr], Index],
        Callable[[Expr, Expr, Expr, Expr], Expr]]:
    """For the GEMM of batch entry b (pixel i, channel j of the entry's `channels`): the result's
    flat offset in the output, its index, and `finish` (bias and epilogue of its channel)."""
    out = ctx.out()

    def at(b: Expr, i: Expr, j: Expr) -> Expr:
        return add(mul(add(mul(b, channels), j), pixels), i)

    def out_index(b: Expr, i: Expr, j: Expr) -> Index:
        return Index(out.shape, flat=at(b, i, j))

    def finish(total: Expr, b: Expr, i: Expr, j: Expr) -> Expr:
        # the output channel: the entry's group's first one plus j
        return ops.finish(total, modulo(add(mul(b, channels), j), out.shape[1]))

    return at, out_index, finish


def _call_free_epilogue(ctx: StageCtx, ops: ConvOperands,
                        out_index: Callable[[Expr, Expr, Expr], Index],
                        finish: Callable[[Expr, Expr, Expr, Expr], Expr]) -> bool:
    """Whether the bias and fused epilogue call no function: then each result goes through
    them in the GEMM's tile epilogue, in scalar code, with no pass of its own."""
    out = ctx.out()
    pb, pi, pj = ctx.var("pb", out.numel), ctx.var("i", out.numel), ctx.var("j", out.shape[1])
    total = array_load(ctx.name("sum"), ops.acc_dtype, iconst(0))
    return not calls_function(ctx.results({0: (out_index(pb, pi, pj),
                                                finish(total, pb, pi, pj))}))


def im2col(w: Window, ops: ConvOperands, in_shape: tuple[int, ...], cg: int) -> BOperand:
    """The B operand of a convolution seen as a GEMM per (image, group): element (k, j) is the
    input under kernel tap k = (input channel, taps…) for output pixel j, zero in the padding."""
    def b_at(bi: Index, k: Expr, j: Expr) -> Expr:
        n, g = bi.dims
        c, *tap = Index((cg, *w.kernel), flat=k).dims
        o = Index(w.out_size, flat=j).dims
        positions = [tap_position(w, d, o[d], tap[d]) for d in range(len(tap))]
        inside = const(True, BOOL)
        for d, position in enumerate(positions):
            inside = logical_and(inside, logical_and(index_compare("ge", position, 0),
                                                     index_compare("lt", position, w.in_size[d])))
        clamped = [clamp(position, 0, n_d - 1) for position, n_d in zip(positions, w.in_size)]
        value = ops.read_x(Index(in_shape, dims=[n, add(mul(g, cg), c), *clamped]))
        return select(inside, value, const(0, value.dtype))
    return b_at


def _bias(ctx: StageCtx, position: int, total: Expr, m: Expr) -> Expr:
    if not ctx.has(position):
        return total
    return binary("add", total, ctx.operand(position, Index(ctx.tensor(position).shape, dims=[m])))


def _pointwise(ctx: StageCtx, w_shape: tuple[int, ...], ops: ConvOperands) -> None:
    x_shape, out = ctx.tensor(0).shape, ctx.out()
    n, c = x_shape[:2]
    m, pixels = w_shape[0], math.prod(x_shape[2:])

    def weight(i: Expr, k: Expr) -> Expr:
        return ops.read_w(Index(w_shape, flat=add(mul(i, c), k)))

    def pixel(b: Index, k: Expr, j: Expr) -> Expr:
        return ops.read_x(Index(x_shape, flat=add(mul(add(mul(b.flat, c), k), pixels), j)))

    def out_index(b: Expr, i: Expr, j: Expr) -> Index:
        return Index(out.shape, flat=add(mul(add(mul(b, m), i), pixels), j))

    if _pixels_as_rows(ctx, ops.acc_dtype, m, pixels, c, lambda nr: round_up(pixels, nr), n,
                       pixels % micro_kernel(ctx, ops.acc_dtype).lanes != 0):
        _by_pixels(ctx, ops, (n,), (pixels, m, c), ((n,), ()), lambda b, i, k: pixel(b, k, i),
                   lambda _, k, j: weight(j, k))
        ctx.info["conv"] = "GEMM, pixels as rows"
        return
    contraction(ctx, Contraction((n,), m, pixels, c, (), (n,), lambda _, i, k: weight(i, k),
                                 pixel, out_index,
                                 lambda total, b, i, j: ops.finish(total, i), ops.acc_dtype))


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _direct_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                 group: int) -> None:
    s = ctx.schedule
    x_shape, out = ctx.graph.tensors[ops.x].shape, ctx.out()
    batch, channels = out.shape[0], x_shape[1]
    m_total = out.shape[1]
    cg, mg = channels // group, m_total // group
    mb = _divisor_at_most(mg, s.conv_tile_cout)
    outer_sizes, width = w.out_size[:-1], w.out_size[-1]
    tw = min(width, s.conv_tile_w)
    tiles = -(-width // tw)
    rows = math.prod(outer_sizes)
    blocks = m_total // mb
    dtype = ops.acc_dtype
    in_shape = (batch, channels, *w.in_size)

    p = ctx.var("p", batch * blocks * rows)
    n, block, row = Index((batch, blocks, rows), flat=p).dims
    outer = Index(outer_sizes, flat=row).dims if outer_sizes else ()
    m0 = mul(block, mb)
    c0 = mul(floordiv(m0, mg), cg)
    tile = ctx.name("acc")
    wt = ctx.var("wt", tiles)
    x0 = mul(wt, tw)
    x_end = imin(add(x0, tw), iconst(width))

    def slot(mm: Expr, col: Expr) -> Expr:
        return add(mul(mm, tw), sub(col, x0))

    def over_tile(body: Callable[[Expr, Expr], list[ir.Stmt]]) -> ir.Loop:
        """Channels of the block and absolute output columns of the tile."""
        mm, col = ctx.var("m", mb), ctx.var("x", width)
        return ir.Loop(mm, iconst(0), iconst(mb),
                       [ir.Loop(col, x0, x_end, body(mm, col), simd=True)])

    zero = over_tile(lambda mm, col: [ir.ArrayStore(tile, slot(mm, col), const(0, dtype))])
    ci = ctx.var("c", cg)
    taps = [ctx.var("k", k) for k in w.kernel]
    positions = [tap_position(w, d, outer[d], taps[d]) for d in range(len(outer))]
    last = len(w.kernel) - 1
    kw = taps[last]
    lo_num = sub(iconst(w.pad_begin[last]), mul(kw, w.dilations[last]))
    col_lo = imax(ceildiv(lo_num, w.strides[last]), x0)
    col_hi = imin(ceildiv(add(lo_num, w.in_size[last]), w.strides[last]), x_end)
    mm, col = ctx.var("m", mb), ctx.var("x", width)
    x_col = tap_position(w, last, col, kw)
    x_value = ops.read_x(Index(in_shape, dims=[n, add(c0, ci), *positions, x_col]))
    w_value = ops.read_w(Index(w_shape, dims=[add(m0, mm), ci, *taps]))
    current = array_load(tile, dtype, slot(mm, col))
    update = ir.ArrayStore(tile, slot(mm, col), binary("add", current, binary("mul", w_value, x_value)))
    body: list[ir.Stmt] = [ir.Loop(mm, iconst(0), iconst(mb),
                                   [ir.Loop(col, col_lo, col_hi, [update], simd=True)])]
    body = [ir.Loop(kw, iconst(0), iconst(w.kernel[last]), body)]
    for d in reversed(range(len(outer))):
        lo, hi = valid_taps(w, d, outer[d])
        body = [ir.Loop(taps[d], lo, hi, body)]
    reduction = ir.Loop(ci, iconst(0), iconst(cg), body)

    def epilogue(mm: Expr, col: Expr) -> list[ir.Stmt]:
        total = ops.finish(array_load(tile, dtype, slot(mm, col)), add(m0, mm))
        index = Index(out.shape, dims=[n, add(m0, mm), *outer, col])
        return ctx.results({0: (index, total)})

    tile_loop = ir.Loop(wt, iconst(0), iconst(tiles), [zero, reduction, over_tile(epilogue)])
    loop = ir.Loop(p, iconst(0), iconst(batch * blocks * rows),
                   [ir.DeclArray(tile, dtype, mb * tw), tile_loop], parallel=1,
                   grain="chunks")
    work = out.numel * cg * math.prod(w.kernel)
    ctx.stage(f"conv ({ctx.op.id}), direct", [loop], work)
    ctx.info.update(form="direct", tile_cout=mb, tile_w=tw)


MAX_BORDER = 8  # border rows (or columns) per side written out one by one in a depthwise conv


def _border(out_size: int, in_size: int, kernel: int, stride: int, dilation: int, pad: int
            ) -> tuple[int, int]:
    """[lo, hi): the output positions of one dim whose every kernel tap lies inside the input."""
    lo = min(out_size, -(-pad // stride)) if pad > 0 else 0
    hi = (in_size - 1 - (kernel - 1) * dilation + pad) // stride + 1
    return lo, max(lo, min(out_size, hi))


def _tiny_rows_in_place(ctx: StageCtx, w: Window, ops: ConvOperands, x_channels: int,
                        group: int) -> bool:
    """Whether a depthwise conv whose output rows are under half a vector, under an epilogue that
    calls no function (a ReLU6), on channels that are not whole vectors (those run with channels
    as lanes, `conv_channels`), runs in place (`_depthwise_conv`) rather than over padded
    planes: a plane's copy, its grid rows of sums and their packing cost more than its few border
    points do in place (MobileNetV2's 3 × 3 convs onto 7 × 7 with AVX-512: 0.76× the time, 0.6×
    while the VM ran slow). Wider rows kept the planes: at 14 × 14 and 28 × 28 they ran 1.15-1.3×
    slower in place; and an epilogue with a call (a SiLU's exp) keeps them, their dense pass
    running it in vectors (EfficientNet's narrow planes 1.2-2× slower in place)."""
    if 2 * w.out_size[-1] >= micro_kernel(ctx, ops.acc_dtype).lanes:
        return False
    if not _in_place_depthwise_applies(w, x_channels, group):
        return False
    shape = ctx.out().shape
    return _call_free_epilogue(ctx, ops, lambda b, i, j: Index(shape, flat=i),
                               lambda total, b, i, j: ops.finish(total, j))


def _in_place_depthwise_applies(w: Window, x_channels: int, group: int) -> bool:
    """Whether `_depthwise_conv` takes a conv: 2-D, depthwise, at most 7 × 7 taps, at most
    MAX_BORDER border rows and columns a side."""
    if len(w.kernel) != 2 or x_channels // group != 1 or math.prod(w.kernel) > 49:
        return False
    (oh, ow), (kh, kw), (ih, iw) = w.out_size, w.kernel, w.in_size
    (sh, sw), (dh, dw), (ph, pw) = w.strides, w.dilations, w.pad_begin
    y_lo, y_hi = _border(oh, ih, kh, sh, dh, ph)
    x_lo, x_hi = _border(ow, iw, kw, sw, dw, pw)
    return max(y_lo, oh - y_hi, x_lo, ow - x_hi) <= MAX_BORDER


def _depthwise_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                    group: int) -> bool:
    """A 2-D conv whose output channels each read one input channel (depthwise, any channel
    multiplier), as its own kernel; False when the conv is not one (the general direct conv
    runs instead).

    Parallel over (image, output channel) planes. Output rows and columns are split into the
    interior, where every kernel tap lies inside the input, and the few border positions on
    each side, each written out with its own static set of valid taps: no padding test, no
    select and no accumulator array anywhere. The interior column loop is the vectorised loop;
    the whole kh × kw window is unrolled in its body (accumulated in registers, inputs read as
    contiguous or strided vectors), and the fused epilogue is applied before the one store.
    With a fused epilogue and border columns, the plane's sums go to a buffer first and the
    epilogue runs over the whole plane as one vectorised loop: applied point by point, the
    border columns (and rows narrower than a vector) would evaluate it in scalar code, an exp
    per point for a SiLU."""
    x_shape, out = ctx.graph.tensors[ops.x].shape, ctx.out()
    if not _in_place_depthwise_applies(w, x_shape[1], group):
        return False
    batch, m_total = out.shape[0], out.shape[1]
    mg = m_total // group
    (oh, ow), (kh, kw), (ih, iw) = w.out_size, w.kernel, w.in_size
    (sh, sw), (dh, dw), (ph, pw) = w.strides, w.dilations, w.pad_begin
    y_lo, y_hi = _border(oh, ih, kh, sh, dh, ph)
    x_lo, x_hi = _border(ow, iw, kw, sw, dw, pw)
    in_shape = (x_shape[0], x_shape[1], ih, iw)
    p = ctx.var("p", batch * m_total)
    n, m = Index((batch, m_total), flat=p).dims
    channel = floordiv(m, mg)

    def taps(o: int | None, size: int, kernel: int, stride: int, dilation: int, pad: int):
        return [k for k in range(kernel)
                if o is None or 0 <= o * stride + k * dilation - pad < size]

    def point(oy: Expr, ox: Expr, kys: list[int], kxs: list[int]) -> list[ir.Stmt]:
        total: Expr | None = None
        for ky in kys:
            iy = add(mul(oy, sh), ky * dh - ph)
            for kx in kxs:
                ix = add(mul(ox, sw), kx * dw - pw)
                wv = ops.read_w(Index(w_shape, dims=[m, iconst(0), iconst(ky), iconst(kx)]))
                xv = ops.read_x(Index(in_shape, dims=[n, channel, iy, ix]))
                term = binary("mul", wv, xv)
                total = term if total is None else binary("add", total, term)
        if total is None:
            total = const(0, ops.acc_dtype)
        if buffered:
            return [ir.ArrayStore(plane_sums, add(mul(oy, ow), ox), total)]
        return ctx.results({0: (Index(out.shape, dims=[n, m, oy, ox]), ops.finish(total, m))})

    def row(oy: Expr, kys: list[int]) -> list[ir.Stmt]:
        stmts: list[ir.Stmt] = []
        for ox in range(x_lo):
            stmts += point(oy, iconst(ox), kys, taps(ox, iw, kw, sw, dw, pw))
        if x_hi > x_lo:
            ox = ctx.var("x", x_hi - x_lo, x_lo)
            stmts.append(ir.Loop(ox, iconst(x_lo), iconst(x_hi),
                                 point(oy, ox, kys, list(range(kw))), simd=True))
        for ox in range(x_hi, ow):
            stmts += point(oy, iconst(ox), kys, taps(ox, iw, kw, sw, dw, pw))
        return stmts

    buffered = bool(ctx.fused.get(ctx.op.outputs[0])) and (x_lo > 0 or x_hi < ow)
    plane_sums = ctx.name("plane")

    body: list[ir.Stmt] = []
    for oy in range(y_lo):
        body += row(iconst(oy), taps(oy, ih, kh, sh, dh, ph))
    if y_hi > y_lo:
        oy_var = ctx.var("y", y_hi - y_lo, y_lo)
        body.append(ir.Loop(oy_var, iconst(y_lo), iconst(y_hi), row(oy_var, list(range(kh)))))
    for oy in range(y_hi, oh):
        body += row(iconst(oy), taps(oy, ih, kh, sh, dh, ph))
    if buffered:
        q = ctx.var("q", oh * ow)
        total = ops.finish(array_load(plane_sums, ops.acc_dtype, q), m)
        epilogue = ctx.results({0: (Index(out.shape, flat=add(mul(p, oh * ow), q)), total)})
        body = [ir.DeclArray(plane_sums, ops.acc_dtype, oh * ow), *body,
                ir.Loop(q, iconst(0), iconst(oh * ow), epilogue, simd=True)]
    loop = ir.Loop(p, iconst(0), iconst(batch * m_total), body, parallel=1,
                   grain="chunks")
    ctx.stage(f"conv ({ctx.op.id}), depthwise", [loop], out.numel * kh * kw)
    ctx.info.update(form="depthwise", border=(y_lo, oh - y_hi, x_lo, ow - x_hi),
                    plane_buffer=buffered)
    return True


# --- ConvTranspose ------------------------------------------------------------------------------
def _transpose_window(op: Op, graph: Graph) -> Window:
    x_shape, w_shape = graph.tensors[op.inputs[0]].shape, graph.tensors[op.inputs[1]].shape
    out_size = graph.tensors[op.outputs[0]].shape[2:]
    in_size, kernel = x_shape[2:], tuple(w_shape[2:])
    k = len(in_size)
    strides = tuple(op.attrs.get("strides") or [1] * k)
    dilations = tuple(op.attrs.get("dilations") or [1] * k)
    output_padding = op.attrs.get("output_padding") or [0] * k
    pads = op.attrs.get("pads")
    auto_pad = op.attrs.get("auto_pad", "NOTSET")
    if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [s * (i - 1) + p + (kk - 1) * d + 1 - o for i, o, kk, s, d, p in
                 zip(in_size, out_size, kernel, strides, dilations, output_padding)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    else:
        begin = (pads or [0] * (2 * k))[:k]
    return Window(in_size, out_size, kernel, strides, dilations, tuple(begin), (0,) * k)


@stage("ConvTranspose", check=_float_input)
def _conv_transpose(ctx: StageCtx) -> None:
    out = ctx.out()
    if out.numel == 0:
        return
    w = _transpose_window(ctx.op, ctx.graph)
    x_shape, w_shape = ctx.tensor(0).shape, ctx.tensor(1).shape
    group = ctx.attr("group", 1)
    channels, mg = x_shape[1], w_shape[1]
    cg = channels // group
    read_x, read_w = ctx.reader(ctx.op.inputs[0]), ctx.reader(ctx.op.inputs[1])
    dtype = out.dtype
    p = ctx.var("p", out.numel)
    n, m, *o = Index(out.shape, flat=p).dims
    total = acc(ctx.name("sum"), dtype)
    ci = ctx.var("c", cg)
    taps = [ctx.var("k", k) for k in w.kernel]
    c = add(mul(floordiv(m, mg), cg), ci)
    hit, source = const(True, BOOL), []
    for d, tap in enumerate(taps):
        numerator = sub(add(o[d], w.pad_begin[d]), mul(tap, w.dilations[d]))
        position = floordiv(numerator, w.strides[d])
        hit = logical_and(hit, logical_and(index_compare("eq", modulo(numerator, w.strides[d]), 0),
                                           logical_and(index_compare("ge", numerator, 0),
                                                       index_compare("lt", position, w.in_size[d]))))
        source.append(clamp(position, 0, w.in_size[d] - 1))
    x_value = read_x(Index(x_shape, dims=[n, c, *source]))
    w_value = read_w(Index(w_shape, dims=[c, modulo(m, mg), *taps]))
    term = select(hit, binary("mul", x_value, w_value), const(0, dtype))
    body: list[ir.Stmt] = [ir.Assign(total, binary("add", total, term))]
    for tap, k in reversed(list(zip(taps, w.kernel))):
        body = [ir.Loop(tap, iconst(0), iconst(k), body)]
    result = _bias(ctx, 2, total, m)
    stmts = [ir.DeclAcc(total, const(0, dtype)), ir.Loop(ci, iconst(0), iconst(cg), body),
             *ctx.results({0: (Index(out.shape, flat=p), result)})]
    ctx.stage(f"conv-transpose ({ctx.op.id})", [ir.Loop(p, iconst(0), iconst(out.numel), stmts,
                                                        parallel=1)],
              out.numel * cg * math.prod(w.kernel))


# --- pooling ------------------------------------------------------------------------------------------
def _pool_check(op: Op, graph: Graph) -> str | None:
    if op.op_type != "MaxPool":
        return _float_input(op, graph)
    return None


@stage("MaxPool", "AveragePool", "LpPool", check=_pool_check)
def _pool(ctx: StageCtx) -> None:
    """Parallel over output rows (image, channel, every spatial dim but the last); each row's
    pixels in three runs: those whose window crosses the input's begin along the last dim,
    those whose window lies inside it — a vector loop, the last dim's taps a loop of constant
    bounds that the compiler unrolls — and those crossing its end. Per element, the other dims'
    taps narrow to their valid range. (One parallel loop over all output elements, each
    narrowing every dim's taps at run time, ran scalar: ResNet-50's 3 × 3 MaxPool of stride 2
    from 64 × 112 × 112 took 0.82 ms at 1 thread on a Zen 4 class host, onnxruntime 0.06 ms.)"""
    x_shape, out = ctx.tensor(0).shape, ctx.out()
    if out.numel == 0:
        return
    w = window(ctx.op, x_shape[2:], out.shape[2:], tuple(ctx.attr("kernel_shape")))
    kind = ctx.op.op_type
    read_x = ctx.reader(ctx.op.inputs[0])
    width = out.shape[-1]
    rows = out.numel // width
    r = ctx.var("r", rows)
    n, ch, *o_outer = Index(out.shape[:-1], flat=r).dims
    last = len(w.kernel) - 1
    # the output columns whose window along the last dim lies inside the input
    (stride, dilation, pad) = w.strides[last], w.dilations[last], w.pad_begin[last]
    reach = (w.kernel[last] - 1) * dilation
    lo = min(width, -(-pad // stride))
    hi = max(lo, min(width, (w.in_size[last] - 1 + pad - reach) // stride + 1))

    def run(begin: int, end: int, inside: bool) -> list[ir.Stmt]:
        if begin >= end:
            return []
        ox = ctx.var("x", end, begin)
        stmts = _pool_element(ctx, w, kind, read_x, x_shape, (n, ch, [*o_outer, ox]),
                              add(mul(r, width), ox), inside)
        return [ir.Loop(ox, iconst(begin), iconst(end), stmts, simd=inside)]

    body = run(0, lo, False) + run(lo, hi, True) + run(hi, width, False)
    ctx.stage(f"pool {kind} ({ctx.op.id})",
              [ir.Loop(r, iconst(0), iconst(rows), body, parallel=1)],
              out.numel * math.prod(w.kernel))


# A window inside the input along the last dim with at most so many taps is unrolled in the
# generated code: GCC vectorised the run's loop only with no loop nested in it.
UNROLLED_POOL_TAPS = 32


def _pool_element(ctx: StageCtx, w: Window, kind: str, read_x: Reader, x_shape: tuple[int, ...],
                  at: tuple[Expr, Expr, list[Expr]], flat: Expr, inside: bool) -> list[ir.Stmt]:
    """The statements computing the output element at `at` = (image, channel, spatial
    positions), flat index `flat`. `inside`: its window lies inside the input along the last
    dim; then every dim's taps run over the whole kernel, the other dims' reads outside the
    input masked to the reduction's identity, unrolled up to `UNROLLED_POOL_TAPS` taps; else
    each dim's taps narrow to their valid range."""
    n, ch, o = at
    dtype = ctx.out().dtype
    lowest = -math.inf if dtype in FLOAT_TYPES else int(np.iinfo(np.dtype(dtype)).min)
    best = acc(ctx.name("acc"), dtype)
    stmts: list[ir.Stmt] = [ir.DeclAcc(best, const(lowest if kind == "MaxPool" else 0, dtype))]
    where = None
    if kind == "MaxPool" and ctx.output_used(1):
        where = acc(ctx.name("arg"), INDEX)
        stmts.append(ir.DeclAcc(where, iconst(0)))

    def update(taps: list[Expr]) -> list[ir.Stmt]:
        positions = [tap_position(w, d, o[d], taps[d]) for d in range(len(taps))]
        if inside:
            valid = const(True, BOOL)
            for d in range(len(taps) - 1):
                valid = logical_and(valid, logical_and(
                    index_compare("ge", positions[d], 0),
                    index_compare("lt", positions[d], w.in_size[d])))
            clamped = [clamp(p, 0, size - 1) for p, size in zip(positions[:-1], w.in_size)]
            x_value = select(valid, read_x(Index(x_shape, dims=[n, ch, *clamped,
                                                                positions[-1]])),
                             const(lowest if kind == "MaxPool" else 0, dtype))
        else:
            x_value = read_x(Index(x_shape, dims=[n, ch, *positions]))
        if kind != "MaxPool":
            power = float(ctx.attr("p", 2))
            term = x_value if kind == "AveragePool" else _lp_term(x_value, power)
            return [ir.Assign(best, binary("add", best, term))]
        value, better = local(ctx.name("v"), dtype), local(ctx.name("c"), BOOL)
        stmts = [ir.Let(value, x_value), ir.Let(better, make("gt", BOOL, (value, best))),
                 ir.Assign(best, select(better, value, best))]
        if where is not None:
            stmts.append(ir.Assign(where, select(
                better, _pool_index(ctx, x_shape, n, ch, positions), where)))
        return stmts

    if inside and math.prod(w.kernel) <= UNROLLED_POOL_TAPS:
        for taps in np.ndindex(*w.kernel):
            stmts += update([iconst(int(t)) for t in taps])
    else:
        variables = [ctx.var("k", k) for k in w.kernel]
        body = update(variables)
        for d in reversed(range(len(variables))):
            lo, hi = (iconst(0), iconst(w.kernel[d])) if inside else valid_taps(w, d, o[d])
            body = [ir.Loop(variables[d], lo, hi, body)]
        stmts += body
    results = {0: (Index(ctx.out().shape, flat=flat), _pool_result(ctx, w, o, best, kind))}
    if where is not None:
        results[1] = (Index(ctx.out(1).shape, flat=flat), where)
    return stmts + ctx.results(results)


def _lp_term(x: Expr, power: float) -> Expr:
    magnitude = make("abs", x.dtype, (x,))
    if power == 1:
        return magnitude
    if power == 2:
        return binary("mul", x, x)
    return make("call", x.dtype, (magnitude, const(power, x.dtype)), "pow")


def _pool_index(ctx: StageCtx, x_shape, n: Expr, ch: Expr, positions: list[Expr]) -> Expr:
    plane = add(mul(n, x_shape[1]), ch)
    spatial = x_shape[2:]
    if ctx.attr("storage_order", 0) == 0:
        inner = Index(spatial, dims=positions).flat
    else:
        inner = Index(tuple(reversed(spatial)), dims=list(reversed(positions))).flat
    return add(mul(plane, math.prod(spatial)), inner)


def _pool_result(ctx: StageCtx, w: Window, o: list[Expr], total: Expr, kind: str) -> Expr:
    if kind == "MaxPool":
        return total
    if kind == "LpPool":
        power = float(ctx.attr("p", 2))
        if power == 2:
            return make("call", total.dtype, (total,), "sqrt")
        return make("call", total.dtype, (total, const(1 / power, total.dtype)), "pow")
    count: Expr = iconst(1)
    include_pad = ctx.attr("count_include_pad", 0)
    for d in range(len(o)):
        if include_pad:
            base = mul(o[d], w.strides[d])
            limit = w.in_size[d] + w.pad_begin[d] + w.pad_end[d]
            taps = imin(ceildiv(sub(iconst(limit), base), w.dilations[d]), w.kernel[d])
        else:
            lo, hi = valid_taps(w, d, o[d])
            taps = sub(hi, lo)
        count = imul(count, taps)
    return binary("div", total, cast(count, total.dtype))


# --- Col2Im -------------------------------------------------------------------------------------------
def _col2im_check(op: Op, graph: Graph) -> str | None:
    if not (graph.is_constant(op.inputs[1]) and graph.is_constant(op.inputs[2])):
        return "image and block shapes must be constants"
    return None


@inline("Col2Im", check=_col2im_check)
def _col2im(ctx: InlineCtx, index: Index) -> Expr:
    """Each image element sums the column entries of the blocks that cover it: per kernel tap,
    the block whose tap lands on the element, if the stride grid has one there."""
    image = [int(v) for v in ctx.const(1).reshape(-1)]
    kernel = [int(v) for v in ctx.const(2).reshape(-1)]
    rank = len(image)
    strides = ctx.attr("strides") or [1] * rank
    dilations = ctx.attr("dilations") or [1] * rank
    pads = ctx.attr("pads") or [0] * (2 * rank)
    blocks = [(size + pads[d] + pads[rank + d] - dilations[d] * (kernel[d] - 1) - 1) // strides[d] + 1
              for d, size in enumerate(image)]
    n, ch, *x = index.dims
    shape = ctx.shape(0)
    dtype = ctx.out.dtype
    total: Expr = const(0, dtype)
    for tap in np.ndindex(*kernel):
        hit, where = const(True, BOOL), []
        for d, t in enumerate(tap):
            numerator = sub(add(x[d], pads[d]), t * dilations[d])
            block = floordiv(numerator, strides[d])
            hit = logical_and(hit, logical_and(
                index_compare("eq", modulo(numerator, strides[d]), 0),
                logical_and(index_compare("ge", numerator, 0), index_compare("lt", block, blocks[d]))))
            where.append(clamp(block, 0, blocks[d] - 1))
        row = add(mul(ch, math.prod(kernel)), Index(tuple(kernel), dims=[iconst(t) for t in tap]).flat)
        value = ctx.input(0, Index(shape, dims=[n, row, Index(tuple(blocks), dims=where).flat]))
        total = binary("add", total, select(hit, value, const(0, dtype)))
    return total
