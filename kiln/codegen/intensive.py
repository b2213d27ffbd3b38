"""AGO's intensive fusion (§III-B): two complex ops in one kernel, tile by tile, with no
intermediate tensor in memory and no recomputation.

Fusing a convolution into the one after it recomputes the first one's elements whenever (1) the
second reuses them — an element of the intermediate feeds several outputs — and (2) those outputs
fall into different tiles. (1) is the op's definition; (2) is the tiling's choice. The paper's
two categories of inter-operator dependency are the downstream ops whose reuse runs along one
kind of dimension only, so that tiles which never split the reused dimensions remove (2) and
stay small:

* **depthwise** (Fig. 7a): a depthwise convolution reuses an input element only along H and W
  (each output channel reads one input channel). Tiles are blocks of channels with whole planes:
  the upstream op computes `tc` channels × H1 × W1 into a buffer, the depthwise convolution reads
  it (o1 = o2);
* **pointwise** (Fig. 7b): a 1×1 convolution reuses an input element only along its output
  channels. Tiles are blocks of pixels with every channel: the upstream op computes O1 channels ×
  `tp` pixels, the pointwise convolution turns them into O2 channels × the same pixels.

Any other downstream convolution reuses along O2, H2 and W2 at once; its pairs are not fused
(the block runs them as two stages, the paper's joint optimisation without intensive fusion).

The upstream op is any 2-D convolution with one group (an implicit GEMM whose weight panels are
packed at compile time and whose im2col operand is packed once per call, or read in place for a
1×1 convolution) or a depthwise convolution (direct loops). Between the two may stand
elementwise ops (bias, ReLU6, SiLU: the upstream op's epilogue; their other operands constants or
block inputs read at the same element, such as a residual); they are applied when the tile is
filled. The downstream op's own epilogue runs on its results as in any stage.

On a CPU the paper's "tile in L1" becomes a buffer on the thread's stack sized by the schedule's
`intensive_tile_bytes` (default a quarter of a 1 MiB L2: the tile, the weights it meets and the
output rows stay in L2); the matrix products inside a tile run the register-blocked micro-kernel
(`kiln.codegen.microkernel`), so the tiling for registers is independent of the tiling for the
cache, as the paper's Fig. 7 keeps it. A pair whose smallest tile does not fit the budget is not
fused.

Matrix products are the paper's pointwise convolutions ("mathematically equivalent", §III-B): a
MatMul or Gemm downstream with constant weights falls in the pointwise category, its tiles are
blocks of rows with every column of the intermediate, and a MatMul/Gemm upstream fills them
(`kiln.codegen.intensive_rows`). A conv's NCHW result and a product's row-major operand meet
across a transposition (Reshape to (N, C, H·W) and Transpose, as a patch embedding feeds a linear
layer, or the reverse): the pair is still of the pointwise category with pixels for rows, and a
tile of one image's pixels × every channel is transposed inside the tile, from the conv's
channel-major sums into the product's A panels (CONV_TO_ROWS), or from the product's register
tiles into the pointwise conv's channel-major sums (ROWS_TO_CONV). Which layout a pair has is
decided by carrying element offsets through the ops between (`_layout`); a path that maps them
any other way (a row of the product made of one channel's pixels) is not fused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.codegen import intensive_rows, ir
from kiln.codegen.contexts import Provided, StageCtx
from kiln.codegen.expr import (
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
)
from kiln.codegen.gemm.packed import micro_kernel
from kiln.codegen.gemm.packing import OperandSide, Packed, b_rows, constant_panels
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import tile_for
from kiln.codegen.ops import lowering
from kiln.codegen.ops.contraction import MATRIX_SPECS
from kiln.codegen.ops.conv_window import Window, ceildiv, tap_position, valid_taps, window
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op
from kiln.mapping import MappingType

DEPTHWISE, POINTWISE = "depthwise", "pointwise"
CHANNELS, ROWS, CONV_TO_ROWS, ROWS_TO_CONV = "channels", "rows", "conv to rows", "rows to conv"
MAX_TAPS = 49
FLOAT = "float32"


@dataclass(frozen=True)
class Pair:
    up: Op
    down: Op
    between: tuple[Op, ...]  # elementwise ops from the upstream result to the downstream input
    category: str  # DEPTHWISE (Fig. 7a) or POINTWISE (Fig. 7b)
    layout: str = CHANNELS  # how tiles see the intermediate (`_layout`)

    @property
    def rows(self) -> bool:
        """Does a tile hold rows of a matrix product (`kiln.codegen.intensive_rows`)?"""
        return self.layout != CHANNELS


# --- which pairs ------------------------------------------------------------------------------------
def _geometry(op: Op, graph: Graph) -> tuple[Window, int] | None:
    """The window and group count of a float32 2-D Conv with constant weights (and bias)."""
    if op.op_type != "Conv" or len(op.outputs) != 1:
        return None
    x, w = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    out = graph.tensors[op.outputs[0]]
    if len(x.shape) != 4 or x.dtype != FLOAT or out.dtype != FLOAT or not graph.is_constant(w.id):
        return None
    if len(op.inputs) > 2 and op.inputs[2] is not None and not graph.is_constant(op.inputs[2]):
        return None
    if out.numel == 0 or x.numel == 0 or w.numel < 2:  # a one-element weight is folded to a number
        return None
    return window(op, x.shape[2:], out.shape[2:], tuple(w.shape[2:])), int(op.attrs.get("group", 1))


def _is_depthwise(op: Op, graph: Graph) -> bool:
    found = _geometry(op, graph)
    if found is None:
        return False
    w, group = found
    x, out = graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape
    return group == x[1] == out[1] > 1 and math.prod(w.kernel) <= MAX_TAPS


def _is_pointwise(op: Op, graph: Graph) -> bool:
    found = _geometry(op, graph)
    if found is None:
        return False
    w, group = found
    return (group == 1 and all(k == 1 for k in w.kernel) and all(s == 1 for s in w.strides)
            and not any(w.pad_begin) and not any(w.pad_end))


def category(op: Op, graph: Graph) -> str | None:
    """The paper's category of `op` as the downstream op of a pair, or None (reuse along more
    than one kind of dimension: fusing would recompute)."""
    if _is_depthwise(op, graph):
        return DEPTHWISE
    if _is_pointwise(op, graph) or intensive_rows.row_product(op, graph, True) is not None:
        return POINTWISE  # a matrix product is a pointwise convolution (§III-B's last paragraph)
    return None


def upstream_form(op: Op, graph: Graph) -> str | None:
    """"gemm" (one group), "depthwise", or None."""
    found = _geometry(op, graph)
    if found is None:
        return None
    if _is_depthwise(op, graph):
        return "depthwise"
    return "gemm" if found[1] == 1 else None


def find_pairs(graph: Graph, ops: list[Op], must_store: set[str],
               outputs: set[str]) -> dict[str, Pair]:
    """Pairs of the block by downstream op id, taken in block order, each op in one pair."""
    producer = {t: op for op in ops for t in op.outputs}
    used: set[str] = set()
    pairs: dict[str, Pair] = {}
    for down in ops:
        kind = category(down, graph)
        if kind is None or down.id in used:
            continue
        found = _upstream(graph, producer, must_store | outputs, down)
        if found is None:
            continue
        up, between = found
        layout = _layout(up, down, between, graph) if up.id not in used else None
        if layout is None:
            continue
        pairs[down.id] = Pair(up, down, between, kind, layout)
        used |= {up.id, down.id}
    return pairs


def _layout(up: Op, down: Op, between: tuple[Op, ...], graph: Graph) -> str | None:
    """How the pair's tiles see the intermediate, or None when its elements do not reach the
    downstream op in a layout a tile can follow:

    * CHANNELS (conv → conv): the NCHW intermediate unchanged, tiled by channels or pixels;
    * ROWS (product → product): the row-major intermediate in the same order (reshapes may
      regroup its batch dims), tiled by rows;
    * CONV_TO_ROWS: a conv's NCHW result transposed into rows of pixels × channels for a
      product (a patch embedding into a linear layer), tiled by pixels, transposed in the tile;
    * ROWS_TO_CONV: a product's rows of pixels × channels transposed into NCHW for a pointwise
      conv, tiled by pixels, transposed in the tile."""
    conv_up, conv_down = upstream_form(up, graph) is not None, down.op_type == "Conv"
    mid, target = graph.tensors[up.outputs[0]], graph.tensors[down.inputs[0]]
    if conv_up and conv_down:
        same = all(op.mapping == MappingType.ONE_TO_ONE for op in between)
        return CHANNELS if same and mid.shape == target.shape else None
    moved = _element_map(graph, up, between, down)
    if moved is None:
        return None
    if not conv_up and not conv_down:
        in_order = np.array_equal(moved, np.arange(mid.numel))
        return ROWS if in_order and intensive_rows.compatible(up, down, graph) else None
    if conv_up and down.op_type in MATRIX_SPECS and upstream_form(up, graph) == "gemm":
        n, c, h, w = mid.shape
        wanted = np.arange(mid.numel).reshape(n, c, h * w).transpose(0, 2, 1).reshape(-1)
        product = intensive_rows.row_product(down, graph, True)
        ok = product is not None and product.k == c and product.rows == n * h * w
        return CONV_TO_ROWS if ok and np.array_equal(moved, wanted) else None
    if conv_down and not conv_up and category(down, graph) == POINTWISE:
        n, c, h, w = target.shape
        wanted = np.arange(mid.numel).reshape(n, h * w, c).transpose(0, 2, 1).reshape(-1)
        product = intensive_rows.row_product(up, graph, False)
        ok = product is not None and product.n == c and product.rows == n * h * w
        return ROWS_TO_CONV if ok and np.array_equal(moved, wanted) else None
    return None


def _element_map(graph: Graph, up: Op, between: tuple[Op, ...], down: Op) -> np.ndarray | None:
    """Which element of the intermediate each element of the downstream input is (row-major
    offsets), found by carrying the offsets through the ops between: elementwise ops keep them,
    reshapes regroup them, a Transpose permutes them; None if an op between reads the
    intermediate at another element (a broadcast of it)."""
    mid = graph.tensors[up.outputs[0]]
    values = {mid.id: np.arange(mid.numel).reshape(mid.shape)}
    for op in between:
        carried = [values[t] for t in op.present_inputs() if t in values]
        out = graph.tensors[op.outputs[0]]
        if not carried or any(not np.array_equal(v, carried[0]) for v in carried[1:]):
            return None
        value = carried[0]
        if op.op_type == "Transpose":
            value = value.transpose(op.attrs.get("perm") or None)
        elif op.mapping == MappingType.REORGANIZE:
            value = value.reshape(out.shape)
        if value.shape != tuple(out.shape):
            return None
        values[out.id] = value
    found = values.get(down.inputs[0])
    return None if found is None else found.reshape(-1)


def _on_the_path(op: Op) -> bool:
    """Can `op` stand between a pair: an inline op that moves or maps elements one to one
    (elementwise ops, reshapes, Transpose); `_layout` checks where the elements go."""
    if lowering(op.op_type).kind != "inline" or len(op.outputs) != 1:
        return False
    return (op.mapping in (MappingType.ONE_TO_ONE, MappingType.REORGANIZE)
            or op.op_type == "Transpose")


def _upstream(graph: Graph, producer: dict[str, Op], kept: set[str],
              down: Op) -> tuple[Op, tuple[Op, ...]] | None:
    """The complex op whose result reaches `down`'s input through ops of the block that stand
    between (`_on_the_path`; `producer`: the block's tensors), every tensor on the way read by
    nothing but those ops and `down`, and none of them kept in memory (`kept`). Other operands
    of the ops between are constants or tensors read from memory (a residual that is an input
    of the block)."""
    target = down.inputs[0]
    between: dict[str, Op] = {}
    stack = [target]
    ups: set[str] = set()
    while stack:
        t = stack.pop()
        op = producer.get(t)
        if t in kept or (op is None and t == target):
            return None
        if op is None:  # a block input, read from memory
            continue
        if op.mapping == MappingType.MANY_TO_MANY and op.compute_intensive:
            ups.add(op.id)
            continue
        if not _on_the_path(op):
            return None
        if op.id in between:
            continue
        between[op.id] = op
        for i in op.present_inputs():
            if not graph.is_constant(i):
                stack.append(i)
    if len(ups) != 1:
        return None
    up = graph.op_by_id[ups.pop()]
    inside = set(between) | {down.id}
    for op in (up, *between.values()):
        for t in op.outputs:
            if t in kept or any(c.id not in inside for c in graph.consumers(t)):
                return None
    if graph.tensors[up.outputs[0]].numel != graph.tensors[target].numel:
        return None
    return up, tuple(sorted(between.values(), key=lambda o: graph.order[o.id]))


# --- the kernel -------------------------------------------------------------------------------------
class _PairLowering:
    """One parallel loop over tiles; per tile: upstream sums → fill (bias, the ops between) →
    downstream op → its epilogue."""

    def __init__(self, down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair):
        self.ctx, self.up_ctx, self.pair = down_ctx, up_ctx, pair
        self.graph = down_ctx.graph
        self.low = down_ctx.low
        self.schedule = down_ctx.schedule
        self.uk = micro_kernel(down_ctx, FLOAT)
        g = self.graph
        up_conv = pair.up.op_type == "Conv"
        self.x_shape = g.tensors[pair.up.inputs[0]].shape
        # (N, O1, H1, W1): the NCHW intermediate, the conv's side of a pair with a product
        self.mid_shape = g.tensors[(pair.up.outputs if up_conv else pair.down.inputs)[0]].shape
        self.out_shape = g.tensors[pair.down.outputs[0]].shape
        self.w1 = g.tensors[pair.up.inputs[1]].shape
        self.up_window = _geometry(pair.up, g)[0] if up_conv else None
        self.down_window = _geometry(pair.down, g)[0] if pair.down.op_type == "Conv" else None
        self.form = upstream_form(pair.up, g)
        self.budget = self.schedule.intensive_tile_bytes // 4  # floats

    # sizes
    @property
    def pixels(self) -> int:
        return self.mid_shape[2] * self.mid_shape[3]

    def round(self, n: int, unit: int) -> int:
        return -(-n // unit) * unit

    # the upstream op's operands ------------------------------------------------------------------
    def up_spec(self) -> Contraction:
        ctx, w = self.up_ctx, self.up_window
        n_img, channels = self.x_shape[:2]
        o1, k = self.w1[0], math.prod(self.w1[1:])
        read_x = ctx.reader(self.pair.up.inputs[0])
        w1 = self.pair.up.inputs[1]

        def a_at(_: Index, i: Expr, kk: Expr) -> Expr:
            return ctx.builder.value(w1, Index(self.w1, flat=add(mul(i, k), kk)))

        def b_at(bi: Index, kk: Expr, j: Expr) -> Expr:
            (img,) = bi.dims
            c, *tap = Index((channels, *w.kernel), flat=kk).dims
            o = Index(w.out_size, flat=j).dims
            positions = [tap_position(w, d, o[d], tap[d]) for d in range(2)]
            inside = None
            for d, position in enumerate(positions):
                if w.pad_begin[d] or w.pad_end[d]:
                    ok = logical_and(index_compare("ge", position, 0),
                              index_compare("lt", position, w.in_size[d]))
                    inside = ok if inside is None else logical_and(inside, ok)
            clamped = [clamp(p, 0, w.in_size[d] - 1) if (w.pad_begin[d] or w.pad_end[d]) else p
                       for d, p in enumerate(positions)]
            value = read_x(Index(self.x_shape, dims=[img, c, *clamped]))
            if inside is None:
                return value
            return select(inside, value, const(0, FLOAT))

        return Contraction((n_img,), o1, self.pixels, k, (), (n_img,), a_at, b_at,
                           lambda b, i, j: Index(self.mid_shape, flat=add(mul(add(mul(b, o1), i),
                                                                              self.pixels), j)),
                           lambda total, b, i, j: total, FLOAT)

    def up_bias(self, total: Expr, channel: Expr) -> Expr:
        up = self.pair.up
        if len(up.inputs) > 2 and up.inputs[2] is not None:
            bias = self.graph.tensors[up.inputs[2]]
            return binary("add", total, self.up_ctx.builder.value(bias.id, Index(bias.shape,
                                                                                  dims=[channel])))
        return total

    def down_bias(self, total: Expr, channel: Expr) -> Expr:
        ctx = self.ctx
        if ctx.has(2):
            return binary("add", total, ctx.operand(2, Index(ctx.tensor(2).shape, dims=[channel])))
        return total

    def filled(self, value: Expr, img: Expr, channel: Expr, pixel: Expr) -> Expr:
        """The downstream input at (img, channel, pixel) from the upstream sum there: the
        upstream bias, then the ops between."""
        mid = self.pair.up.outputs[0]
        index = Index(self.mid_shape, flat=add(mul(add(mul(img, self.mid_shape[1]), channel),
                                                   self.pixels), pixel))
        builder = self.low.builder({mid: Provided(index.flat, self.up_bias(value, channel))})
        return builder.value(self.pair.down.inputs[0], index)

    # upstream GEMM: rows [r0, r0 + rows) × columns [j0, j0 + cols) into sums[rows][lds] -----------
    def gemm(self, a: Packed, b: Packed, img: Expr, r0: Expr, row_panels: Expr, j0: Expr,
             col_panels: Expr, sums: str, lds: int, k: int) -> ir.Stmt:
        uk, kc_max = self.uk, max(1, self.schedule.gemm_kc)
        k_blocks = -(-k // kc_max)
        kc_size = -(-k // k_blocks)
        kb, jp, ip = (self.ctx.var("kb", k_blocks), self.ctx.var("jp", 1 << 20),
                      self.ctx.var("ip", 1 << 20))
        k0 = mul(kb, kc_size)
        kc = iconst(kc_size) if k % kc_size == 0 else imin(iconst(kc_size), sub(iconst(k), k0))
        call = ir.MicroKernelCall(
            uk, kc, a.buffer, a.offset(iconst(0), k0, add(r0, mul(ip, uk.mr))),
            b.buffer, b.offset(img, k0, add(j0, mul(jp, uk.nr))), b.ld,
            sums, add(mul(ip, uk.mr * lds), mul(jp, uk.nr)), lds,
            index_compare("gt", kb, 0) if k_blocks > 1 else const(False, "bool"))
        return ir.Loop(kb, iconst(0), iconst(k_blocks), [
            ir.Loop(jp, iconst(0), col_panels, [ir.Loop(ip, iconst(0), row_panels, [call])])])

    # upstream depthwise: channels [c0, c0 + count) × output rows [y0, y1) into sums -----------
    def depthwise_up(self, img: Expr, c0: Expr, count: Expr, y0: Expr, y1: Expr, sums: str,
                     lds: int) -> list[ir.Stmt]:
        """Rows and columns whose whole window lies inside the input: every tap unrolled, one
        store per point (the interior); the few border rows and columns accumulate tap by tap
        over their valid taps."""
        w, ctx = self.up_window, self.up_ctx
        (height, width), (kh, kw) = w.out_size, w.kernel
        y_lo, y_hi = _interior(w, 0)
        x_lo, x_hi = _interior(w, 1)
        c = ctx.var("c", 1 << 20)
        channel = add(c0, c)
        read_x = ctx.reader(self.pair.up.inputs[0])
        read_w = ctx.reader(self.pair.up.inputs[1])

        def slot(oy: Expr, col: Expr) -> Expr:
            return add(mul(c, lds), mul(sub(oy, y0), width), col)

        def tap(oy: Expr, ox: Expr, ky: Expr, kx: Expr) -> Expr:
            x = read_x(Index(self.x_shape, dims=[img, channel, tap_position(w, 0, oy, ky),
                                                  tap_position(w, 1, ox, kx)]))
            return binary("mul", read_w(Index(self.w1, dims=[channel, iconst(0), ky, kx])), x)

        def border(rows: tuple[Expr, Expr], cols: tuple[int, int]) -> ir.Loop:
            oy, ox = ctx.var("y", height), ctx.var("x", width)
            ky, kx = ctx.var("k", kh), ctx.var("k", kw)
            zero = ir.Loop(ox, iconst(cols[0]), iconst(cols[1]),
                           [ir.ArrayStore(sums, slot(oy, ox), const(0, FLOAT))], simd=True)
            lo_num = sub(iconst(w.pad_begin[1]), mul(kx, w.dilations[1]))
            col_lo = imax(ceildiv(lo_num, w.strides[1]), cols[0])
            col_hi = imin(ceildiv(add(lo_num, w.in_size[1]), w.strides[1]), cols[1])
            update = ir.ArrayStore(sums, slot(oy, ox), binary(
                "add", array_load(sums, FLOAT, slot(oy, ox)), tap(oy, ox, ky, kx)))
            lo, hi = valid_taps(w, 0, oy)
            taps = ir.Loop(ky, lo, hi, [ir.Loop(kx, iconst(0), iconst(kw),
                                                [ir.Loop(ox, col_lo, col_hi, [update], simd=True)])])
            return ir.Loop(oy, rows[0], rows[1], [zero, taps])

        inner_rows = (imax(y0, y_lo), imin(y1, iconst(y_hi)))
        oy, ox = ctx.var("y", height), ctx.var("x", width)
        total = None
        for ky in range(kh):
            for kx in range(kw):
                term = tap(oy, ox, iconst(ky), iconst(kx))
                total = term if total is None else binary("add", total, term)
        interior = ir.Loop(oy, *inner_rows, [
            ir.Loop(ox, iconst(x_lo), iconst(x_hi), [ir.ArrayStore(sums, slot(oy, ox), total)],
                    simd=True)])
        body = [border((y0, imin(y1, iconst(y_lo))), (0, width)), interior,
                border((imax(y0, y_hi), y1), (0, width))]
        if x_lo > 0:
            body.append(border(inner_rows, (0, x_lo)))
        if x_hi < width:
            body.append(border(inner_rows, (x_hi, width)))
        return [ir.Loop(c, iconst(0), count, body)]

    # Fig. 7a -------------------------------------------------------------------------------------
    def depthwise_pair(self) -> None:
        n_img, channels, height, width = self.mid_shape
        dw = self.down_window
        (kh, kw), (sh, sw), (dh, dwl) = dw.kernel, dw.strides, dw.dilations
        (pt, pl), (oh, ow) = dw.pad_begin, dw.out_size
        hp = max(height + pt, (oh - 1) * sh + (kh - 1) * dh + 1)
        wp = max(width + pl, (ow - 1) * sw + (kw - 1) * dwl + 1)
        gemm = self.form == "gemm"
        unit = self.uk.mr if gemm else 1
        lds = self.round(self.pixels, self.uk.nr) if gemm else self.pixels
        per_channel = lds + hp * wp
        tc = min(self.round(channels, unit),
                 max(unit, (self.budget // per_channel) // unit * unit),
                 max(unit, self.round(-(-channels // 2), unit)))  # two tiles at least
        blocks = -(-channels // tc)
        ctx = self.ctx
        task = ctx.var("p", n_img * blocks)
        img, block = Index((n_img, blocks), flat=task).dims
        c0 = mul(block, tc)
        count = imin(iconst(tc), sub(iconst(channels), c0))
        sums, plane = ctx.name("sums"), ctx.name("plane")
        body: list[ir.Stmt] = [ir.DeclArray(sums, FLOAT, tc * lds),
                               ir.DeclArray(plane, FLOAT, tc * hp * wp)]
        q = ctx.var("q", tc * hp * wp)
        body.append(ir.Loop(q, iconst(0), iconst(tc * hp * wp),
                            [ir.ArrayStore(plane, q, const(0, FLOAT))], simd=True))
        if gemm:
            spec = self.up_spec()
            a, b = self.up_operands(spec)
            row_panels = imin(iconst(tc // unit), floordiv(sub(iconst(channels + unit - 1), c0), unit))
            body.append(self.gemm(a, b, img, c0, row_panels, iconst(0),
                                  iconst(lds // self.uk.nr), sums, lds, spec.k))
        else:
            body += self.depthwise_up(img, c0, count, iconst(0), iconst(height), sums, lds)
        c, y, x = ctx.var("c", tc), ctx.var("y", height), ctx.var("x", width)
        pixel = add(mul(y, width), x)
        value = self.filled(array_load(sums, FLOAT, add(mul(c, lds), pixel)), img, add(c0, c), pixel)
        fill = ir.ArrayStore(plane, add(mul(c, hp * wp), mul(add(y, pt), wp), add(x, pl)), value)
        body.append(ir.Loop(c, iconst(0), count, [ir.Loop(y, iconst(0), iconst(height), [
            ir.Loop(x, iconst(0), iconst(width), [fill], simd=True)])]))
        # the depthwise convolution over the padded planes
        c, oy, ox = ctx.var("c", tc), ctx.var("y", oh), ctx.var("x", ow)
        channel = add(c0, c)
        total: Expr | None = None
        for ky in range(kh):
            for kx in range(kw):
                wv = ctx.operand(1, Index(ctx.tensor(1).shape, dims=[channel, iconst(0), iconst(ky),
                                                                   iconst(kx)]))
                xv = array_load(plane, FLOAT, add(mul(c, hp * wp), mul(add(mul(oy, sh), ky * dh), wp),
                                                  add(mul(ox, sw), kx * dwl)))
                term = binary("mul", wv, xv)
                total = term if total is None else binary("add", total, term)
        out = Index(self.out_shape, dims=[img, channel, oy, ox])
        stores = ctx.results({0: (out, self.down_bias(total, channel))})
        body.append(ir.Loop(c, iconst(0), count, [ir.Loop(oy, iconst(0), iconst(oh), [
            ir.Loop(ox, iconst(0), iconst(ow), stores, simd=True)])]))
        self.finish(task, n_img * blocks, body, f"{tc} channels × {height}×{width}")
        ctx.info.update(tile_channels=tc)

    def up_operands(self, spec: Contraction) -> tuple[Packed, Packed]:
        ctx, uk = self.up_ctx, self.uk
        a = constant_panels(ctx, spec, OperandSide("a", spec.a, (), spec.m), uk.mr)
        b = b_rows(ctx, spec, OperandSide("b", lambda bi, j, k: spec.b(bi, k, j), spec.b_batch,
                                          spec.n), uk.nr)
        assert a is not None  # _geometry admits constant weights only
        return a, b

    # Fig. 7b -------------------------------------------------------------------------------------
    def pointwise_pair(self) -> None:
        n_img, o1, height, width = self.mid_shape
        o2 = self.out_shape[1]
        uk = self.uk
        gemm = self.form == "gemm"
        rows = self.round(o1, uk.mr) if gemm else o1
        if gemm:
            most = self.round(-(-self.pixels // 2), uk.nr)  # two tiles at least
            tp = min(most, max(uk.nr, (self.budget // rows) // uk.nr * uk.nr))
            tiles, band = -(-self.pixels // tp), 0
        else:
            band = max(1, min(-(-height // 2), (self.budget // rows) // max(width, 1)))
            tp = band * width
            tiles = -(-height // band)
        lds = self.round(tp, uk.nr)
        ctx = self.ctx
        task = ctx.var("p", n_img * tiles)
        img, tile = Index((n_img, tiles), flat=task).dims
        p0 = mul(tile, tp)
        valid = imin(iconst(tp), sub(iconst(self.pixels), p0))  # pixels of this tile
        sums = ctx.name("sums")
        body: list[ir.Stmt] = [ir.DeclArray(sums, FLOAT, rows * lds)]
        if lds > tp and not gemm:  # columns past the band: zeros the micro-kernel reads
            q = ctx.var("q", rows * lds)
            body.append(ir.Loop(q, iconst(0), iconst(rows * lds),
                                [ir.ArrayStore(sums, q, const(0, FLOAT))], simd=True))
        if gemm:
            spec = self.up_spec()
            a, b = self.up_operands(spec)
            col_panels = floordiv(add(valid, uk.nr - 1), uk.nr)
            body.append(self.gemm(a, b, img, iconst(0), iconst(rows // uk.mr), p0, col_panels,
                                  sums, lds, spec.k))
        else:
            y0 = mul(tile, band)
            body += self.depthwise_up(img, iconst(0), iconst(o1), y0,
                                      imin(add(y0, band), iconst(height)), sums, lds)
        c, j = ctx.var("c", o1), ctx.var("j", tp)
        slot = add(mul(c, lds), j)
        fill = ir.ArrayStore(sums, slot, self.filled(array_load(sums, FLOAT, slot), img, c,
                                                     add(p0, j)))
        body.append(ir.Loop(c, iconst(0), iconst(o1), [ir.Loop(j, iconst(0), valid, [fill],
                                                                simd=True)]))
        body += self.pointwise_down(img, p0, valid, sums, lds, o1, o2)
        self.finish(task, n_img * tiles, body, f"{o1} channels × {tp} pixels")
        ctx.info.update(tile_pixels=tp)

    def pointwise_down(self, img: Expr, p0: Expr, valid: Expr, sums: str, lds: int, o1: int,
                       o2: int) -> list[ir.Stmt]:
        ctx, uk = self.ctx, self.uk
        w2 = self.pair.down.inputs[1]
        w2_shape = ctx.tensor(1).shape
        spec = Contraction((self.mid_shape[0],), o2, self.pixels, o1, (), (self.mid_shape[0],),
                           lambda _, i, k: ctx.builder.value(w2, Index(w2_shape, flat=add(mul(i, o1), k))),
                           lambda bi, k, j: const(0, FLOAT), lambda b, i, j: Index(self.out_shape, flat=j),
                           lambda total, b, i, j: total, FLOAT)
        a = constant_panels(ctx, spec, OperandSide("a", spec.a, (), o2), uk.mr)
        assert a is not None
        kc_max = max(1, self.schedule.gemm_kc)
        k_blocks = -(-o1 // kc_max)
        kc_size = -(-o1 // k_blocks)
        jp, ip, kb = ctx.var("jp", 1 << 20), ctx.var("ip", -(-o2 // uk.mr)), ctx.var("kb", k_blocks)
        k0 = mul(kb, kc_size)
        kc = iconst(kc_size) if o1 % kc_size == 0 else imin(iconst(kc_size), sub(iconst(o1), k0))
        tile = ctx.name("ct")
        call = ir.MicroKernelCall(uk, kc, a.buffer, a.offset(iconst(0), k0, mul(ip, uk.mr)),
                                  sums, add(mul(k0, lds), mul(jp, uk.nr)), lds, tile, iconst(0),
                                  uk.nr, index_compare("gt", kb, 0) if k_blocks > 1
                                  else const(False, "bool"))
        i, j = ctx.var("i", o2), ctx.var("j", uk.nr)
        channel = add(mul(ip, uk.mr), i)
        pixel = add(p0, mul(jp, uk.nr), j)
        total = self.down_bias(array_load(tile, FLOAT, add(mul(i, uk.nr), j)), channel)
        out = Index(self.out_shape, flat=add(mul(add(mul(img, o2), channel), self.pixels), pixel))
        stores = ctx.results({0: (out, total)})
        rows_here = imin(iconst(uk.mr), sub(iconst(o2), mul(ip, uk.mr)))
        cols_here = imin(iconst(uk.nr), sub(valid, mul(jp, uk.nr)))
        epilogue = ir.Loop(i, iconst(0), rows_here, [ir.Loop(j, iconst(0), cols_here, stores,
                                                             simd=True)])
        return [ir.DeclArray(tile, FLOAT, uk.mr * uk.nr),
                ir.Loop(jp, iconst(0), floordiv(add(valid, uk.nr - 1), uk.nr), [
                    ir.Loop(ip, iconst(0), iconst(-(-o2 // uk.mr)), [
                        ir.Loop(kb, iconst(0), iconst(k_blocks), [call]), epilogue])])]

    def finish(self, task: Expr, tasks: int, body: list[ir.Stmt], tile: str) -> None:
        up, down = self.pair.up, self.pair.down
        work = (self.graph.tensors[up.outputs[0]].numel * math.prod(self.w1[1:])
                + self.graph.tensors[down.outputs[0]].numel * math.prod(self.ctx.tensor(1).shape[1:]))
        self.ctx.stage(f"intensive fusion ({up.id} → {down.id}), {self.pair.category}: tiles of {tile}",
                       [ir.Loop(task, iconst(0), iconst(tasks), body, parallel=1, grain="one")],
                       work)
        self.ctx.info.update(form=f"intensive {self.pair.category}", upstream=self.form)


def _interior(w: Window, d: int) -> tuple[int, int]:
    """[lo, hi): the output positions of dim d whose every tap lies inside the input."""
    lo = min(w.out_size[d], -(-w.pad_begin[d] // w.strides[d]))
    hi = (w.in_size[d] - 1 - (w.kernel[d] - 1) * w.dilations[d] + w.pad_begin[d]) // w.strides[d] + 1
    return lo, max(lo, min(w.out_size[d], hi))


# --- a conv and a matrix product across a transposition -----------------------------------------
def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _cross_sizes(pair: Pair, graph: Graph) -> tuple[int, int, int, int]:
    """(images, channels, pixels, K1) of a pair of a conv and a product: the NCHW side's shape
    and the upstream op's sum length per output element."""
    conv_side = pair.up.outputs[0] if pair.layout == CONV_TO_ROWS else pair.down.inputs[0]
    n_img, channels, height, width = graph.tensors[conv_side].shape
    k1 = (math.prod(graph.tensors[pair.up.inputs[1]].shape[1:]) if pair.layout == CONV_TO_ROWS
          else intensive_rows.row_product(pair.up, graph, False).k)
    return n_img, channels, height * width, k1


def cross_tile_pixels(pair: Pair, graph: Graph, tile_bytes: int, mr: int, nr: int) -> int:
    """Pixels per tile of a conv ↔ product pair: whole micro-kernel panels on both sides (`mr`
    rows of the product, `nr` columns of the conv's GEMM), as many as the budget holds, two tiles
    per image at least. Per pixel a tile holds every channel twice (the conv's sums and the
    product's panels) or, from a product, its packed input row and every channel."""
    _, channels, pixels, k1 = _cross_sizes(pair, graph)
    unit = _lcm(mr, nr)
    per_pixel = (-(-channels // mr) * mr + channels if pair.layout == CONV_TO_ROWS
                 else k1 + channels)
    fitting = max(unit, (tile_bytes // 4 // per_pixel) // unit * unit)
    return min(fitting, max(unit, -(-(-(-pixels // 2)) // unit) * unit))


def _cross_fits(pair: Pair, graph: Graph, tile_bytes: int, mr: int, nr: int) -> bool:
    _, channels, pixels, k1 = _cross_sizes(pair, graph)
    unit = _lcm(mr, nr)
    per_pixel = (-(-channels // mr) * mr + channels if pair.layout == CONV_TO_ROWS
                 else k1 + channels)
    return pixels >= unit and unit * per_pixel * 4 <= tile_bytes


def _conv_to_rows(down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair) -> None:
    """Per tile of one image's pixels: the conv's GEMM for every channel × the tile's pixels
    (channel-major sums), its bias and the ops between applied while the sums are transposed
    into the product's A panels (pixels × channels), then the product over them."""
    conv, rows = _PairLowering(down_ctx, up_ctx, pair), intensive_rows.RowPairLowering(
        down_ctx, up_ctx, pair)
    ctx, uk, graph = down_ctx, conv.uk, down_ctx.graph
    n_img, channels, pixels, _ = _cross_sizes(pair, graph)
    tm = cross_tile_pixels(pair, graph, ctx.schedule.intensive_tile_bytes, uk.mr, uk.nr)
    tiles, o1p = -(-pixels // tm), -(-channels // uk.mr) * uk.mr
    task = ctx.var("p", n_img * tiles)
    img, tile = Index((n_img, tiles), flat=task).dims
    p0 = mul(tile, tm)
    valid = imin(iconst(tm), sub(iconst(pixels), p0))
    row_panels = floordiv(add(valid, uk.mr - 1), uk.mr)
    sums, mid, ct = ctx.name("sums"), ctx.name("mid"), ctx.name("ct")
    spec = conv.up_spec()
    a, b = conv.up_operands(spec)
    body: list[ir.Stmt] = [ir.DeclArray(sums, FLOAT, o1p * tm), ir.DeclArray(mid, FLOAT, tm * channels),
                           ir.DeclArray(ct, FLOAT, uk.mr * uk.nr),
                           conv.gemm(a, b, img, iconst(0), iconst(o1p // uk.mr), p0,
                                     floordiv(add(valid, uk.nr - 1), uk.nr), sums, tm, spec.k)]
    pp, r, c = ctx.var("ip", tm // uk.mr), ctx.var("r", uk.mr), ctx.var("c", channels)
    local = imin(add(mul(pp, uk.mr), r), sub(valid, 1))  # rows past the image repeat its last
    pixel = add(p0, local)
    total = conv.up_bias(array_load(sums, FLOAT, add(mul(c, tm), local)), c)
    target = graph.tensors[pair.down.inputs[0]]
    value = intensive_rows.through_the_ops_between(
        down_ctx.low, pair.up.outputs[0], total, target.id,
        Index(target.shape, flat=add(mul(add(mul(img, pixels), pixel), channels), c)))
    fill = ir.ArrayStore(mid, add(mul(add(mul(pp, channels), c), uk.mr), r), value)
    body.append(ir.Loop(pp, iconst(0), row_panels, [ir.Loop(r, iconst(0), iconst(uk.mr), [
        ir.Loop(c, iconst(0), iconst(channels), [fill], simd=True)])]))
    r0 = add(mul(img, pixels), p0)
    w2 = rows.weights(ctx, rows.down)
    body.append(rows.products(mid, channels, w2, rows.down.n, row_panels, ct,
                              lambda jp, ip: rows.epilogue(r0, jp, ip, ct, add(r0, valid)),
                              tm // uk.mr))
    _cross_stage(ctx, pair, task, n_img * tiles, body, tm, uk)


def _rows_to_conv(down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair) -> None:
    """Per tile of one image's pixels: the product's rows (pixels) × every channel through the
    micro-kernel, its finish and the ops between applied while each register tile is transposed
    into channel-major sums, then the pointwise conv over them."""
    conv, rows = _PairLowering(down_ctx, up_ctx, pair), intensive_rows.RowPairLowering(
        down_ctx, up_ctx, pair)
    ctx, uk, graph, up = down_ctx, conv.uk, down_ctx.graph, rows.up
    n_img, channels, pixels, k1 = _cross_sizes(pair, graph)
    tm = cross_tile_pixels(pair, graph, ctx.schedule.intensive_tile_bytes, uk.mr, uk.nr)
    tiles = -(-pixels // tm)
    task = ctx.var("p", n_img * tiles)
    img, tile = Index((n_img, tiles), flat=task).dims
    p0 = mul(tile, tm)
    valid = imin(iconst(tm), sub(iconst(pixels), p0))
    r0 = add(mul(img, pixels), p0)
    last = sub(add(mul(img, pixels), pixels), 1)  # rows past the image repeat its last
    panels = iconst(tm // uk.mr)  # every column of the sums the conv's micro-kernel reads
    packed, sums, ct = ctx.name("rows"), ctx.name("sums"), ctx.name("ct")
    body: list[ir.Stmt] = [ir.DeclArray(packed, FLOAT, tm * k1),
                           ir.DeclArray(sums, FLOAT, channels * tm),
                           ir.DeclArray(ct, FLOAT, uk.mr * uk.nr),
                           rows.pack_rows(r0, panels, packed, last, tm // uk.mr)]
    target = graph.tensors[pair.down.inputs[0]]

    def fill(jp: Expr, ip: Expr) -> list[ir.Stmt]:
        r, cc = ctx.var("r", uk.mr), ctx.var("c", uk.nr)
        local = add(mul(ip, uk.mr), r)
        pixel = imin(add(p0, local), iconst(pixels - 1))
        j = add(mul(jp, uk.nr), cc)
        if math.prod(up.batch) == n_img and up.m == pixels:
            b, i = (img if up.batch else iconst(0)), pixel
        else:
            b, i = rows.row(up, add(mul(img, pixels), pixel))
        total = up.finish(array_load(ct, FLOAT, add(mul(r, uk.nr), cc)), b, i, j)
        value = intensive_rows.through_the_ops_between(
            ctx.low, pair.up.outputs[0], total, target.id,
            Index(target.shape, flat=add(mul(add(mul(img, channels), j), pixels), pixel)))
        cols = imin(iconst(uk.nr), sub(iconst(channels), mul(jp, uk.nr)))
        return [ir.Loop(r, iconst(0), iconst(uk.mr), [ir.Loop(cc, iconst(0), cols, [
            ir.ArrayStore(sums, add(mul(j, tm), local), value)], simd=True)])]

    body.append(rows.products(packed, k1, rows.weights(up_ctx, up), channels, panels, ct, fill,
                              tm // uk.mr))
    body += conv.pointwise_down(img, p0, valid, sums, tm, channels, conv.out_shape[1])
    _cross_stage(ctx, pair, task, n_img * tiles, body, tm, uk)


def _cross_stage(ctx: StageCtx, pair: Pair, task: Expr, tasks: int, body: list[ir.Stmt], tm: int,
                 uk) -> None:
    graph = ctx.graph
    work = sum(graph.tensors[op.outputs[0]].numel * graph.tensors[op.inputs[0]].shape[-1]
               for op in (pair.up, pair.down))
    ctx.stage(f"intensive fusion ({pair.up.id} → {pair.down.id}), {pair.category}, {pair.layout}: "
              f"tiles of {tm} pixels", [ir.Loop(task, iconst(0), iconst(tasks), body, parallel=1,
                                                grain="one")], work)
    ctx.info.update(form=f"intensive {pair.category}", upstream=pair.layout, tile_pixels=tm,
                    micro_kernel=f"{uk.mr}x{uk.nr}")


def lower_pair(down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair) -> None:
    """Emit the fused stage of `pair` (whose tile `fits`)."""
    if pair.layout in (CONV_TO_ROWS, ROWS_TO_CONV):
        (_conv_to_rows if pair.layout == CONV_TO_ROWS else _rows_to_conv)(down_ctx, up_ctx, pair)
        return
    if pair.rows:
        intensive_rows.lower_row_pair(down_ctx, up_ctx, pair)
        return
    pair_lowering = _PairLowering(down_ctx, up_ctx, pair)
    if pair.category == DEPTHWISE:
        pair_lowering.depthwise_pair()
    else:
        pair_lowering.pointwise_pair()


def tile_shape(schedule: Schedule) -> tuple[int, int]:
    """(mr, nr) of the micro-kernel the schedule selects."""
    uk = tile_for((), FLOAT, schedule.vector_bytes, schedule.gemm_mr, schedule.gemm_nr)
    return uk.mr, uk.nr


def fits(pair: Pair, graph: Graph, tile_bytes: int, mr: int, nr: int) -> bool:
    """Whether the pair's smallest tile fits `tile_bytes` (decided before lowering, so that a
    pair that cannot be fused is lowered as two stages), and a matrix-product upstream op has at
    least one micro-kernel panel of pixels (below that the panel is mostly padding)."""
    if pair.layout in (CONV_TO_ROWS, ROWS_TO_CONV):
        return _cross_fits(pair, graph, tile_bytes, mr, nr)
    if pair.rows:
        return intensive_rows.fits(pair, graph, tile_bytes, mr)
    n_img, channels, height, width = graph.tensors[pair.up.outputs[0]].shape
    budget = tile_bytes // 4
    gemm = upstream_form(pair.up, graph) == "gemm"
    pixels = height * width
    if gemm and pixels < nr:  # less than one micro-kernel panel (a squeeze-and-excite 1×1 map)
        return False
    if pair.category == DEPTHWISE:
        dw = _geometry(pair.down, graph)[0]
        hp = max(height + dw.pad_begin[0], (dw.out_size[0] - 1) * dw.strides[0]
                 + (dw.kernel[0] - 1) * dw.dilations[0] + 1)
        wp = max(width + dw.pad_begin[1], (dw.out_size[1] - 1) * dw.strides[1]
                 + (dw.kernel[1] - 1) * dw.dilations[1] + 1)
        lds = -(-pixels // nr) * nr if gemm else pixels
        return (mr if gemm else 1) * (lds + hp * wp) <= budget
    rows = -(-channels // mr) * mr if gemm else channels
    smallest = nr if gemm else -(-width // nr) * nr
    return rows * smallest <= budget

