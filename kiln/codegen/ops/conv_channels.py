"""A depthwise convolution over tiny planes with its channels as the vector lanes.

Where an output row is under half a vector (7 × 7 planes on AVX-512), a depthwise conv laid out
as NCHW vectorises badly along its rows: each plane's rows are a few lanes of a vector, and its
border points run one at a time. Here the planes of `lanes` consecutive channels, contiguous in
NCHW, are transposed onto the stack (`ir.Transpose`, through vector registers) into
pixel-major order, one vector per pixel holding its `lanes` channels, zero-padded round the
plane; every tap of every output pixel is then one vector multiply-add with the tap's weights of
those channels, at any stride and dilation and with no border cases. The sums are transposed
back to the channels' planes, and the bias and fused epilogue run along each plane's pixels.
This is the blocked channel layout (NCHWc) inside one kernel, with its layout transforms at the
kernel's edges. On Sapphire Rapids at one thread, MobileNetV2's 3 × 3 conv on 960 channels of
7 × 7 took 0.5× the time of the in-place kernel (`conv._depthwise_conv`; 0.84× in the model at
2 threads, EfficientNet-B0's 5 × 5 SiLU ones onto 7 × 7 0.66-0.83× the padded planes'). On
wider planes the two transposes cost more than the rows' remainders: a hand-written version of
this form took 1.15× the padded planes' time (`conv_direct.depthwise_plane`) on 14 × 14 and
1.7× on 28 × 28, and in EfficientNet-B0 its 14 × 14 convs ran 1.1-1.35× slower; hence only
tiny rows."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (Expr, add, array_load, binary, const, iconst, load, mul,
                               substitute)
from kiln.codegen.gemm.packed import micro_kernel
from kiln.codegen.gemm.spec import stride_of
from kiln.codegen.indexing import Index
from kiln.codegen.ops.conv_window import ConvOperands, Window, constant_weights

STACK_BYTES = 1 << 18  # the blocks a task keeps on the stack, at most


def _padded_extent(w: Window, d: int) -> int:
    """Rows (d = 0) or columns (d = 1) of the zero-padded plane that the output's taps read."""
    return (w.out_size[d] - 1) * w.strides[d] + (w.kernel[d] - 1) * w.dilations[d] + 1


def channel_lanes_applies(ctx: StageCtx, w: Window, x_channels: int, group: int,
                          channels_out: int, acc_dtype: str) -> bool:
    """A 2-D float depthwise conv (one output channel per input channel) on a CPU (no GPU's
    work-groups: its renderers have no vector transposes) whose output rows are under half a
    vector, on a whole number of vectors of channels, with blocks that fit the stack."""
    s = ctx.schedule
    if (len(w.kernel) != 2 or acc_dtype not in ("float32", "float64") or s.vector_bytes <= 0
            or s.gemm_work_group or group != x_channels or channels_out != group):
        return False
    lanes = micro_kernel(ctx, acc_dtype).lanes
    if lanes < 2 or x_channels % lanes or 2 * w.out_size[1] >= lanes:
        return False
    pixels = max(math.prod(w.in_size), math.prod(w.out_size))
    padded = _padded_extent(w, 0) * _padded_extent(w, 1)
    return (3 * pixels + padded) * lanes * np.dtype(acc_dtype).itemsize <= STACK_BYTES


