"""AGO's intensive fusion of two matrix products (§III-B, Fig. 7b): MatMul/Gemm → MatMul/Gemm in
one stage, row tile by row tile, the intermediate rows in a stack buffer.

The paper leaves matrix products out of its analysis "because it is mathematically equivalent to
pointwise convolution", and so it is here: a downstream product C2 = A2 · W2 with constant weights
W2 reuses an element A2[r, k] only along its output columns N2 (each output row reads one row of
A2), exactly as a 1×1 convolution reuses an input pixel only along its output channels. It falls
in the **pointwise** category of inter-operator dependency: tiles that take every column of the
intermediate (all of N1 = K2) and a block of its rows never split the reused dimension, so no
element of the upstream product is computed twice. Rows play the part of the pointwise pair's
pixels, columns that of its channels. A downstream product whose intermediate operand is B (reused
along M), or whose weights differ per batch, reuses along a second kind of dimension and is not
fused. (A conv on one side and a product on the other: `kiln.codegen.intensive`, with the
pieces of `RowPairLowering`.)

The upstream product may be any MatMul or Gemm with constant weights shared by its batch; batch
dims of both products are flattened into rows (R = batch · M), so a tile may span two batch
elements and a batch of single-row products still gives one tile per few rows. Between the two may
stand elementwise ops (bias, GELU, ReLU, a residual read from memory) and order-keeping reshapes
(GPT-2's Gemm → Reshape → GELU → Reshape → Gemm); they are applied when the tile is filled.

Per tile of `tm` rows (a whole number of micro-kernel panels of `mr` rows), one parallel task:

1. copies its rows of the upstream A operand (through their fused prologue) into a local array,
   row-major: the row-reading micro-kernel reads them in place (`MicroKernel.lda`);
2. runs the register-blocked micro-kernel over them and the pre-packed W1 panels, one `mr` × `nr`
   tile at a time, and writes each finished tile through the upstream finish (Gemm's alpha,
   beta·C), the ops between and into the intermediate buffer, row-major again, `nr` contiguous
   elements per row of the tile (no transposition pass, no full intermediate);
3. runs the micro-kernel again over the intermediate rows and the pre-packed W2 panels; each
   finished tile goes through the downstream op's epilogue into the outputs, as a packed GEMM's
   does (`kiln.codegen.gemm.packed`).

Where the rows of A or of the intermediate would fall into one L1 set (`rows_evict_each_other`:
rows 4 KiB apart), both are kept in panels of `mr` rows instead (element (row, k) at
(panel · K + k) · mr + row), which the packed micro-kernel reads; their stores land `mr` floats
apart, which is why rows are the default (on a Zen 4, ConvNeXt-T's 3136 × 96 → 384 → 96 pairs ran
2.6 ms with panels, 2.24 ms with rows, one thread).

The tile's packed rows and intermediate, `tm` · (K1 + N1) floats, must fit the schedule's
`intensive_tile_bytes` (the tile in L2 next to the weight panels streaming past it); a pair whose
smallest tile (one panel of rows) does not fit, or with fewer rows than one panel (a GEMV, which
would compute mostly padding), is not fused. On a CPU the cost of the scheme is that W1 and W2
stream through the cache once per tile instead of once per cache block of a plain GEMM: it pays
when the intermediate is large next to the weights (long sequences, narrow layers), not otherwise,
which is why the tuner measures it on and off.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from kiln.codegen import ir
from kiln.codegen.contexts import BlockServices, NotFusable, Provided, StageCtx
from kiln.codegen.expr import (
    Expr,
    add,
    array_load,
    const,
    floordiv,
    iconst,
    imin,
    index_compare,
    modulo,
    mul,
    sub,
    walk,
)
from kiln.codegen.gemm.packed import micro_kernel
from kiln.codegen.gemm.packing import OperandSide, Packed, constant_panels
from kiln.codegen.gemm.spec import Contraction, results
from kiln.codegen.indexing import Index
from kiln.codegen.microkernel import rows_evict_each_other
from kiln.codegen.ops.contraction import MATRIX_SPECS, matmul_dims
from kiln.ecg import Graph, Op

FLOAT = "float32"


class Pair(Protocol):
    """The pair as `kiln.codegen.intensive` finds it (this module does not import that one)."""

    up: Op
    down: Op
    category: str


@dataclass(frozen=True)
class RowProduct:
    """A matrix product seen as rows: R = batch · M rows of K in, N out, weights shared."""

    rows: int
    m: int
    n: int
    k: int


def row_product(op: Op, graph: Graph, downstream: bool) -> RowProduct | None:
    """`op` as a float32 product of row-major rows by constant weights shared by every batch
    element, or None. The downstream op must read its A operand untransposed (its rows are the
    intermediate's rows)."""
    if op.op_type not in MATRIX_SPECS or len(op.outputs) != 1:
        return None
    a, w, out = (graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]],
                 graph.tensors[op.outputs[0]])
    if {a.dtype, w.dtype, out.dtype} != {FLOAT} or not graph.is_constant(w.id):
        return None
    if graph.is_constant(a.id) or out.numel == 0 or a.numel == 0 or w.numel < 2:
        return None  # (a one-element weight is folded to a number: nothing to pack)
    if op.op_type == "Gemm":
        if downstream and op.attrs.get("transA", 0):
            return None
        trans_a, trans_b = op.attrs.get("transA", 0), op.attrs.get("transB", 0)
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        n = w.shape[0] if trans_b else w.shape[1]
        return RowProduct(m, m, n, k)
    a2, b2, batch = matmul_dims(a.shape, w.shape)
    if math.prod(b2[:-2]) != 1 or math.prod(batch) != math.prod(a2[:-2]):
        return None  # per-batch weights: a row would meet several of them
    return RowProduct(math.prod(batch) * a2[-2], a2[-2], b2[-1], a2[-1])


