"""Winograd convolution F(m×m, 3×3) for 3×3, stride-1, undilated, ungrouped float convs with
constant weights (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).

The output is cut into m × m tiles (m = 2: see MIN_TILE_PANELS), each computed from an
α × α input tile (α = m + 2). Three stages:
1. input transform, one parallel loop over (image, channel, tile row), vectorised over the tile
   columns: V[ξ][c][t] = (Bᵀ d B)[ξ] for the input tile d of tile t (zero in the padding);
2. α² GEMMs, M[ξ] = U[ξ] · V[ξ] (K × C by C × tiles), through the packed GEMM, U[ξ] = (G g Gᵀ)[ξ]
   transformed and packed in panels at compile time;
3. output transform, vectorised over the tile columns: Y = Aᵀ M A per tile, then the bias and the
   fused epilogue per output element.

The GEMMs do α²/(9·m²) of a direct conv's multiplications (2.25× fewer for m = 2, 4× for
m = 4), at the price of the transforms' memory traffic and α²·K·C transformed weights (1.8× or 4×
the weights): it pays where the image has many tiles for those weights to serve
(`winograd_tile_size`).
"""
from __future__ import annotations

import math

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    add,
    binary,
    clamp,
    const,
    iconst,
    index_compare,
    load,
    logical_and,
    mul,
    select,
    sub,
)
from kiln.codegen.gemm.blocking import round_up
from kiln.codegen.gemm.packed import micro_kernel, packed_gemm
from kiln.codegen.gemm.packing import array_panels
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.indexing import Index
from kiln.codegen.ops.conv_window import ConvOperands, Window


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
    at, g_matrix, bt = (np.array(t, dtype=np.float64) for t in TRANSFORMS[m])
    alpha = m + 2
    out, dtype = ctx.out(), ops.acc_dtype
    batch, channels, (ih, iw) = in_shape[0], in_shape[1], w.in_size
    kout = w_shape[0]
    (oh, ow), (ph, pw) = w.out_size, w.pad_begin
    th, tw = -(-oh // m), -(-ow // m)
    tiles = th * tw
    uk = micro_kernel(ctx, dtype)
    padded_tiles = round_up(tiles, uk.nr)
    points = alpha * alpha

    # 1. input transform into V[n][ξ][c][t], the tiles past the last zeroed
    v_buf = ctx.scratch(dtype, batch * points * channels * padded_tiles)
    q = ctx.var("q", batch * channels * th)
    n, c, ty = Index((batch, channels, th), flat=q).dims
    tx = ctx.var("t", tw)
    tile: list[list[Expr]] = []
    for r in range(alpha):
        y = sub(add(mul(ty, m), r), ph)
        row = []
        for s in range(alpha):
            x = sub(add(mul(tx, m), s), pw)
            inside = logical_and(
                logical_and(index_compare("ge", y, 0), index_compare("lt", y, ih)),
                logical_and(index_compare("ge", x, 0), index_compare("lt", x, iw)))
            value = ops.once(Index(in_shape, dims=[n, c, clamp(y, 0, ih - 1), clamp(x, 0, iw - 1)]))
            row.append(select(inside, value, const(0, dtype)))
        tile.append(row)
    transformed = _sandwich(bt, tile, dtype)
    stores = [ir.Store(v_buf, add(mul(add(mul(add(mul(n, points), xi * alpha + nu), channels), c),
                                      padded_tiles), mul(ty, tw), tx), transformed[xi][nu])
              for xi in range(alpha) for nu in range(alpha)]
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
    weights = ctx.const(1).astype(np.float64)
    u = np.einsum("xa,kcab,yb->xykc", g_matrix, weights, g_matrix).reshape(points, kout, channels)
    rows = round_up(kout, uk.mr)
    u = np.concatenate([u, np.zeros((points, rows - kout, channels))], axis=1)
    packed_u = array_panels(ctx, u.astype(dtype), uk.mr)
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
    products = [[load(m_buf, dtype, add(mul(add(mul(add(mul(n, points), xi * alpha + nu), kout), k),
                                            padded_tiles), t_index))
                 for nu in range(alpha)] for xi in range(alpha)]
    result = _sandwich(at, products, dtype)
    body: list[ir.Stmt] = []
    for a in range(m):
        oy = add(mul(ty, m), a)
        row: list[ir.Stmt] = []
        for b in range(m):
            ox = add(mul(tx, m), b)
            stmts = ctx.results({0: (Index(out.shape, dims=[n, k, oy, ox]),
                                     ops.finish(result[a][b], k))})
            if (tw - 1) * m + b >= ow:
                stmts = [ir.If(index_compare("lt", ox, ow), stmts)]
            row += stmts
        if (th - 1) * m + a >= oh:
            row = [ir.If(index_compare("lt", oy, oh), row)]
        body += row
    ctx.stage(f"Winograd output transform of {ctx.op.id}",
              [ir.Loop(q, iconst(0), iconst(batch * kout * th),
                       [ir.Loop(tx, iconst(0), iconst(tw), body, simd=True)], parallel=1,
                       grain="chunks")], batch * kout * tiles * points)
    ctx.info.update(form=f"Winograd F({m}x{m}, 3x3)", tiles=tiles)


def select_point(points: list[list[Expr]], xi: Expr) -> Expr:
    """The element ξ (flat over the α × α tile) of a tile of expressions, as a chain of selects."""
    flat = [e for row in points for e in row]
    chosen = flat[-1]
    for position in reversed(range(len(flat) - 1)):
        chosen = select(index_compare("eq", xi, position), flat[position], chosen)
    return chosen

