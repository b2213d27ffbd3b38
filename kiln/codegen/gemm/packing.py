"""Packing GEMM operands into the panels the micro-kernel reads: constants at compile time,
plain run-time matrices read in place (or B copied block by block by the GEMM's tasks), other
run-time operands once per call by a parallel loop nest (their fused prologue evaluated once per
element)."""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
    modulo,
    mul,
    select,
    sub,
    substitute,
    var,
    walk,
)
from kiln.codegen.indexing import Index
from kiln.codegen.gemm.blocking import round_up
from kiln.codegen.gemm.spec import Contraction, constant_values, stride_of


Operand = Callable[[Index, Expr, Expr], Expr]  # (batch index, row of A / column of B, k) -> value


@dataclass(frozen=True)
class Packed:
    """Where the micro-kernel finds an operand: `buffer + offset(batch, k0, x0)` is the panel of
    rows (A) or columns (B) from x0 at sum index k0, its rows `ld` elements apart."""

    buffer: str
    offset: Callable[[Expr, Expr, Expr], Expr]
    ld: int
    in_place: bool = False  # A's rows read where they are (row-major, `ld` apart), not panels
    batch_ld: int = 0  # in place: how far one batch's rows start from the previous one's (0: one)


def panel_layout(buffer: str, panels: int, k: int, unit: int) -> Packed:
    """Panel layout: element (b, x, k) at ((b·panels + x // unit)·K + k)·unit + x % unit."""
    return Packed(buffer, lambda b, k0, x0: mul(add(mul(add(mul(b, panels), floordiv(x0, unit)), k),
                                                    k0), unit), unit)


@dataclass(frozen=True)
class OperandSide:
    """One operand of the product as the packer sees it: its value at (batch index, row of A or
    column of B, k), its batch shape, and its extent along the panel axis (M or N)."""

    name: str
    value: Operand
    batch: tuple[int, ...]
    extent: int

    def probes(self, ctx: StageCtx, k: int) -> tuple[Expr, Expr, Expr, Expr]:
        """(probe value, batch var, panel-axis var, k var)."""
        pb = ctx.var("pb", max(math.prod(self.batch), 1))
        px, pk = ctx.var("px", max(self.extent, 1)), ctx.var("pk", k)
        return self.value(Index(self.batch, flat=pb), px, pk), pb, px, pk