def compatible(up: Op, down: Op, graph: Graph) -> bool:
    """Do the upstream product's rows and columns become the downstream one's rows and sum?"""
    first, second = row_product(up, graph, False), row_product(down, graph, True)
    return (first is not None and second is not None and first.rows == second.rows
            and first.n == second.k)


def tile_rows(pair: Pair, graph: Graph, tile_bytes: int, mr: int) -> int:
    """Rows per tile: whole panels of `mr`, as many as the budget holds, two tiles at least."""
    up = row_product(pair.up, graph, False)
    per_row = up.k + up.n  # packed A rows and the intermediate, floats
    fitting = max(mr, (tile_bytes // 4 // per_row) // mr * mr)
    half = -(-(-(-up.rows // 2)) // mr) * mr
    return min(fitting, half)


def fits(pair: Pair, graph: Graph, tile_bytes: int, mr: int) -> bool:
    up = row_product(pair.up, graph, False)
    return up.rows >= mr and mr * (up.k + up.n) * 4 <= tile_bytes


class RowPairLowering:
    """The pieces of a fused stage over rows of matrix products: packing a tile's rows, the
    micro-kernel over panels, filling the intermediate, the downstream epilogue; `lower` puts
    them together for two products (`kiln.codegen.intensive` for a conv and a product)."""

    def __init__(self, down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair):
        self.ctx, self.up_ctx, self.pair = down_ctx, up_ctx, pair
        self.graph = down_ctx.graph
        self.uk = micro_kernel(down_ctx, FLOAT)
        # the products of the pair (a conv's side, in a pair of a conv and a product, is None)
        self.up = _spec(up_ctx, pair.up)
        self.down = _spec(down_ctx, pair.down)
        product = self.up or self.down
        self.rows = math.prod(product.batch) * product.m
        self.tm = (tile_rows(pair, self.graph, down_ctx.schedule.intensive_tile_bytes, self.uk.mr)
                   if self.up and self.down else 0)

    def row(self, spec: Contraction, r: Expr) -> tuple[Expr, Expr]:
        """(flat batch, row within the batch element) of flattened row `r`."""
        if not spec.batch:
            return iconst(0), r
        return floordiv(r, spec.m), modulo(r, spec.m)

    def weights(self, ctx: StageCtx, spec: Contraction) -> Packed:
        side = OperandSide("b", lambda bi, j, k: spec.b(bi, k, j), spec.b_batch, spec.n)
        packed = constant_panels(ctx, spec, side, self.uk.nr)
        assert packed is not None  # `row_product` admits constant weights only
        return packed

    def k_blocks(self, k: int) -> tuple[int, int]:
        kc_max = max(1, self.ctx.schedule.gemm_kc)
        blocks = -(-k // kc_max)
        return blocks, -(-k // blocks)

    def products(self, a: str, k: int, b: Packed, n: int, row_panels: Expr, tile: str,
                 done: Callable[[Expr, Expr], list[ir.Stmt]], panels: int = 0,
                 rows: bool = False) -> ir.Loop:
        """tile[mr][nr] = Σ_k a-panels · b-panels for every (column panel, row panel < at most
        `panels`), each finished tile handed to `done(jp, ip)` (statements); `rows`: `a` holds
        row-major rows of `k` (read in place by the row-reading micro-kernel), not panels."""
        uk, ctx = self.uk, self.ctx
        blocks, kc_size = self.k_blocks(k)
        panels = panels or self.tm // uk.mr
        jp, ip, kb = ctx.var("jp", -(-n // uk.nr)), ctx.var("ip", panels), ctx.var("kb", blocks)
        k0 = mul(kb, kc_size)
        kc = iconst(kc_size) if k % kc_size == 0 else imin(iconst(kc_size), sub(iconst(k), k0))
        kernel, a_at = ((replace(uk, lda=k), add(mul(ip, uk.mr * k), k0)) if rows
                        else (uk, mul(add(mul(ip, k), k0), uk.mr)))
        call = ir.MicroKernelCall(kernel, kc, a, a_at,
                                  b.buffer, b.offset(iconst(0), k0, mul(jp, uk.nr)), b.ld,
                                  tile, iconst(0), uk.nr,
                                  index_compare("gt", kb, 0) if blocks > 1 else const(False, "bool"))
        return ir.Loop(jp, iconst(0), iconst(-(-n // uk.nr)), [
            ir.Loop(ip, iconst(0), row_panels, [ir.Loop(kb, iconst(0), iconst(blocks), [call]),
                                                *done(jp, ip)])])

    def pack_rows(self, r0: Expr, row_panels: Expr, packed: str, last: Expr | None = None,
                  panels: int = 0, rows: bool = False) -> ir.Loop:
        """The tile's rows of the upstream A operand in panels of `mr` (`rows`: row-major, a row
        of K after another; rows past `last`, by default the last row, repeat it, so that every
        element is a finite number)."""
        uk, up, ctx = self.uk, self.up, self.up_ctx
        panels = panels or self.tm // uk.mr
        ip, rr, k = ctx.var("ip", panels), ctx.var("r", uk.mr), ctx.var("k", up.k)
        row = imin(add(r0, mul(ip, uk.mr), rr), iconst(self.rows - 1) if last is None else last)
        b, i = self.row(up, row)
        value = up.a(Index(up.a_batch, flat=b), i, k)
        at = (add(mul(add(mul(ip, uk.mr), rr), up.k), k) if rows
              else add(mul(add(mul(ip, up.k), k), uk.mr), rr))
        store = ir.ArrayStore(packed, at, value)
        return ir.Loop(ip, iconst(0), row_panels, [
            ir.Loop(rr, iconst(0), iconst(uk.mr), [ir.Loop(k, iconst(0), iconst(up.k), [store],
                                                           simd=True)])])

    def fill(self, r0: Expr, jp: Expr, ip: Expr, tile: str, mid: str,
             rows: bool = False) -> list[ir.Stmt]:
        """A finished upstream tile through the upstream finish and the ops between, into the
        intermediate's panels (element (row, column) at (panel · N1 + column) · mr + row) or, with
        `rows`, its row-major rows (at (panel · mr + row) · N1 + column)."""
        uk, up, ctx = self.uk, self.up, self.ctx
        rr, c = ctx.var("r", uk.mr), ctx.var("c", uk.nr)
        row = imin(add(r0, mul(ip, uk.mr), rr), iconst(self.rows - 1))
        j = add(mul(jp, uk.nr), c)
        b, i = self.row(up, row)
        total = up.finish(array_load(tile, FLOAT, add(mul(rr, uk.nr), c)), b, i, j)
        down_input = self.graph.tensors[self.pair.down.inputs[0]]
        value = through_the_ops_between(ctx.low, self.pair.up.outputs[0], total, down_input.id,
                                        Index(down_input.shape, flat=up.out(b, i, j).flat))
        at = (add(mul(add(mul(ip, uk.mr), rr), up.n), j) if rows
              else add(mul(add(mul(ip, up.n), j), uk.mr), rr))
        store = ir.ArrayStore(mid, at, value)
        cols = imin(iconst(uk.nr), sub(iconst(up.n), mul(jp, uk.nr)))
        return [ir.Loop(rr, iconst(0), iconst(uk.mr), [ir.Loop(c, iconst(0), cols, [store],
                                                                simd=True)])]

    def epilogue(self, r0: Expr, jp: Expr, ip: Expr, tile: str,
                 end: Expr | None = None) -> list[ir.Stmt]:
        """A finished downstream tile through the downstream op's epilogue into the outputs
        (rows before `end`, by default the product's last row)."""
        uk, down, ctx = self.uk, self.down, self.ctx
        rr, c = ctx.var("r", uk.mr), ctx.var("c", uk.nr)
        row = add(r0, mul(ip, uk.mr), rr)
        b, i = self.row(down, row)
        j = add(mul(jp, uk.nr), c)
        stmts = results(ctx, down, array_load(tile, FLOAT, add(mul(rr, uk.nr), c)), b, i, j)
        end = iconst(self.rows) if end is None else end
        rows_here = imin(iconst(uk.mr), sub(end, add(r0, mul(ip, uk.mr))))
        cols = imin(iconst(uk.nr), sub(iconst(down.n), mul(jp, uk.nr)))
        return [ir.Loop(rr, iconst(0), rows_here, [ir.Loop(c, iconst(0), cols, stmts, simd=True)])]

    def lower(self) -> None:
        uk, ctx, up, down, tm = self.uk, self.ctx, self.up, self.down, self.tm
        w1, w2 = self.weights(self.up_ctx, up), self.weights(ctx, down)
        tiles = -(-self.rows // tm)
        task = ctx.var("p", tiles)
        r0 = mul(task, tm)
        row_panels = imin(iconst(tm // uk.mr), floordiv(sub(iconst(self.rows + uk.mr - 1), r0), uk.mr))
        packed, mid, tile = ctx.name("rows"), ctx.name("mid"), ctx.name("ct")
        # row-major tiles unless their rows fall into one L1 set (see the module's docstring)
        rows = not any(rows_evict_each_other(uk, n * 4) for n in (up.k, up.n))
        body: list[ir.Stmt] = [
            ir.DeclArray(packed, FLOAT, tm * up.k), ir.DeclArray(mid, FLOAT, tm * up.n),
            ir.DeclArray(tile, FLOAT, uk.mr * uk.nr),
            self.pack_rows(r0, row_panels, packed, rows=rows),
            self.products(packed, up.k, w1, up.n, row_panels, tile,
                          lambda jp, ip: self.fill(r0, jp, ip, tile, mid, rows), rows=rows),
            self.products(mid, down.k, w2, down.n, row_panels, tile,
                          lambda jp, ip: self.epilogue(r0, jp, ip, tile), rows=rows),
        ]
        pair = self.pair
        work = self.rows * (up.n * up.k + down.n * down.k)
        ctx.stage(f"intensive fusion ({pair.up.id} → {pair.down.id}), {pair.category}: tiles of "
                  f"{tm} rows × {up.n} columns", [ir.Loop(task, iconst(0), iconst(tiles), body,
                                                          parallel=1, grain="one")], work)
        ctx.info.update(form=f"intensive {pair.category}", upstream="matmul", tile_rows=tm,
                        micro_kernel=f"{uk.mr}x{uk.nr}", tile_layout="rows" if rows else "panels")


def through_the_ops_between(low: BlockServices, mid: str, value: Expr, target: str,
                            index: Index) -> Expr:
    """`target` at `index` when the intermediate `mid` holds `value` at the element the ops
    between read for it. The pair's layout check (`kiln.codegen.intensive._layout`) proved
    which element that is; its offset is read off the expression the ops between build from a
    load of `mid` (reshapes and transpositions write it in forms of their own, which an offset
    written here would have to match node for node)."""
    low.ready.add(mid)
    try:
        probe = low.builder().value(target, index)
    finally:
        low.ready.discard(mid)
    offsets = {e.args[0] for e in walk([probe]) if e.op == "load" and e.name == mid}
    if len(offsets) != 1:
        raise NotFusable(mid)
    return low.builder({mid: Provided(offsets.pop(), value)}).value(target, index)


def _spec(ctx: StageCtx, op: Op) -> Contraction | None:
    build = MATRIX_SPECS.get(op.op_type)
    return build(ctx) if build is not None else None


def lower_row_pair(down_ctx: StageCtx, up_ctx: StageCtx, pair: Pair) -> None:
    """Emit the fused stage of a matrix-product pair (whose tile `fits`)."""
    RowPairLowering(down_ctx, up_ctx, pair).lower()
