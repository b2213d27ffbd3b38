"""The work-group tiled GEMM of the GPU backends (the design of CLBlast's xgemm, written for Kiln's
IR): the output is cut into tiles of MT × NT, one work-group each; the group walks the sum in
slices of KT, and for each slice its work-items first copy the slice of A (MT × KT) and of B
(KT × NT) from global into local memory together (`ir.DeclArray` of scope "group": OpenCL's
`__local`, CUDA's `__shared__`), element e of a tile by work-item e mod T, meet at a barrier,
then each work-item updates its register tile of `mr` × `nr` (the backend's micro-kernel, vector
registers, reading the local tiles), and they meet again before the next slice overwrites the
tiles. Every element of A and B is read from global memory once per group instead of once per
work-item; the reads of one copy step are consecutive addresses (coalesced).

Ragged edges: the copy writes zeros for rows past M, columns past N and sums past K, so every
slice is a whole KT and every register tile whole; only the epilogue looks at the edges (it
stores the tile's elements inside the output). The operands are the contraction's own index
functions, their fused prologue included (an implicit-GEMM convolution's im2col happens in the
copy); a constant A already in panels (Winograd's transformed weights) is read from them.
After the last slice each work-item's tile goes through the block's fused epilogue (bias,
activation, residual...) from registers straight to the output (`spec.tile_epilogue`).

Sizes come from the target's limits (`Schedule.for_device`): at most `gemm_work_group`
work-items per group, both local tiles within `gemm_local_bytes`, the register tile from its
registers per work-item; groups shrink to the product (M = 1 gets one row of work-items).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    add,
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
)
from kiln.codegen.gemm.packing import Packed
from kiln.codegen.gemm.spec import Contraction, batch_of, tile_epilogue
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import MicroKernel
from kiln.codegen.schedule import Schedule

# The longest slice of the sum a group stages at once: longer ones would only lengthen the copy
# before the first barrier (the register tiles already reuse every staged element MT/mr times).
MAX_SLICE = 32
MAX_WORK_ITEMS_PER_AXIS = 16  # a group's work-items along M or N: 16 × 16 = 256 at most


@dataclass(frozen=True)
class GroupTiles:
    """A work-group of `rows` × `cols` work-items, each an `mr` × `nr` register tile; slices of
    `slice` along the sum."""

    rows: int
    cols: int
    mr: int
    nr: int
    slice: int

    @property
    def work_items(self) -> int:
        return self.rows * self.cols

    @property
    def mt(self) -> int:
        return self.rows * self.mr

    @property
    def nt(self) -> int:
        return self.cols * self.nr

    def local_bytes(self, itemsize: int) -> int:
        return (self.mt + self.nt) * self.slice * itemsize


def group_tiles(m: int, n: int, k: int, uk: MicroKernel, s: Schedule) -> GroupTiles:
    """The largest group the product fills, within the schedule's work-group size, and the
    longest slice (a power of two, at most the sum's) whose two local tiles fit its local memory."""
    itemsize = uk.itemsize
    rows = min(_power_of_two_above(-(-m // uk.mr)), MAX_WORK_ITEMS_PER_AXIS)
    cols = min(_power_of_two_above(-(-n // uk.nr)), MAX_WORK_ITEMS_PER_AXIS)
    while rows * cols > max(s.gemm_work_group, 1):
        if rows >= cols:
            rows //= 2
        else:
            cols //= 2
    slice_ = min(MAX_SLICE, _power_of_two_above(k))
    tiles = GroupTiles(rows, cols, uk.mr, uk.nr, slice_)
    while tiles.local_bytes(itemsize) > s.gemm_local_bytes and tiles.slice > 1:
        tiles = GroupTiles(rows, cols, uk.mr, uk.nr, tiles.slice // 2)
    if tiles.local_bytes(itemsize) > s.gemm_local_bytes:
        raise ValueError(f"GEMM tiles of {tiles.mt}x{tiles.nt} do not fit "
                         f"{s.gemm_local_bytes} bytes of local memory")
    return tiles


def group_gemm(ctx: StageCtx, spec: Contraction, uk: MicroKernel,
               packed_a: Packed | None = None) -> None:
    """`spec` as a work-group tiled GEMM (see the module docstring); `packed_a`: A already in
    constant panels of `uk.mr` rows."""
    tiles = group_tiles(spec.m, spec.n, spec.k, uk, ctx.schedule)
    local_uk = MicroKernel(uk.dtype, uk.mr, uk.nr, uk.vector_bytes, local=True)
    bt = math.prod(spec.batch)
    row_tiles, col_tiles = -(-spec.m // tiles.mt), -(-spec.n // tiles.nt)
    slices = -(-spec.k // tiles.slice)
    t = tiles.work_items
    p = ctx.var("p", bt * row_tiles * col_tiles * t)
    group, item = floordiv(p, t), modulo(p, t)
    b, rt, ct = Index((bt, row_tiles, col_tiles), flat=group).dims
    ip, jp = modulo(item, tiles.rows), floordiv(item, tiles.rows)
    i0, j0 = mul(rt, tiles.mt), mul(ct, tiles.nt)
    a_tile, b_tile, acc = ctx.name("la"), ctx.name("lb"), ctx.name("ct")

    kb = ctx.var("kb", slices)
    k0 = mul(kb, tiles.slice)
    copies = [*_copy_a(ctx, spec, tiles, packed_a, a_tile, (b, i0, k0), item),
              *_copy_b(ctx, spec, tiles, b_tile, (b, k0, j0), item)]
    call = ir.MicroKernelCall(
        local_uk, iconst(tiles.slice), a_tile, mul(ip, tiles.slice * uk.mr), b_tile,
        mul(jp, uk.nr), tiles.nt, acc, iconst(0), uk.nr,
        index_compare("gt", kb, 0) if slices > 1 else const(False, "bool"))
    i_lo, j_lo = add(i0, mul(ip, uk.mr)), add(j0, mul(jp, uk.nr))
    epilogue = tile_epilogue(ctx, spec, uk.nr, acc, b, (i_lo, i_lo, uk.mr), (j_lo, j_lo, uk.nr))
    body = [ir.DeclArray(a_tile, spec.dtype, tiles.mt * tiles.slice, scope="group"),
            ir.DeclArray(b_tile, spec.dtype, tiles.slice * tiles.nt, scope="group"),
            ir.DeclArray(acc, spec.dtype, uk.mr * uk.nr),
            ir.Loop(kb, iconst(0), iconst(slices), [*copies, ir.Barrier(), call, ir.Barrier()]),
            *epilogue]
    ctx.stage(f"contraction {ctx.op.op_type} ({ctx.op.id}), work-group tiled GEMM",
              [ir.Loop(p, iconst(0), iconst(bt * row_tiles * col_tiles * t), body, parallel=1,
                       work_group=t)],
              bt * spec.m * spec.n * spec.k)
    ctx.info.update(form="work-group tiled", micro_kernel=f"{uk.mr}x{uk.nr}",
                    vector_bytes=uk.vector_bytes, work_group=f"{tiles.rows}x{tiles.cols}",
                    tile=f"{tiles.mt}x{tiles.nt}x{tiles.slice}", groups=bt * row_tiles * col_tiles)


def _copy_a(ctx: StageCtx, spec: Contraction, tiles: GroupTiles, packed_a: Packed | None,
            name: str, at: tuple[Expr, Expr, Expr], item: Expr) -> list[ir.Stmt]:
    """The group's slice of A into `name`, in panels of `mr` rows (`a[k·mr + r]` per panel, the
    micro-kernel's layout), read along the sum (A's rows are usually contiguous along it)."""
    b, i0, k0 = at

    def place(e: Expr) -> tuple[Expr, Expr]:
        x, kk = floordiv(e, tiles.slice), modulo(e, tiles.slice)
        i, k = add(i0, x), add(k0, kk)
        index = add(mul(floordiv(x, tiles.mr), tiles.slice * tiles.mr),
                    add(mul(kk, tiles.mr), modulo(x, tiles.mr)))
        inside = logical_and(index_compare("lt", i, spec.m), index_compare("lt", k, spec.k))
        ci, ck = imin(i, spec.m - 1), imin(k, spec.k - 1)
        a_batch = batch_of(spec, b, spec.a_batch)
        if packed_a is not None:
            first = mul(floordiv(ci, packed_a.ld), packed_a.ld)
            value = load(packed_a.buffer, spec.dtype,
                         add(packed_a.offset(a_batch.flat, ck, first), sub(ci, first)))
        else:
            value = spec.a(a_batch, ci, ck)
        return index, select(inside, value, const(0, spec.dtype))

    return _copy(ctx, tiles, name, tiles.mt * tiles.slice, item, place)


def _copy_b(ctx: StageCtx, spec: Contraction, tiles: GroupTiles, name: str,
            at: tuple[Expr, Expr, Expr], item: Expr) -> list[ir.Stmt]:
    """The group's slice of B into `name`, row-major (`b[k·NT + c]`), read along B's rows."""
    b, k0, j0 = at

    def place(e: Expr) -> tuple[Expr, Expr]:
        kk, c = floordiv(e, tiles.nt), modulo(e, tiles.nt)
        k, j = add(k0, kk), add(j0, c)
        inside = logical_and(index_compare("lt", k, spec.k), index_compare("lt", j, spec.n))
        value = spec.b(batch_of(spec, b, spec.b_batch), imin(k, spec.k - 1), imin(j, spec.n - 1))
        return e, select(inside, value, const(0, spec.dtype))

    return _copy(ctx, tiles, name, tiles.slice * tiles.nt, item, place)


def _copy(ctx: StageCtx, tiles: GroupTiles, name: str, size: int, item: Expr,
          place: Callable[[Expr], tuple[Expr, Expr]]) -> list[ir.Stmt]:
    """Elements 0 .. size of a local tile, element e by work-item e mod T: `place(e)` gives the
    element's index in the tile and its value."""
    t = tiles.work_items
    steps = -(-size // t)
    step = ctx.var("e", steps)
    e = add(mul(step, t), item)
    index, value = place(e)
    store: ir.Stmt = ir.ArrayStore(name, index, value)
    if size % t:
        store = ir.If(index_compare("lt", e, size), [store])
    return [ir.Loop(step, iconst(0), iconst(steps), [store])]


def _power_of_two_above(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
