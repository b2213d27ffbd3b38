"""Winograd convolution F(m×m, 3×3) for 3×3, stride-1, undilated, ungrouped float convs with
constant weights (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).

The output is cut into m × m tiles (m = 2: see MIN_TILE_PANELS), each computed from an
α × α input tile (α = m + 2). Three stages:
1. input transform, vectorised over the tile columns: V[ξ][c][t] = (Bᵀ d B)[ξ] for the input
   tile d of tile t (zero in the padding);
2. α² GEMMs, M[ξ] = U[ξ] · V[ξ] (K × C by C × tiles), U[ξ] = (G g Gᵀ)[ξ] transformed and packed
   in panels at compile time;
3. output transform, vectorised over the tile columns: Y = Aᵀ M A per tile, then the bias and the
   fused epilogue per output element.
Where U fits in half the L2 and the image has several bands of tile rows whose V and M blocks fit
beside it (`band_rows`: 64 channels on 56 × 56 with a 1 MB L2), one parallel loop over the bands
runs all three for a band in each task, the products as micro-kernel calls on the band's blocks
(`_banded`); otherwise each stage is a parallel loop over the whole image, the products through
the packed GEMM (`_whole_image`). On a 2-vCPU Zen 4 VM ResNet-50's three 56 × 56 convs took the
same time either way while the host was quiet (0.96-1.04x), and 0.64-0.92x by bands in the
phases, seconds long, when the host slowed memory-bound code (their whole-image time 1.9x its
quiet time, by bands 1.3x).

The GEMMs do α²/(9·m²) of a direct conv's multiplications (2.25× fewer for m = 2, 4× for
m = 4), at the price of the transforms' memory traffic and α²·K·C transformed weights (1.8× or 4×
the weights): it pays where the image has many tiles for those weights to serve
(`winograd_tile_size`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    add,
    binary,
    clamp,
    const,
    floordiv,
    iconst,
        imin,
    index_compare,
    load,
    logical_and,
    mul,
    select,
    sub,
)
from kiln.codegen.gemm.blocking import BALANCE_THREADS, balanced, round_up
from kiln.codegen.gemm.packed import micro_kernel, packed_gemm
from kiln.codegen.gemm.packing import Packed, array_panels
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import MicroKernel
from kiln.codegen.ops.conv_window import ConvOperands, Window, ceildiv


# (Aᵀ, G, Bᵀ) per output tile size m, for a 3-tap kernel
TRANSFORMS = {
    2: ([[1, 1, 1, 0], [0, 1, -1, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]),
    4: ([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
        [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
         [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]),
}
# The GEMMs' columns are the tiles, padded to whole micro-kernel panels, and the α²-fold
# transformed weights are read once per image: an image needs at least a panel's worth of tiles.
# (Measured on AVX-512, 1 thread, 256/512 channels: 14 × 14 — 49 tiles of 2 × 2 in two panels
# of 32 — runs 1.6× faster than the direct kernel; 7 × 7 — 16 tiles, half a panel — 2× slower.
# F(4×4, 3×3) did no better than F(2×2) at 28 × 28 and 56 × 56, with 10× the rounding error.)
MIN_TILE_PANELS = 1
# An AVX-512 build once asked for two panels of tiles and 128 input channels, from chains of
# convs timed on a Zen 4 class host (49 tiles of 14 x 14 at 192-256 channels: the pixel-rows
# kernel 0.85-0.97x Winograd's time) and on a 2-core Xeon (64 channels at 56 x 56: the direct
# kernel 0.78x). In ResNet-50 on a Zen 4 (family 25 model 17, 2 threads, kernel_ab 20-25
# rounds), Winograd ran its five 14 x 14 x 256 convs in 0.88-0.90 ms against the pixel-rows
# kernel's 1.10-1.12 and its three 56 x 56 x 64 convs in 0.97-1.02 against the direct kernel's
# 1.15-1.18; chains of four 3 x 3 convs took 0.79x (14 x 14 x 256), 0.84x (14 x 14 x 192),
# 0.90x (12 x 12 x 384) and 0.89x (56 x 56 x 64) the time by Winograd. 7 x 7 x 512 (16 tiles,
# half a panel of 32) stays with the pixel-rows kernel: 1.55 ms by Winograd against 1.21; and
# 32 channels at 56 x 56, whose transforms' traffic outweighs the products saved: 1.35x the
# direct kernel's time.
MIN_CHANNELS_BY_VECTOR_BYTES = {64: 64}


def winograd_tile_size(ctx: StageCtx, w: Window, group: int, acc_dtype: str,
                       in_channels: int) -> int:
    """The output tile size m to run this conv with (0: not a Winograd conv). F(2×2, 3×3): its
    transforms are exact in float arithmetic up to halves, and the GEMMs have N = tiles."""
    if (len(w.kernel) != 2 or tuple(w.kernel) != (3, 3) or any(s != 1 for s in w.strides)
            or any(d != 1 for d in w.dilations) or group != 1 or acc_dtype != "float32"
            or ctx.const(1) is None):
        return 0
    m = 2
    tiles = math.prod(-(-o // m) for o in w.out_size)
    s = ctx.schedule
    if not s.conv_winograd or s.vector_bytes == 0 or ctx.out().shape[1] < s.gemm_min_m:
        return 0
    uk = micro_kernel(ctx, acc_dtype)
    if in_channels < MIN_CHANNELS_BY_VECTOR_BYTES.get(uk.vector_bytes, 0):
        return 0
    return m if tiles >= MIN_TILE_PANELS * uk.nr else 0


def _combination(coefficients, values: list[Expr], dtype: str) -> Expr:
    """Σ coefficient · value, skipping zeros and multiplying only by coefficients other than ±1."""
    total: Expr | None = None
    for c, v in zip(coefficients, values):
        if c == 0:
            continue
        term = v if abs(c) == 1 else binary("mul", v, const(abs(c), dtype))
        if total is None:
            total = term if c > 0 else binary("sub", const(0, dtype), term)
        else:
            total = binary("add" if c > 0 else "sub", total, term)
    return total if total is not None else const(0, dtype)


def _sandwich(left, tile: list[list[Expr]], dtype: str) -> list[list[Expr]]:
    """left · tile · leftᵀ, as expressions."""
    size = len(tile)
    rows = [[_combination([row[r] for r in range(size)], [tile[r][s] for r in range(size)], dtype)
             for s in range(len(tile[0]))] for row in left]
    return [[_combination(col, rows[a], dtype) for col in left] for a in range(len(rows))]


def winograd_conv(ctx: StageCtx, w: Window, w_shape: tuple[int, ...], ops: ConvOperands,
                  in_shape: tuple[int, ...], m: int) -> None:
    g_matrix = np.array(TRANSFORMS[m][1], dtype=np.float64)
    dtype = ops.acc_dtype
    kout, channels = w_shape[0], in_shape[1]
    th, tw = (-(-o // m) for o in w.out_size)
    uk = micro_kernel(ctx, dtype)
    geometry = _Tiles(w, m, in_shape[0], channels, kout, round_up(kout, uk.mr), th, tw)
    points, rows = geometry.points, geometry.rows
    weights = ctx.const(1).astype(np.float64)
    u = np.einsum("xa,kcab,yb->xykc", g_matrix, weights, g_matrix).reshape(points, kout, channels)
    u = np.concatenate([u, np.zeros((points, rows - kout, channels))], axis=1)
    packed_u = array_panels(ctx, u.astype(dtype), uk.mr)
    band = band_rows(ctx, geometry, uk)
    if band:
        _banded(ctx, geometry, ops, in_shape, uk, packed_u, band)
    else:
        _whole_image(ctx, geometry, w_shape, ops, in_shape, uk, packed_u)
    ctx.info.update(form=f"Winograd F({m}x{m}, 3x3)", tiles=th * tw,
                    **({"band_rows": band} if band else {}))


@dataclass(frozen=True)
class _Tiles:
    """A Winograd conv's sizes: m × m output tiles, th × tw of them per image; `rows`, the output
    channels rounded up to whole micro-kernel panels."""

    w: Window
    m: int
    batch: int
    channels: int
    kout: int
    rows: int
    th: int
    tw: int

    @property
    def alpha(self) -> int:
        return self.m + 2

    @property
    def points(self) -> int:
        return self.alpha * self.alpha

    @property
    def tiles(self) -> int:
        return self.th * self.tw


def band_rows(ctx: StageCtx, g: _Tiles, uk: MicroKernel) -> int:
    """Rows of tiles per band, or 0 to run the three stages each over the whole image. A band
    task transforms its tiles' input, multiplies and transforms back while its V and M blocks
    and all of U stay in the core's L2 (`gemm_l2_bytes`); over the whole image V and M (3.2 MB
    each for 64 channels on 56 × 56) go out to L3 and back between the stages. Taken where U
    needs at most half of L2 and the image has at least two bands: the most rows whose bands
    split evenly over 2 and `BALANCE_THREADS` threads, if any do. Whole rows, so that the
    transforms' loops along a row keep the constant bounds their vectorisation needs (bands cut
    through rows ran the transforms scalar: 2x the time)."""
    itemsize = np.dtype("float32").itemsize
    l2 = ctx.schedule.gemm_l2_bytes
    u_bytes = g.points * g.rows * g.channels * itemsize
    if l2 <= 0 or 2 * u_bytes > l2 or ctx.schedule.gemm_work_group:  # (a GPU: no micro-kernel)
        return 0
    fits = (l2 - u_bytes) // (g.points * (g.channels + g.rows) * itemsize)
    candidates = [r for r in range(1, g.th)  # at least two bands
                  if 2 * r <= g.th + 1 and round_up(r * g.tw, uk.nr) <= fits]
    return max(candidates, default=0,
               key=lambda r: (balanced(g.batch * -(-g.th // r), BALANCE_THREADS), r))


def _input_tile(g: _Tiles, ops: ConvOperands, in_shape: tuple[int, ...], n: Expr, c: Expr,
                ty: Expr, tx: Expr, dtype: str) -> list[list[Expr]]:
    """Bᵀ d B of the input tile d of tile (ty, tx) of channel c (zero in the padding)."""
    bt = np.array(TRANSFORMS[g.m][2], dtype=np.float64)
    (ih, iw), (ph, pw) = g.w.in_size, g.w.pad_begin
    tile: list[list[Expr]] = []
    for r in range(g.alpha):
        y = sub(add(mul(ty, g.m), r), ph)
        row = []
        for s in range(g.alpha):
            x = sub(add(mul(tx, g.m), s), pw)
            inside = logical_and(
                logical_and(index_compare("ge", y, 0), index_compare("lt", y, ih)),
                logical_and(index_compare("ge", x, 0), index_compare("lt", x, iw)))
            value = ops.once(Index(in_shape, dims=[n, c, clamp(y, 0, ih - 1), clamp(x, 0, iw - 1)]))
            row.append(select(inside, value, const(0, dtype)))
        tile.append(row)
    return _sandwich(bt, tile, dtype)


def _output_tile(ctx: StageCtx, g: _Tiles, ops: ConvOperands, n: Expr, k: Expr, ty: Expr,
                 tx: Expr, products: list[list[Expr]]) -> list[ir.Stmt]:
    """Y = Aᵀ M A of tile (ty, tx) of output channel k from its α × α `products`, then the bias
    and the fused epilogue per output element inside the image."""
    at = np.array(TRANSFORMS[g.m][0], dtype=np.float64)
    (oh, ow), out = g.w.out_size, ctx.out()
    result = _sandwich(at, products, ops.acc_dtype)
    body: list[ir.Stmt] = []
    for a in range(g.m):
        oy = add(mul(ty, g.m), a)
        row: list[ir.Stmt] = []
        for b in range(g.m):
            ox = add(mul(tx, g.m), b)
            stmts = ctx.results({0: (Index(out.shape, dims=[n, k, oy, ox]),
                                     ops.finish(result[a][b], k))})
            if (g.tw - 1) * g.m + b >= ow:
                stmts = [ir.If(index_compare("lt", ox, ow), stmts)]
            row += stmts
        if (g.th - 1) * g.m + a >= oh:
            row = [ir.If(index_compare("lt", oy, oh), row)]
        body += row
    return body


def _whole_image(ctx: StageCtx, g: _Tiles, w_shape: tuple[int, ...], ops: ConvOperands,
                 in_shape: tuple[int, ...], uk: MicroKernel, packed_u: Packed) -> None:
    """Three stages over the whole image, each a parallel loop of its own: the input transform
    into V[n][ξ][c][t], the α² GEMMs M[n][ξ] = U[ξ] · V[n][ξ] through the packed GEMM, the output
    transform."""
    dtype, batch, channels, kout, points = ops.acc_dtype, g.batch, g.channels, g.kout, g.points
    th, tw, tiles = g.th, g.tw, g.tiles
    padded_tiles = round_up(tiles, uk.nr)
    g_matrix = np.array(TRANSFORMS[g.m][1], dtype=np.float64)

    # 1. input transform into V[n][ξ][c][t], the tiles past the last zeroed
    v_buf = ctx.scratch(dtype, batch * points * channels * padded_tiles)
    q = ctx.var("q", batch * channels * th)
    n, c, ty = Index((batch, channels, th), flat=q).dims
    tx = ctx.var("t", tw)
    transformed = _input_tile(g, ops, in_shape, n, c, ty, tx, dtype)
    stores = [ir.Store(v_buf, add(mul(add(mul(add(mul(n, points), xi * g.alpha + nu), channels),
                                          c), padded_tiles), mul(ty, tw), tx),
                       transformed[xi][nu])
              for xi in range(g.alpha) for nu in range(g.alpha)]
    stages = [ir.Loop(q, iconst(0), iconst(batch * channels * th),
                      [ir.Loop(tx, iconst(0), iconst(tw), stores, simd=True)], parallel=1,
                      grain="chunks")]
    if padded_tiles > tiles:
        z = ctx.var("z", batch * points * channels)
        t = ctx.var("t", padded_tiles - tiles, tiles)
        stages.append(ir.Loop(z, iconst(0), iconst(batch * points * channels), [
            ir.Loop(t, iconst(tiles), iconst(padded_tiles),
                    [ir.Store(v_buf, add(mul(z, padded_tiles), t), const(0, dtype))])]))
    ctx.stage(f"Winograd input transform of {ctx.op.id}", stages,
              batch * channels * tiles * points)

    # 2. α² GEMMs M[n][ξ] = U[ξ] · V[n][ξ]
    m_buf = ctx.scratch(dtype, batch * points * kout * padded_tiles)

    def u_at(bi: Index, i: Expr, k: Expr) -> Expr:  # (G g Gᵀ)[ξ][i][k] from the weights
        (xi,) = bi.dims
        taps = [[ops.read_w(Index(w_shape, dims=[i, k, iconst(a), iconst(b)])) for b in range(3)]
                for a in range(3)]
        return select_point(_sandwich(g_matrix, taps, dtype), xi)

    def v_at(bi: Index, k: Expr, j: Expr) -> Expr:
        return load(v_buf, dtype, add(mul(add(mul(bi.flat, channels), k), padded_tiles), j))

    def m_at(b: Expr, i: Expr, j: Expr) -> Index:
        return Index((batch * points, kout, padded_tiles), dims=[b, i, j])

    spec = Contraction((batch, points), kout, padded_tiles, channels, (points,), (batch, points),
                       u_at, v_at, m_at, lambda total, b, i, j: total, dtype,
                       store=lambda b, i, j, value: [ir.Store(m_buf, m_at(b, i, j).flat, value)])
    packed_gemm(ctx, spec, packed_u)
    ctx.attach_info()

    # 3. output transform, bias and epilogue
    q = ctx.var("q", batch * kout * th)
    n, k, ty = Index((batch, kout, th), flat=q).dims
    tx = ctx.var("t", tw)
    t_index = add(mul(ty, tw), tx)
    products = [[load(m_buf, dtype, add(mul(add(mul(add(mul(n, points), xi * g.alpha + nu), kout),
                                                k), padded_tiles), t_index))
                 for nu in range(g.alpha)] for xi in range(g.alpha)]
    ctx.stage(f"Winograd output transform of {ctx.op.id}",
              [ir.Loop(q, iconst(0), iconst(batch * kout * th),
                       [ir.Loop(tx, iconst(0), iconst(tw),
                                _output_tile(ctx, g, ops, n, k, ty, tx, products), simd=True)],
                       parallel=1, grain="chunks")], batch * kout * tiles * points)


def _banded(ctx: StageCtx, g: _Tiles, ops: ConvOperands, in_shape: tuple[int, ...],
            uk: MicroKernel, packed_u: Packed, rows_per_band: int) -> None:
    """One parallel loop over bands of `rows_per_band` rows of tiles, each task doing all three
    stages for its tiles: V and M are the band's blocks (V[ξ][c][j], M[ξ][k][j], `band` columns:
    the band's tiles in whole panels), and the α² products run as micro-kernel calls straight on
    them, U in constant panels, V's rows read in place."""
    dtype, points, channels, rows, tw = ops.acc_dtype, g.points, g.channels, g.rows, g.tw
    band = round_up(rows_per_band * tw, uk.nr)
    bands = -(-g.th // rows_per_band)
    v_buf = ctx.scratch(dtype, g.batch * bands * points * channels * band)
    m_buf = ctx.scratch(dtype, g.batch * bands * points * rows * band)
    q = ctx.var("q", g.batch * bands)
    n, b = Index((g.batch, bands), flat=q).dims
    first = mul(b, rows_per_band)  # the band's first row of tiles
    end = imin(add(first, rows_per_band), iconst(g.th))
    count = mul(sub(end, first), tw)  # the band's tiles
    v0, m0 = mul(q, points * channels * band), mul(q, points * rows * band)

    def over_band_tiles(ty: Expr, tx: Expr, body: list[ir.Stmt]) -> ir.Loop:
        return ir.Loop(ty, first, end, [ir.Loop(tx, iconst(0), iconst(tw), body, simd=True)])

    c, ty, tx = ctx.var("c", channels), ctx.var("ty", g.th), ctx.var("t", tw)
    j = add(mul(sub(ty, first), tw), tx)
    transformed = _input_tile(g, ops, in_shape, n, c, ty, tx, dtype)
    input_stage = ir.Loop(c, iconst(0), iconst(channels), [over_band_tiles(ty, tx, [
        ir.Store(v_buf, add(v0, add(mul(add(mul(iconst(xi * g.alpha + nu), channels), c), band),
                                    j)), transformed[xi][nu])
        for xi in range(g.alpha) for nu in range(g.alpha)])])
    z, jz = ctx.var("z", points * channels), ctx.var("j", band)
    zero_tail = ir.If(index_compare("lt", count, band), [
        ir.Loop(z, iconst(0), iconst(points * channels), [
            ir.Loop(jz, count, iconst(band),
                    [ir.Store(v_buf, add(v0, add(mul(z, band), jz)), const(0, dtype))],
                    simd=True)])])

    xi, ip, jp = ctx.var("xi", points), ctx.var("ip", rows // uk.mr), ctx.var("jp", band // uk.nr)
    product = ir.MicroKernelCall(
        uk, iconst(channels), packed_u.buffer, packed_u.offset(xi, iconst(0), mul(ip, uk.mr)),
        v_buf, add(v0, add(mul(xi, channels * band), mul(jp, uk.nr))), band,
        m_buf, add(m0, add(mul(add(mul(xi, rows), mul(ip, uk.mr)), band), mul(jp, uk.nr))), band,
        iconst(0))
    products_stage = ir.Loop(xi, iconst(0), iconst(points), [
        ir.Loop(ip, iconst(0), iconst(rows // uk.mr), [
            ir.Loop(jp, iconst(0), ceildiv(count, uk.nr), [product])])])

    k, ty2, tx2 = ctx.var("k", g.kout), ctx.var("ty", g.th), ctx.var("t", tw)
    j2 = add(mul(sub(ty2, first), tw), tx2)
    products = [[load(m_buf, dtype, add(m0, add(mul(add(mul(iconst(xi_ * g.alpha + nu), rows), k),
                                                    band), j2)))
                 for nu in range(g.alpha)] for xi_ in range(g.alpha)]
    output_stage = ir.Loop(k, iconst(0), iconst(g.kout), [
        over_band_tiles(ty2, tx2, _output_tile(ctx, g, ops, n, k, ty2, tx2, products))])
    ctx.stage(f"Winograd conv of {ctx.op.id} by bands of {rows_per_band} rows of tiles",
              [ir.Loop(q, iconst(0), iconst(g.batch * bands),
                       [input_stage, zero_tail, products_stage, output_stage], parallel=1,
                       grain=ctx.schedule.task_grain)],
              g.batch * g.tiles * points * (channels + g.kout))


def select_point(points: list[list[Expr]], xi: Expr) -> Expr:
    """The element ξ (flat over the α × α tile) of a tile of expressions, as a chain of selects."""
    flat = [e for row in points for e in row]
    chosen = flat[-1]
    for position in reversed(range(len(flat) - 1)):
        chosen = select(index_compare("eq", xi, position), flat[position], chosen)
    return chosen