def constant_panels(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> Packed | None:
    """A constant operand (weights) packed at compile time in panels of `unit` rows of A
    (columns of B), past the extent zero; None if the operand is not a constant."""
    nb, panels = max(math.prod(side.batch), 1), -(-side.extent // unit)
    probe, *probes = side.probes(ctx, spec.k)
    grid = np.meshgrid(np.arange(nb), np.arange(panels * unit), np.arange(spec.k), indexing="ij")
    clamped = [grid[0], np.minimum(grid[1], side.extent - 1), grid[2]]
    values = constant_values(ctx, probe, tuple(probes), clamped)
    if values is None:
        return None
    values = np.where(grid[1] < side.extent, values, 0).astype(values.dtype)
    ctx.info[f"{side.name}_operand"] = "pre-packed constant"
    return array_panels(ctx, values, unit)


def array_panels(ctx: StageCtx, values: np.ndarray, unit: int) -> Packed:
    """A compile-time array (batch, rows of A or columns of B, k), its rows a whole number of
    panels of `unit`, as a derived constant in panels."""
    nb, rows, k = values.shape
    panelled = values.reshape(nb, rows // unit, unit, k).transpose(0, 1, 3, 2)
    return panel_layout(ctx.derived(np.ascontiguousarray(panelled)), rows // unit, k, unit)


def a_rows_in_place(ctx: StageCtx, spec: Contraction, side: OperandSide) -> Packed | None:
    """A run-time A that is a plain row-major load (contiguous along the sum, rows a constant
    distance apart within a batch) read in place by a row-reading micro-kernel: packing it would
    copy every element once per call for a reuse the broadcasts get from L1 anyway. None for any
    other A (a fused prologue's arithmetic, a gather, a transposed read)."""
    probe, pb, px, pk = side.probes(ctx, spec.k)
    if probe.op != "load" or stride_of(probe, pk) != 1:
        return None
    lda = stride_of(probe, px) if side.extent > 1 else spec.k
    if lda is None or lda < spec.k:
        return None
    offset = probe.args[0]
    ctx.info["a_operand"] = "read in place"
    batch_ld = stride_of(probe, pb) if math.prod(side.batch) > 1 else 0
    return Packed(probe.name, lambda b, k0, i0: substitute(offset, {pb: b, pk: k0, px: i0}), lda,
                  in_place=True, batch_ld=batch_ld or 0)


def rows_across_batch(side: OperandSide, m: int) -> OperandSide:
    """A batch of `side`'s matrices as one of batch × M rows (row g: batch g // M, row g % M), for
    a product whose B is the same in every batch: packed so, its panels run on across batches and
    only the last one is partial (64 windows of 49 rows in panels of 6: 3138 rows' work, not
    64 × 54 = 3456)."""
    nb = math.prod(side.batch)
    return OperandSide(side.name, lambda _b, g, k: side.value(
        Index(side.batch, flat=floordiv(g, m)), modulo(g, m), k), (), nb * m)


# The panels packed so far in each attempt at lowering a block (keyed by the attempt's names: a
# retried attempt starts with new names, stages and scratch), by what they hold: the products of
# one kernel that read the same run-time operand (a transformer's Q, K and V projections of one
# normalised or window-partitioned input) pack it once.
_PACKED: weakref.WeakKeyDictionary[object, dict[tuple, Packed]] = weakref.WeakKeyDictionary()


def _packing_key(spec: Contraction, side: OperandSide, unit: int) -> tuple:
    """What packed panels hold, as a key: the operand's value at canonical probe variables (the
    same element expression reads the same values within one kernel), its shape and the panels'."""
    nb = max(math.prod(side.batch), 1)
    probes = (var("pack_b", nb), var("pack_x", max(side.extent, 1)), var("pack_k", spec.k))
    value = side.value(Index(side.batch, flat=probes[0]), probes[1], probes[2])
    return (value.key, spec.dtype, nb, side.extent, spec.k, unit)


def scratch_panels(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> Packed:
    """The operand packed in panels (the layout of `_panels`, past the extent zero) once per call
    by a parallel loop nest, which evaluates the operand's fused prologue once per element; the
    panels an earlier product of the same kernel packed of the same operand, if there are."""
    packed = _PACKED.setdefault(ctx.low.names, {})
    key = _packing_key(spec, side, unit)
    if key not in packed:
        packed[key] = _pack_panels(ctx, spec, side, unit)
    else:
        ctx.info[f"{side.name}_operand"] = "packed in scratch by an earlier product"
    return packed[key]


def contiguous_along(value: Expr, v: Expr) -> bool:
    """Does every load `value` makes step by one element or stay put as `v` grows by one, and
    one of them step (a transposed activation through a prologue: contiguous along the panel
    axis, its bias constant)?"""
    strides = [stride_of(e, v) for e in walk([value]) if e.op == "load"]
    return 1 in strides and all(s in (0, 1) for s in strides)


def rows_contiguous_along_the_sum(ctx: StageCtx, spec: Contraction, side: OperandSide) -> bool:
    """Is the operand contiguous along the sum and not along the panel axis (row-major rows read
    through a fused prologue's arithmetic, or gathered row by row: a window partition)? Packing it
    in panels would store along the sum `unit` elements apart; copying it row by row stores
    contiguously. (A gather along the sum, an im2col, keeps its panels.)"""
    probe, _, px, pk = side.probes(ctx, spec.k)
    return side.extent > 1 and contiguous_along(probe, pk) and not contiguous_along(probe, px)


def scratch_rows(ctx: StageCtx, spec: Contraction, side: OperandSide) -> Packed:
    """A run-time A through its fused prologue, evaluated once per element into row-major rows of
    K in scratch (contiguous stores along the sum), which the row-reading micro-kernel reads in
    place; the rows an earlier product of the same kernel wrote of the same operand, if there
    are. Panels of such an A store each element `mr` floats from the last: on a Zen 4 (AVX-512,
    one thread, interleaved) ConvNeXt-T's Add+GELU+MatMul of 784 × 768 × 192 took 1.31 ms with
    its A in panels, 1.09 ms in rows, and the add, GELU and product as three kernels 1.12 ms."""
    packed = _PACKED.setdefault(ctx.low.names, {})
    key = (*_packing_key(spec, side, 0), "rows")
    if key in packed:
        ctx.info[f"{side.name}_operand"] = "rows in scratch by an earlier product"
        return packed[key]
    nb = max(math.prod(side.batch), 1)
    rows = nb * side.extent
    name = ctx.scratch(spec.dtype, rows * spec.k)
    q, k = ctx.var("q", rows), ctx.var("k", spec.k)
    bb, x = Index((nb, side.extent), flat=q).dims
    store = ir.Store(name, add(mul(q, spec.k), k), side.value(Index(side.batch, flat=bb), x, k))
    ctx.stage(f"operand {side.name.upper()} of {ctx.op.id} in rows",
              [ir.Loop(q, iconst(0), iconst(rows), [
                  ir.Loop(k, iconst(0), iconst(spec.k), [store], simd=True)], parallel=1)],
              rows * spec.k)
    ctx.info[f"{side.name}_operand"] = "rows in scratch, read in place"
    packed[key] = Packed(name, lambda b, k0, i0: add(mul(add(mul(b, side.extent), i0), spec.k), k0),
                         spec.k, in_place=True, batch_ld=side.extent * spec.k if nb > 1 else 0)
    return packed[key]


def _pack_panels(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> Packed:
    nb, panels = max(math.prod(side.batch), 1), -(-side.extent // unit)
    probe, _, px, _ = side.probes(ctx, spec.k)
    total = nb * panels
    name = ctx.scratch(spec.dtype, total * spec.k * unit)
    q = ctx.var("q", total)
    bb, panel = Index((nb, panels), flat=q).dims

    def nest(edge: bool) -> ir.Loop:
        """One panel's copy; `edge`: the last, partial panel (zeros past the extent)."""
        r, k = ctx.var("r", unit), ctx.var("k", spec.k)
        x = add(mul(panel, unit), r)
        at = add(mul(add(mul(q, spec.k), k), unit), r)
        if contiguous_along(probe, px):  # contiguous along the panel axis: read along it
            # the edge panel's `valid` elements as one run, then zeros: a clamp of the index
            # made GCC gather them
            valid = side.extent - (panels - 1) * unit if edge else unit
            rows = [ir.Loop(r, iconst(0), iconst(valid), [
                ir.Store(name, at, side.value(Index(side.batch, flat=bb), x, k))], simd=True)]
            if valid < unit:
                pad = ctx.var("r", unit - valid, valid)
                rows.append(ir.Loop(pad, iconst(valid), iconst(unit), [
                    ir.Store(name, substitute(at, {r: pad}), const(0, spec.dtype))]))
            return ir.Loop(k, iconst(0), iconst(spec.k), rows)
        element = side.value(Index(side.batch, flat=bb), imin(x, iconst(side.extent - 1)) if edge
                             else x, k)
        if edge:
            element = select(index_compare("lt", x, side.extent), element, const(0, spec.dtype))
        return ir.Loop(r, iconst(0), iconst(unit),
                       [ir.Loop(k, iconst(0), iconst(spec.k), [ir.Store(name, at, element)],
                                simd=True)])

    # whole panels copy without the edge's bounds test and clamp: with them in every panel, a
    # 14 × 14 conv's 196 pixels × 384 channels took two thirds of the product's time to pack in
    # panels of 6 (a third of that without; the 1 × 1 conv 0.8× the time)
    body: list[ir.Stmt] = [nest(False)]
    if side.extent % unit:
        body = [ir.If(index_compare("lt", panel, panels - 1), body, [nest(True)])]
    ctx.stage(f"pack operand {side.name.upper()} of {ctx.op.id} in panels",
              [ir.Loop(q, iconst(0), iconst(total), body, parallel=1)], total * spec.k * unit)
    ctx.info[f"{side.name}_operand"] = "packed in scratch"
    return panel_layout(name, panels, spec.k, unit)


def b_rows(ctx: StageCtx, spec: Contraction, side: OperandSide, nr: int, unit: int = 0) -> Packed:
    """B computed at run time, read by the micro-kernel as row-major rows of `ld` elements: in
    place when it is a plain row-major load whose rows are whole multiples of `unit` (default
    `nr`: whole panels; the packed GEMM's last panel runs a kernel of just its vectors, so there
    a whole number of vectors suffices), else copied once into
    scratch rows padded to whole panels, by a loop nest along B's rows (an implicit-GEMM
    convolution's im2col: contiguous along output pixels, its loops split by output row)."""
    probe, pb, pj, pk = side.probes(ctx, spec.k)
    nb = max(math.prod(spec.b_batch), 1)
    row = stride_of(probe, pk)
    whole = spec.n % (unit or nr) == 0
    if stride_of(probe, pj) == 1 and row is not None and row >= spec.n and whole:
        offset = probe.args[0]
        ctx.info["b_operand"] = "read in place"
        return Packed(probe.name, lambda b, k0, j0: substitute(offset, {pb: b, pk: k0, pj: j0}), row)
    ld = round_up(spec.n, nr)
    name = ctx.scratch(spec.dtype, nb * spec.k * ld)
    q, j = ctx.var("q", nb * spec.k), ctx.var("j", spec.n)
    bb, k = Index((nb, spec.k), flat=q).dims
    rows = [ir.Loop(j, iconst(0), iconst(spec.n), [
        ir.Store(name, add(mul(q, ld), j), spec.b(Index(spec.b_batch, flat=bb), k, j))], simd=True)]
    if ld > spec.n:  # the last panel's columns past N: zeros
        pad = ctx.var("j", ld - spec.n, spec.n)
        rows.append(ir.Loop(pad, iconst(spec.n), iconst(ld),
                            [ir.Store(name, add(mul(q, ld), pad), const(0, spec.dtype))]))
    ctx.stage(f"pack operand B of {ctx.op.id} in rows",
              [ir.Loop(q, iconst(0), iconst(nb * spec.k), rows, parallel=1)], nb * spec.k * ld)
    ctx.info["b_operand"] = "packed in scratch rows"
    return Packed(name, lambda b, k0, j0: add(mul(add(mul(b, spec.k), k0), ld), j0), ld)


def b_copied_by_tasks(ctx: StageCtx, spec: Contraction, side: OperandSide, unit: int) -> bool:
    """Whether a run-time B that `b_rows` would copy is instead copied block by block by the GEMM's
    own tasks (`b_block_copy`): a plain matrix, contiguous along its rows or columns (attention's
    ragged or transposed operands), so that no stage of its own runs (and meets its threads) to
    copy it; a prologue with arithmetic or a gather (im2col) is still evaluated once, by `b_rows`."""
    probe, _, pj, pk = side.probes(ctx, spec.k)
    if probe.op != "load":
        return False
    along_j, along_k = stride_of(probe, pj), stride_of(probe, pk)
    in_place = along_j == 1 and along_k is not None and along_k >= spec.n and spec.n % unit == 0
    return not in_place and (along_j == 1 or along_k == 1)


def b_block_copy(ctx: StageCtx, spec: Contraction, name: str, ld: int, batch: Index,
                 sums: tuple[Expr, Expr], j0: Expr) -> list[ir.Stmt]:
    """name[k·ld + j] = B[k0 + k, j0 + j] for k < kc, j < ld, `sums` = (k0, kc); the columns past
    N are zeros (their results are never stored). Along B's contiguous rows each row's columns
    are read as one run, bounded by N: a clamp of every column index to N − 1 made GCC gather
    them (most -march targets; a 14 × 14 image's 1 × 1 conv, 96 → 576 channels, 1.4× the time).
    Along its columns the inner loop runs over the sum, and the column index is clamped."""
    k0, kc = sums
    k, j = ctx.var("k", spec.k), ctx.var("j", ld)
    probe, _, pj, _ = OperandSide("b", lambda bi, jj, kk: spec.b(bi, kk, jj), spec.b_batch,
                                  spec.n).probes(ctx, spec.k)
    if stride_of(probe, pj) != 1:
        value = spec.b(batch, add(k0, k), imin(add(j0, j), iconst(spec.n - 1)))
        store = ir.ArrayStore(name, add(mul(k, ld), j), value)
        return [ir.Loop(j, iconst(0), iconst(ld), [ir.Loop(k, iconst(0), kc, [store], simd=True)])]
    row = [ir.ArrayStore(name, add(mul(k, ld), j), spec.b(batch, add(k0, k), add(j0, j)))]
    if spec.n % ld == 0:  # every block lies inside B
        return [ir.Loop(k, iconst(0), kc, [ir.Loop(j, iconst(0), iconst(ld), row, simd=True)])]
    inside = imin(iconst(ld), sub(iconst(spec.n), j0))
    past = ctx.var("j", ld)
    zeros = [ir.ArrayStore(name, add(mul(k, ld), past), const(0, spec.dtype))]
    return [ir.Loop(k, iconst(0), kc, [ir.Loop(j, iconst(0), inside, row, simd=True),
                                       ir.Loop(past, inside, iconst(ld), zeros)])]
