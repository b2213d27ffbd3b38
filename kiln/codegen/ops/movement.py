"""Data-movement ops (Reorganize, Shuffle, and One-to-Many gathers/padding): index maps.

Each lowering maps an output index to the input index it reads (the quasi-affine maps of Souffle
§5.2; gathers add a run-time index). Inside a block these are never copies: the consumer reads
through the composed map (DNNFusion §4.4.2). Run-time indices are wrapped (negative values count
from the end) and clamped into range, so a bad index can never read outside a buffer. Conditional
elements (Pad, Concat, ...) read a clamped, always-valid position and select.
"""
from __future__ import annotations

from kiln.codegen.expr import (
    BOOL,
    Expr,
    add,
    as_index,
    cast,
    clamp,
    const,
    floordiv,
    iconst,
    index_compare,
    logical_and,
    make,
    modulo,
    mul,
    select,
    sub,
)
from kiln.codegen.indexing import Index, broadcast, permuted
from kiln.codegen.contexts import InlineCtx
from kiln.codegen.ops.common import axis_of, needs_const_inputs, wrapped
from kiln.codegen.ops.registry import inline


def in_range(i: Expr, extent: int) -> Expr:
    return logical_and(index_compare("ge", i, 0), index_compare("lt", i, extent))


def const_ints(ctx: InlineCtx, i: int) -> list[int] | None:
    data = ctx.const(i) if ctx.has(i) else None
    return None if data is None else [int(v) for v in data.reshape(-1)]