def channel_lanes_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                       in_shape: tuple[int, ...]) -> None:
    """The depthwise conv (see the module), parallel over blocks of `lanes` channels."""
    out, dtype = ctx.out(), ops.acc_dtype
    batch, channels = out.shape[0], out.shape[1]
    lanes = micro_kernel(ctx, dtype).lanes
    vector_bytes = ctx.schedule.vector_bytes
    (ih, iw), (oh, ow) = w.in_size, w.out_size
    in_pixels, out_pixels = ih * iw, oh * ow
    hp, wp = _padded_extent(w, 0), _padded_extent(w, 1)
    tile, padded, sums = ctx.name("tile"), ctx.name("padded"), ctx.name("sums")
    p = ctx.var("p", batch * channels // lanes)
    first = mul(p, lanes)  # the block's first (image · channels + channel)
    m0 = Index((batch, channels), flat=first).dims[1]

    to_pixels = _to_pixel_major(ctx, ops, in_shape, first, tile, lanes)
    z = ctx.var("z", hp * wp * lanes)
    zero = ir.Loop(z, iconst(0), iconst(hp * wp * lanes),
                   [ir.ArrayStore(padded, z, const(0, dtype))], simd=True)
    stmts: list[ir.Stmt] = [
        ir.DeclArray(tile, dtype, lanes * max(in_pixels, out_pixels)),
        ir.DeclArray(padded, dtype, hp * wp * lanes),
        ir.DeclArray(sums, dtype, lanes * out_pixels),
        *to_pixels, zero, _fill_padded(ctx, w, dtype, tile, padded, lanes),
        *_window_sums(ctx, w, w_shape, ops, padded, tile, m0, lanes),
        ir.Transpose(dtype, tile, iconst(0), lanes, sums, iconst(0), out_pixels,
                     iconst(out_pixels), iconst(lanes), vector_bytes),
        _epilogue(ctx, ops, sums, first, m0, lanes, out_pixels)]
    ctx.stage(f"conv ({ctx.op.id}), depthwise with channels as vector lanes",
              [ir.Loop(p, iconst(0), iconst(batch * channels // lanes), stmts, parallel=1,
                       grain="chunks")],
              out.numel * math.prod(w.kernel))
    ctx.info.update(form="depthwise, channels as lanes", lanes=lanes, padded=f"{hp}x{wp}")


def _to_pixel_major(ctx: StageCtx, ops: ConvOperands, in_shape: tuple[int, ...], first: Expr,
                    tile: str, lanes: int) -> list[ir.Stmt]:
    """The block's `lanes` input planes (contiguous in NCHW) transposed into `tile`, a vector of
    channels per pixel: straight from the input where it is read as it lies, else through a
    copy into a block of their own (the input's fused prologue evaluated once per element
    there)."""
    dtype, pixels = ops.acc_dtype, math.prod(in_shape[2:])
    q = ctx.var("q", lanes * pixels)
    value = ops.once(Index(in_shape, flat=add(mul(first, pixels), q)))
    if (value.op == "load" and value.name in ctx.graph.tensors and value.dtype == dtype
            and stride_of(value, q) == 1):
        return [ir.Transpose(dtype, value.name, substitute(value.args[0], {q: iconst(0)}), pixels,
                             tile, iconst(0), lanes, iconst(lanes), iconst(pixels),
                             ctx.schedule.vector_bytes)]
    block = ctx.name("block")
    return [ir.DeclArray(block, dtype, lanes * pixels),
            ir.Loop(q, iconst(0), iconst(lanes * pixels), [ir.ArrayStore(block, q, value)],
                    simd=True),
            ir.Transpose(dtype, block, iconst(0), pixels, tile, iconst(0), lanes, iconst(lanes),
                         iconst(pixels), ctx.schedule.vector_bytes)]


def _fill_padded(ctx: StageCtx, w: Window, dtype: str, tile: str, padded: str,
                 lanes: int) -> ir.Stmt:
    """The pixel-major block copied into the zero-padded one: the input pixels that some tap
    reads (rows and columns past the last tap's reach are left out)."""
    (ih, iw), (pt, pl) = w.in_size, w.pad_begin
    hp, wp = _padded_extent(w, 0), _padded_extent(w, 1)
    y_lo, x_lo = max(0, -pt), max(0, -pl)
    y_hi, x_hi = max(y_lo, min(ih, hp - pt)), max(x_lo, min(iw, wp - pl))
    y, x, lane = ctx.var("y", ih), ctx.var("x", iw), ctx.var("l", lanes)
    to = add(mul(add(mul(add(y, pt), wp), add(x, pl)), lanes), lane)
    value = array_load(tile, dtype, add(mul(add(mul(y, iw), x), lanes), lane))
    return ir.Loop(y, iconst(y_lo), iconst(y_hi), [
        ir.Loop(x, iconst(x_lo), iconst(x_hi), [
            ir.Loop(lane, iconst(0), iconst(lanes), [ir.ArrayStore(padded, to, value)],
                    simd=True)])])


def _window_sums(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                 padded: str, tile: str, m0: Expr, lanes: int) -> list[ir.Stmt]:
    """Each output pixel's window summed over the padded block, a vector of channels at a time,
    into `tile`."""
    dtype = ops.acc_dtype
    (oh, ow), (kh, kw) = w.out_size, w.kernel
    (sh, sw), (dh, dw) = w.strides, w.dilations
    wp = _padded_extent(w, 1)
    tap_weight, prepare = _tap_weights(ctx, w_shape, ops, m0, lanes)
    oy, ox, lane = ctx.var("y", oh), ctx.var("x", ow), ctx.var("l", lanes)
    total: Expr | None = None
    for t in range(kh * kw):
        ty, tx = divmod(t, kw)
        at = add(mul(add(add(mul(oy, sh * wp), mul(ox, sw)), ty * dh * wp + tx * dw), lanes),
                 lane)
        term = binary("mul", tap_weight(add(lane, t * lanes)), array_load(padded, dtype, at))
        total = term if total is None else binary("add", total, term)
    assert total is not None
    store = ir.ArrayStore(tile, add(mul(add(mul(oy, ow), ox), lanes), lane), total)
    return [*prepare,
            ir.Loop(oy, iconst(0), iconst(oh), [ir.Loop(ox, iconst(0), iconst(ow), [
                ir.Loop(lane, iconst(0), iconst(lanes), [store], simd=True)])])]


def _tap_weights(ctx: StageCtx, w_shape: tuple[int, ...], ops: ConvOperands, m0: Expr,
                 lanes: int) -> tuple[Callable[[Expr], Expr], list[ir.Stmt]]:
    """(weight(t · lanes + lane) of the block's tap t, statements that prepare them): constant
    weights laid out at compile time as a vector of the block's channels per tap; others
    gathered so per block."""
    taps, dtype = math.prod(w_shape[2:]), ops.acc_dtype
    values = constant_weights(ctx, ops, w_shape)
    if values is not None:
        by_block = values.reshape(-1, lanes, taps).transpose(0, 2, 1).astype(dtype)
        table = ctx.derived(np.ascontiguousarray(by_block).reshape(-1))
        return lambda at: load(table, dtype, add(mul(m0, taps), at)), []
    gathered = ctx.name("taps")
    tap, lane = ctx.var("t", taps), ctx.var("l", lanes)
    gather = ir.Loop(tap, iconst(0), iconst(taps), [ir.Loop(lane, iconst(0), iconst(lanes), [
        ir.ArrayStore(gathered, add(mul(tap, lanes), lane),
                      ops.read_w(Index(w_shape, flat=add(mul(add(m0, lane), taps), tap))))],
        simd=True)])
    return (lambda at: array_load(gathered, dtype, at),
            [ir.DeclArray(gathered, dtype, taps * lanes), gather])


def _epilogue(ctx: StageCtx, ops: ConvOperands, sums: str, first: Expr, m0: Expr, lanes: int,
              out_pixels: int) -> ir.Stmt:
    """Each channel's plane of sums through the bias and fused epilogue to the output."""
    out = ctx.out()
    lane, q = ctx.var("c", lanes), ctx.var("q", out_pixels)
    value = ops.finish(array_load(sums, ops.acc_dtype, add(mul(lane, out_pixels), q)),
                       add(m0, lane))
    stores = ctx.results({0: (Index(out.shape, flat=add(mul(add(first, lane), out_pixels), q)),
                              value)})
    return ir.Loop(lane, iconst(0), iconst(lanes), [
        ir.Loop(q, iconst(0), iconst(out_pixels), stores, simd=True)])