# --- same elements, new shape ------------------------------------------------------------------
@inline("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(ctx: InlineCtx, index: Index) -> Expr:
    return ctx.input(0, index.reshaped(ctx.shape(0)))


@inline("Transpose")
def _transpose(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.shape(0))
    perm = ctx.attr("perm") or list(reversed(range(rank)))
    return ctx.input(0, permuted(index, perm, ctx.shape(0)))


@inline("Expand")
def _expand(ctx: InlineCtx, index: Index) -> Expr:
    return ctx.input(0, broadcast(index, ctx.shape(0)))


@inline("Tile", check=needs_const_inputs(1))
def _tile(ctx: InlineCtx, index: Index) -> Expr:
    shape = ctx.shape(0)
    return ctx.input(0, Index(shape, dims=[modulo(d, n) for d, n in zip(index.dims, shape)]))


# --- slicing and joining -----------------------------------------------------------------------
def slice_params(ctx: InlineCtx) -> list[tuple[int, int]]:
    """(start, step) per input axis."""
    shape = ctx.shape(0)
    rank = len(shape)
    starts, ends = const_ints(ctx, 1), const_ints(ctx, 2)
    axes = const_ints(ctx, 3) or list(range(len(starts)))
    steps = const_ints(ctx, 4) or [1] * len(starts)
    params = [(0, 1)] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = axis_of(a, rank)
        start, _, step = slice(s, e, st).indices(shape[a])
        params[a] = (start, step)
    return params


@inline("Slice", check=needs_const_inputs(1, 2, 3, 4))
def _slice(ctx: InlineCtx, index: Index) -> Expr:
    dims = [add(mul(d, step), start) for d, (start, step) in zip(index.dims, slice_params(ctx))]
    return ctx.input(0, Index(ctx.shape(0), dims=dims))


@inline("Split", check=needs_const_inputs(1))
def _split(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.shape(0))
    axis = axis_of(ctx.attr("axis", 0), rank)
    offset = sum(ctx.graph.tensors[t].shape[axis] for t in ctx.op.outputs[:ctx.position])
    dims = list(index.dims)
    dims[axis] = add(dims[axis], offset)
    return ctx.input(0, Index(ctx.shape(0), dims=dims))


@inline("Concat")
def _concat(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.out.shape)
    axis = axis_of(ctx.attr("axis"), rank)
    pieces: list[tuple[int, int, int]] = []  # (input, offset, extent)
    offset = 0
    for i, t in enumerate(ctx.op.inputs):
        extent = ctx.graph.tensors[t].shape[axis]
        if extent:
            pieces.append((i, offset, extent))
        offset += extent
    d = index.dims[axis]
    result: Expr | None = None
    for i, start, extent in reversed(pieces):
        dims = list(index.dims)
        dims[axis] = clamp(sub(d, start), 0, extent - 1)
        value = ctx.input(i, Index(ctx.shape(i), dims=dims))
        result = value if result is None else select(index_compare("lt", d, start + extent), value,
                                                     result)
    return result


def _pad_value(ctx: InlineCtx, dtype: str) -> Expr:
    if ctx.has(2):
        return ctx.input(2, Index(ctx.shape(2), flat=iconst(0)))
    return const(0, dtype)


@inline("Pad", check=needs_const_inputs(1, 3))
def _pad(ctx: InlineCtx, index: Index) -> Expr:
    shape = ctx.shape(0)
    rank = len(shape)
    pads = const_ints(ctx, 1)
    axes = [axis_of(a, rank) for a in (const_ints(ctx, 3) or range(rank))]
    begin = [0] * rank
    for k, a in enumerate(axes):
        begin[a] = pads[k]
    mode = ctx.attr("mode", "constant")
    dims, inside = [], const(True, BOOL)
    for d, n, b in zip(index.dims, shape, begin):
        i = sub(d, b) if b else d
        if mode == "constant":
            inside = logical_and(inside, in_range(i, n))
            i = clamp(i, 0, n - 1)
        elif mode == "edge":
            i = clamp(i, 0, n - 1)
        elif mode == "wrap":
            i = modulo(i, n)
        elif mode == "reflect":
            i = _reflect(i, n)
        dims.append(i)
    value = ctx.input(0, Index(shape, dims=dims))
    return select(inside, value, _pad_value(ctx, value.dtype)) if mode == "constant" else value


def _reflect(i: Expr, n: int) -> Expr:
    if n == 1:
        return iconst(0)
    lo, hi = i.range
    if lo >= 0 and hi < n:
        return i
    period = 2 * (n - 1)
    m = modulo(i, period)
    return select(index_compare("ge", m, n), sub(iconst(period), m), m)


@inline("CenterCropPad", check=needs_const_inputs(1))
def _center_crop_pad(ctx: InlineCtx, index: Index) -> Expr:
    shape = ctx.shape(0)
    rank = len(shape)
    axes = [axis_of(a, rank) for a in (ctx.attr("axes") or range(rank))]
    dims, inside = list(index.dims), const(True, BOOL)
    for a in axes:
        out_n, n = ctx.out.shape[a], shape[a]
        if out_n < n:
            dims[a] = add(dims[a], (n - out_n) // 2)
        elif out_n > n:
            i = sub(dims[a], (out_n - n) // 2)
            inside = logical_and(inside, in_range(i, n))
            dims[a] = clamp(i, 0, n - 1)
    value = ctx.input(0, Index(shape, dims=dims))
    return select(inside, value, const(0, value.dtype))


# --- gathers -------------------------------------------------------------------------------------
@inline("Gather")
def _gather(ctx: InlineCtx, index: Index) -> Expr:
    data, idx_shape = ctx.shape(0), ctx.shape(1)
    axis = axis_of(ctx.attr("axis", 0), len(data))
    dims = index.dims
    q = len(idx_shape)
    where = ctx.input(1, Index(idx_shape, dims=dims[axis:axis + q]))
    source = list(dims[:axis]) + [wrapped(where, data[axis])] + list(dims[axis + q:])
    return ctx.input(0, Index(data, dims=source))


@inline("GatherElements")
def _gather_elements(ctx: InlineCtx, index: Index) -> Expr:
    data = ctx.shape(0)
    axis = axis_of(ctx.attr("axis", 0), len(data))
    where = ctx.input(1, index)
    dims = list(index.dims)
    dims[axis] = wrapped(where, data[axis])
    return ctx.input(0, Index(data, dims=dims))


@inline("GatherND")
def _gather_nd(ctx: InlineCtx, index: Index) -> Expr:
    data, idx_shape = ctx.shape(0), ctx.shape(1)
    b = ctx.attr("batch_dims", 0)
    q, k = len(idx_shape), idx_shape[-1]
    dims = index.dims
    picked = [wrapped(ctx.input(1, Index(idx_shape, dims=list(dims[:q - 1]) + [iconst(j)])),
                      data[b + j]) for j in range(k)]
    return ctx.input(0, Index(data, dims=list(dims[:b]) + picked + list(dims[q - 1:])))


@inline("OneHot", check=needs_const_inputs(1))
def _one_hot(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.out.shape)
    axis = axis_of(ctx.attr("axis", -1), rank)
    depth = int(ctx.const(1).reshape(-1)[0])
    dims = list(index.dims)
    position = dims.pop(axis)
    raw = as_index(ctx.input(0, Index(ctx.shape(0), dims=dims)))
    value = select(index_compare("lt", raw, 0), add(raw, depth), raw)
    values_shape = ctx.shape(2)
    off = ctx.input(2, Index(values_shape, flat=iconst(0)))
    on = ctx.input(2, Index(values_shape, flat=iconst(1)))
    return select(make("eq", BOOL, (value, position)), on, off)


@inline("ReverseSequence")
def _reverse_sequence(ctx: InlineCtx, index: Index) -> Expr:
    batch_axis, time_axis = ctx.attr("batch_axis", 1), ctx.attr("time_axis", 0)
    dims = list(index.dims)
    t = dims[time_axis]
    length = as_index(ctx.input(1, Index(ctx.shape(1), dims=[dims[batch_axis]])))
    reversed_t = clamp(sub(sub(length, 1), t), 0, ctx.shape(0)[time_axis] - 1)
    dims[time_axis] = select(make("lt", BOOL, (t, length)), reversed_t, t)
    return ctx.input(0, Index(ctx.shape(0), dims=dims))


# --- depth/space rearrangements ----------------------------------------------------------------
@inline("DepthToSpace")
def _depth_to_space(ctx: InlineCtx, index: Index) -> Expr:
    b = ctx.attr("blocksize")
    _, channels, _, _ = ctx.shape(0)
    n, ch, h, w = index.dims
    bh, bw = modulo(h, b), modulo(w, b)
    if ctx.attr("mode", "DCR") == "CRD":
        source = add(mul(ch, b * b), mul(bh, b), bw)
    else:
        source = add(mul(add(mul(bh, b), bw), channels // (b * b)), ch)
    return ctx.input(0, Index(ctx.shape(0), dims=[n, source, floordiv(h, b), floordiv(w, b)]))


@inline("SpaceToDepth")
def _space_to_depth(ctx: InlineCtx, index: Index) -> Expr:
    b = ctx.attr("blocksize")
    _, channels, _, _ = ctx.shape(0)
    n, ch, h, w = index.dims
    if ctx.attr("mode", "DCR") == "CRD":
        source, block = floordiv(ch, b * b), modulo(ch, b * b)
    else:
        source, block = modulo(ch, channels), floordiv(ch, channels)
    dims = [n, source, add(mul(h, b), floordiv(block, b)), add(mul(w, b), modulo(block, b))]
    return ctx.input(0, Index(ctx.shape(0), dims=dims))


# --- masks and generators -----------------------------------------------------------------------
@inline("Trilu")
def _trilu(ctx: InlineCtx, index: Index) -> Expr:
    x = ctx.input(0, index)
    k = as_index(ctx.input(1, Index(ctx.shape(1), flat=iconst(0)))) if ctx.has(1) else iconst(0)
    i, j = index.dims[-2], index.dims[-1]
    keep = index_compare("ge" if ctx.attr("upper", 1) else "le", sub(j, i), k)
    return select(keep, x, const(0, x.dtype))


@inline("Range")
def _range(ctx: InlineCtx, index: Index) -> Expr:
    dtype = ctx.out.dtype
    start = ctx.input(0, Index(ctx.shape(0), flat=iconst(0)))
    delta = ctx.input(2, Index(ctx.shape(2), flat=iconst(0)))
    return make("add", dtype, (start, make("mul", dtype, (cast(index.flat, dtype), delta))))


@inline("EyeLike")
def _eye_like(ctx: InlineCtx, index: Index) -> Expr:
    i, j = index.dims
    on = index_compare("eq", sub(j, i), ctx.attr("k", 0))
    return select(on, const(1, ctx.out.dtype), const(0, ctx.out.dtype))


@inline("ConstantOfShape")
def _constant_of_shape(ctx: InlineCtx, index: Index) -> Expr:
    value = ctx.attr("value")
    v = 0 if value is None else value.reshape(-1)[0]
    return const(v, ctx.out.dtype)
