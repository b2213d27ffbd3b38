"""Fused attention: an attention chain (`kiln.plan.chains`: MatMul → elementwise ops → Softmax over
the last axis → MatMul) as one stage, row tile by row tile, with the scores of a tile in L1.

A work item is one batch element (batch · heads) and a group of tiles of query rows (several
groups per element only when there are fewer than MIN_ITEMS elements). It computes the
transposed products, so that the softmax runs down the columns of the scores (vertical vector
operations, no horizontal reductions) and both products read their right operand in place:

* pack K into panels of key positions and V into panels of value columns, at most `mr` each, as
  many as pad least (`panel_rows`; local arrays, once per item; the chain's prologue — a
  Transpose, a Reshape, a scale — evaluated there);
* per row tile: Qᵀ of the tile into a local array, padded to whole vectors (zero past the last
  query row);
* Sᵀ = K · Qᵀ with the backend's GEMM micro-kernel, no packing of the scores;
* the elementwise ops of the chain (scale, bias, mask: any One-to-One ops the block fuses) on
  each score (a tensor they read down the score columns from a copy in loop order: a
  constant's derived at compile time, any other's copied by a stage ahead of the attention), the
  column maxima, exp(s − max) in place and the column sums;
* Oᵀ = Vᵀ · Sᵀ with the same micro-kernel, reading the exponentials where they are;
* O[i, :] = Oᵀ[:, i] / sum[i] through the second MatMul's fused epilogue (the output Transpose
  and Reshape) into the outputs.

Padded query columns hold finite values that no result reads (each column of Oᵀ depends on its
own column of Sᵀ only), and padded key rows are never summed over (the second product runs over
the real key positions). The lowering reads the chain's ops by their record where it can; it
handles the MatMul/Softmax form and leaves every other chain to the ordinary stages.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import NeedsBuffer, NotFusable, Provided, Refused, StageCtx
from kiln.codegen.expr import (
    BOOL,
    Expr,
    NotEvaluable,
    add,
    array_load,
    binary,
    call,
    const,
    iconst,
    imax,
    imin,
    local,
    evaluate_index,
    linearize,
    load,
    make,
    mul,
    replace_nodes,
    select,
    sub,
    substitute,
    walk,
)
from kiln.codegen.gemm.blocking import round_up
from kiln.codegen.gemm.spec import stride_of
from kiln.codegen.microkernel import MicroKernel, rows_evict_each_other, tile_for
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.ops.registry import lowering
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op
from kiln.plan.chains import AttentionChain

FLOATS = ("float32", "float64")
SCORES_BYTES = 32 * 1024  # a tile's scores stay within a 32 KiB L1 data cache
STACK_BYTES = 384 * 1024  # every local array of one work item (one thread's stack)
MIN_ITEMS = 8  # work items wanted before row tiles shrink below what L1 allows
RELAYOUT_GROWTH = 2  # a tensor read by the scores is copied in loop order up to this growth
# Independent FMAs a core keeps in flight (two FMA pipes, four cycles' latency): a micro-tile with
# fewer accumulators waits on its own sums
FMA_CHAINS = 8
PANEL_OVERHEAD_ROWS = 4  # a micro-tile's fixed cost in rows of multiply-adds (measured, Zen 4)
REFUSAL = "fused attention"  # the (op, tensor) key a failed trial leaves in the block's refusals


@dataclass(frozen=True)
class Geometry:
    """Scores [*batch, m, n] = Q [*, m, d] · Kᵀ [*, d, n]; out [*batch, m, dv] = P · V [*, n, dv];
    row tiles of `rows` query rows (`rows_pad` with the micro-kernel's column padding), `groups`
    work items per batch element of `per_group` tiles each (K and V packed once per item); K in
    panels of `mr_keys` key positions, V in panels of `mr_values` value columns."""

    batch: tuple[int, ...]
    m: int
    n: int
    d: int
    dv: int
    n_pad: int
    dv_pad: int
    rows: int
    rows_pad: int
    tiles: int
    groups: int
    mr_keys: int
    mr_values: int
    nr: int  # the micro-kernel's columns: the GEMM's where they divide rows_pad, else one vector

    @property
    def per_group(self) -> int:
        return -(-self.tiles // self.groups)

    @property
    def items(self) -> int:
        return math.prod(self.batch) * self.groups

    def stack_elements(self) -> int:
        return (self.n_pad * self.d + self.dv_pad * self.n + self.d * self.rows_pad
                + (self.n_pad + self.dv_pad + 2) * self.rows_pad)


def chain_ops(graph: Graph, chain: AttentionChain) -> list[Op]:
    return [graph.op_by_id[i] for i in chain.op_ids]


def geometry(graph: Graph, chain: AttentionChain, schedule: Schedule) -> Geometry:
    first, *_, second = chain_ops(graph, chain)
    scores = graph.tensors[first.outputs[0]].shape
    q = graph.tensors[first.inputs[0]].shape
    dv = graph.tensors[second.outputs[0]].shape[-1]
    dtype = graph.tensors[first.outputs[0]].dtype
    uk = micro_kernel_for(schedule, dtype)
    m, n = scores[-2:]
    itemsize = np.dtype(dtype).itemsize
    mr_keys, mr_values = panel_rows(n, uk.mr), panel_rows(dv, uk.mr)
    n_pad = round_up(n, mr_keys)
    batch = math.prod(scores[:-2])
    tiles, rows, rows_pad, nr = row_tiling(m, n_pad * itemsize, batch, uk)
    groups = min(tiles, -(-MIN_ITEMS // max(batch, 1)))
    return Geometry(tuple(scores[:-2]), m, n, q[-1], dv, n_pad, round_up(dv, mr_values), rows,
                    rows_pad, tiles, groups, mr_keys, mr_values, nr)


def row_tiling(m: int, column_bytes: int, batch: int, uk: MicroKernel
               ) -> tuple[int, int, int, int]:
    """(tiles, rows, rows_pad, nr): `m` query rows in equal tiles of `rows`, padded to `rows_pad`
    columns of scores (`column_bytes` each), run by micro-tiles of `nr` columns. Tiles padded to
    whole micro-kernel widths (`uk.nr`) compete with tiles padded to single vectors, by padded
    columns, each costing more where the micro-tile holds fewer accumulators than FMA_CHAINS: the
    products then run latency-bound (197 rows on AVX2: 13 tiles of 16 columns at 6x16, 208
    columns, ran 1.75x faster than 5 tiles of 40 at 6x8, 200 columns; on AVX-512, 13 tiles of 16
    at 11x16 ran 0.92x the time of 7 tiles of 32 at 11x32, 224 columns, ViT-base on Zen 4)."""
    steps = [uk.nr, uk.lanes] if uk.nr % uk.lanes == 0 else [uk.nr]

    def tiling(step: int) -> tuple[int, int, int, int]:
        most = round_up(m, step)
        while most > step and column_bytes * most > SCORES_BYTES:
            most -= step
        while batch * -(-m // most) < MIN_ITEMS and most > step:
            most -= step
        tiles = -(-m // tile_columns(m, most, step))
        rows = -(-m // tiles)  # the same number of rows in every tile
        rows_pad = round_up(rows, step)
        return tiles, rows, rows_pad, uk.nr if rows_pad % uk.nr == 0 else step

    def cost(t: tuple[int, int, int, int]) -> float:
        tiles, _, rows_pad, nr = t
        return tiles * rows_pad * max(1.0, FMA_CHAINS / (uk.mr * nr // uk.lanes))

    return min((tiling(step) for step in steps), key=cost)  # the wider tiles on a tie


def tile_columns(m: int, most: int, step: int) -> int:
    """Query rows per tile, at most `most`: the tiling of `m` rows into equal tiles, each padded to
    whole vectors (`step`), that computes the fewest padded columns (the larger tiles on a tie). 197
    rows run as 13 tiles of 16 (208 columns) rather than 7 of 29 padded to 32 (224)."""
    def padded(limit: int) -> int:
        tiles = -(-m // limit)
        return tiles * round_up(-(-m // tiles), step)
    return min(range(most, 0, -step), key=padded)


def panel_rows(extent: int, mr: int) -> int:
    """Rows of a product's A panels (at most the micro-kernel's `mr`): the fewest panels' worth of
    multiply-adds, each panel costing its rows plus PANEL_OVERHEAD_ROWS (loading and storing its
    accumulators, the call). For a number of panels the shortest rows that cover `extent` pad
    least: 64 value columns run as 6 panels of 11 rather than 6 of 12 with 8 rows of zeros."""
    least = -(-extent // mr)
    counts = range(least, max(least, -(-2 * extent // mr)) + 1)  # panels of at least mr/2 rows
    best = min(counts, key=lambda panels: panels * (-(-extent // panels) + PANEL_OVERHEAD_ROWS))
    return -(-extent // best)


def micro_kernel_for(schedule: Schedule, dtype: str) -> MicroKernel:
    """The packed GEMM's micro-kernel (`kiln.codegen.gemm.packed.micro_kernel`)."""
    return tile_for((), dtype, schedule.vector_bytes, schedule.gemm_mr, schedule.gemm_nr)


def check(graph: Graph, chain: AttentionChain, schedule: Schedule) -> str | None:
    """Why the chain cannot run as a fused attention stage, or None."""
    if not schedule.fused_attention:
        return "fused attention is off in the schedule"
    first, *between, normaliser, second = chain_ops(graph, chain)
    if first.op_type != "MatMul" or second.op_type != "MatMul" or normaliser.op_type != "Softmax":
        return "not a MatMul → Softmax → MatMul chain"
    operands = [graph.tensors[t] for t in (first.inputs[0], first.inputs[1], second.inputs[1])]
    if any(len(t.shape) < 2 for t in operands):
        return "a vector operand"
    dtypes = {t.dtype for t in operands} | {graph.tensors[first.outputs[0]].dtype}
    if len(dtypes) != 1 or not dtypes <= set(FLOATS) or schedule.vector_bytes <= 0:
        return "not one floating-point dtype with a vector micro-kernel"
    view = lowering(normaliser.op_type).view(normaliser, graph)
    if view.axes != (len(view.shape) - 1,):
        return "softmax not over the last axis"
    g = geometry(graph, chain, schedule)
    if min(g.m, g.n, g.d, g.dv) == 0:
        return "empty"
    if g.stack_elements() * np.dtype(dtypes.pop()).itemsize > STACK_BYTES:
        return "keys and values of one head do not fit a thread's stack"
    return None


def fused_attention(ctx: StageCtx, chain: AttentionChain) -> None:
    """The chain as one stage; `ctx` is the second MatMul's (its outputs and epilogue)."""
    graph = ctx.graph
    first, *_, normaliser, second = chain_ops(graph, chain)
    g = geometry(graph, chain, ctx.schedule)
    dtype = ctx.out().dtype
    uk = micro_kernel_for(ctx.schedule, dtype)
    uk_keys, uk_values = (replace(uk, mr=g.mr_keys, nr=g.nr),
                          replace(uk, mr=g.mr_values, nr=g.nr))
    read = ctx.builder.value
    shape_of = {t: graph.tensors[t].shape for t in (first.inputs[0], first.inputs[1],
                                                     second.inputs[1], first.outputs[0])}

    b, group = ctx.var("b", math.prod(g.batch)), ctx.var("group", g.groups)
    tile = ctx.var("tile", g.per_group)
    i0 = mul(add(mul(group, g.per_group), tile), g.rows)
    batch = Index(g.batch, flat=b)

    def at(tensor: str, row: Expr, col: Expr) -> Expr:
        shape = shape_of[tensor]
        lead = broadcast(batch, shape[:-2])
        return read(tensor, Index(shape, dims=[*lead.dims, row, col]))

    names = {key: ctx.name(key) for key in ("qt", "st", "ot", "mx", "sm")}
    qt, st, ot, mx, sm = names.values()
    body: list[ir.Stmt] = [
        ir.DeclArray(qt, dtype, g.d * g.rows_pad), ir.DeclArray(st, dtype, g.n_pad * g.rows_pad),
        ir.DeclArray(ot, dtype, g.dv_pad * g.rows_pad),
        ir.DeclArray(mx, dtype, g.rows_pad), ir.DeclArray(sm, dtype, g.rows_pad)]

    # the micro-kernels' A: K's rows of key positions and V's columns, read where they are when
    # they are plain loads, else packed into panels of mr_keys key positions and of mr_values
    # value columns
    keys = _a_operand(ctx, uk_keys, g.n, g.d, lambda key, k: at(first.inputs[1], k, key))
    body += keys.packing
    ctx.info.update(keys=keys.source)
    tile_body: list[ir.Stmt] = _pack_queries(ctx, g, qt, i0, lambda i, k: at(first.inputs[0], i, k),
                                             dtype)
    tile_body += _product(ctx, keys, g.d, (qt, _column, g.rows_pad), st, g.rows_pad,
                          g.rows_pad)

    # the chain's elementwise ops, column maxima, exponentials and column sums
    c2, j2 = ctx.var("c", g.rows_pad), ctx.var("j", g.n)
    row = imin(add(i0, c2), iconst(g.m - 1))  # padded columns repeat the last row's reads
    slot = add(mul(j2, g.rows_pad), c2)
    scores_index = Index(shape_of[first.outputs[0]], dims=[*batch.dims, row, j2])
    held = Provided(scores_index.flat, array_load(st, dtype, slot))
    try:
        score = ctx.low.builder({first.outputs[0]: held}).value(normaliser.inputs[0], scores_index)
    except (NotFusable, NeedsBuffer):
        raise Refused(second.id, REFUSAL) from None
    score = _operands_in_loop_order(ctx, score, (b, group, tile, j2, c2))
    best = array_load(mx, dtype, c2)
    c3 = ctx.var("c", g.rows_pad)
    tile_body.append(ir.Loop(c3, iconst(0), iconst(g.rows_pad), [
        ir.ArrayStore(mx, c3, const(-math.inf, dtype)), ir.ArrayStore(sm, c3, const(0, dtype))],
        simd=True))
    s = local(ctx.name("sc"), dtype)  # the score after the chain's elementwise ops
    # the scores as the product left them need no store back
    keep = [] if score == held.value else [ir.ArrayStore(st, slot, s)]
    tile_body.append(ir.Loop(j2, iconst(0), iconst(g.n), [
        ir.Loop(c2, iconst(0), iconst(g.rows_pad), [
            ir.Let(s, score), *keep,
            ir.ArrayStore(mx, c2, select(make("gt", BOOL, (s, best)), s, best))], simd=True)]))
    # exp(s − max) ≤ 1 and the sum ≥ 1: exp_flush's zero for terms below 2^-126 (kiln.codegen.cmath)
    # changes no probability, and saves exp's tails
    c4, j3 = ctx.var("c", g.rows_pad), ctx.var("j", g.n)
    slot3 = add(mul(j3, g.rows_pad), c4)
    e = local(ctx.name("e"), dtype)
    tile_body.append(ir.Loop(j3, iconst(0), iconst(g.n), [
        ir.Loop(c4, iconst(0), iconst(g.rows_pad), [
            ir.Let(e, call("exp_flush", dtype, binary("sub", array_load(st, dtype, slot3),
                                                array_load(mx, dtype, c4)))),
            ir.ArrayStore(st, slot3, e),
            ir.ArrayStore(sm, c4, binary("add", array_load(sm, dtype, c4), e))], simd=True)]))
    # O = P · V, then O[i, :] / sum[i - i0] through the second MatMul's epilogue (i ranges over
    # the query rows, so that the epilogue's index maps simplify as the packed GEMM's do): the
    # tile's O row-major where V's rows can be read in place, else Oᵀ = Vᵀ · Pᵀ
    v_rows = _values_in_place(ctx, g, uk, lambda j, col: at(second.inputs[1], j, col))
    i, dv = ctx.var("i", g.m), ctx.var("dv", g.dv)
    c5 = sub(i, i0)
    if v_rows is None:
        values = _a_operand(ctx, uk_values, g.dv, g.n,
                            lambda col, j: at(second.inputs[1], j, col))
        body += values.packing
        tile_body += _product(ctx, values, g.n, (st, _column, g.rows_pad), ot, g.rows_pad,
                              g.rows_pad)
        o_at, kernels = add(mul(dv, g.rows_pad), c5), f"{g.mr_values}x{g.nr}"
        ctx.info.update(values=values.source)
    else:
        product, kernel = _scores_times_values(ctx, g, uk, st, v_rows, ot)
        tile_body += product
        o_at, kernels = add(mul(c5, g.dv), dv), f"{kernel.mr}x{kernel.nr} (P·V)"
        ctx.info.update(values="rows read in place")
    inverse = local(ctx.name("inv"), dtype)
    value = binary("mul", array_load(ot, dtype, o_at), inverse)
    out_index = Index(ctx.out().shape, flat=add(mul(add(mul(b, g.m), i), g.dv), dv))
    tile_body.append(ir.Loop(i, i0, imin(add(i0, g.rows), iconst(g.m)), [
        ir.Let(inverse, binary("div", const(1, dtype), array_load(sm, dtype, c5))),
        ir.Loop(dv, iconst(0), iconst(g.dv), ctx.results({0: (out_index, value)}), simd=True)]))

    last_tile = imin(iconst(g.per_group), sub(iconst(g.tiles), mul(group, g.per_group)))
    body.append(ir.Loop(tile, iconst(0), last_tile, tile_body))

    ctx.stage(f"fused attention ({', '.join(chain.op_ids)})",
              [ir.Loop(b, iconst(0), iconst(math.prod(g.batch)),
                       [ir.Loop(group, iconst(0), iconst(g.groups), body)], parallel=1,
                       grain="one")],
              math.prod(g.batch) * g.tiles * g.rows_pad * g.n * (g.d + g.dv))
    ctx.info.update(form="fused attention", micro_kernel=f"{g.mr_keys}x{g.nr}, {kernels}",
                    rows=g.rows, tiles=g.tiles, items=g.items)


def _operands_in_loop_order(ctx: StageCtx, score: Expr, loops: tuple[Expr, ...]) -> Expr:
    """`score` with each tensor it reads with a stride along the innermost (vector) loop — a
    causal or padding mask, a relative-position bias [.., m, n] read down the columns of the
    scores, a gather per element that also keeps the loop from vectorising on AVX2 — read instead
    from a copy laid out in the order of `loops` (over the loops its offset depends on), so that
    the vector loop reads it contiguously. A constant's copy is derived at compile time; any other
    tensor's is made at run time by a stage ahead of the attention (once per kernel call, not per
    head: a mask broadcast over heads is copied once), whose inner loop runs along the tensor's
    contiguous axis. A copy more than RELAYOUT_GROWTH times the tensor's size (a tensor
    broadcast over heads whose offset depends on something else) is not made."""
    inner = loops[-1]
    replaced: dict[Expr, Expr] = {}
    for node in walk([score]):
        tensor = ctx.graph.tensors.get(node.name) if node.op == "load" else None
        if tensor is None or node in replaced:
            continue
        offset = node.args[0]
        if inner not in offset.free or offset.free - set(loops):
            continue
        used = [v for v in loops if v in offset.free]
        extents = [v.range[1] + 1 for v in used]
        if math.prod(extents) > RELAYOUT_GROWTH * tensor.numel:
            continue
        grid = np.meshgrid(*(np.arange(e) for e in extents), indexing="ij", sparse=True)
        try:
            offsets = np.broadcast_to(evaluate_index(offset, dict(zip(used, grid))), extents)
        except NotEvaluable:
            continue
        if np.all(np.diff(offsets, axis=-1) == 1):  # already contiguous along the vector loop
            continue
        copy = linearize(used, tuple(extents))
        if tensor.is_constant:
            # offsets past the constant belong to tiles past the last (never read): clipped
            table = tensor.data.reshape(-1)[np.clip(offsets, 0, tensor.data.size - 1)]
            replaced[node] = load(ctx.derived(table), node.dtype, copy)
        else:
            name = _copy_in_loop_order(ctx, node, used, extents, offsets)
            replaced[node] = load(name, node.dtype, copy)
    return replace_nodes(score, replaced) if replaced else score


def _copy_in_loop_order(ctx: StageCtx, node: Expr, used: list[Expr], extents: list[int],
                        offsets: np.ndarray) -> str:
    """A stage copying the load `node` into scratch at linearize(used) (the loops reordered so
    that the innermost one steps through the tensor by 1 where one does); the scratch's name.
    Offsets past the tensor (tiles past the last, never read) are clamped into it."""
    tensor = ctx.graph.tensors[node.name]
    offset = node.args[0]
    if offsets.max() >= tensor.numel or offsets.min() < 0:
        offset = imin(imax(offset, iconst(0)), iconst(tensor.numel - 1))
    fresh = [ctx.var("rl", e) for e in extents]
    order = sorted(range(len(used)), key=lambda a: _unit_stride(offsets, a))
    name = ctx.scratch(node.dtype, math.prod(extents))
    body: list[ir.Stmt] = [ir.Store(name, linearize(fresh, tuple(extents)),
                                    load(node.name, node.dtype,
                                         substitute(offset, dict(zip(used, fresh)))))]
    # the parallel loop is the outermost that runs more than once (a loop of one iteration, a
    # single group of row tiles, is dropped with its flag)
    outermost = next((a for a in order if extents[a] > 1), order[0])
    for position, a in enumerate(reversed(order)):
        body = [ir.Loop(fresh[a], iconst(0), iconst(extents[a]), body, simd=position == 0,
                        parallel=1 if a == outermost else 0, grain="chunks")]
    ctx.stage(f"{node.name} in the loop order of the scores", body, math.prod(extents))
    return name


def _unit_stride(offsets: np.ndarray, axis: int) -> bool:
    """Whether the offsets step by 1 along `axis` (that loop goes innermost)."""
    return offsets.shape[axis] > 1 and bool(np.all(np.diff(offsets, axis=axis) == 1))


def _panels(ctx: StageCtx, name: str, mr: int, extent: int, depth: int,
            value: Callable[[Expr, Expr], Expr], dtype: str) -> list[ir.Stmt]:
    """name[(panel·depth + k)·mr + r] = value(panel·mr + r, k), zero past `extent`: whole panels
    first, then the last partial one (so that no read is clamped and the loads stay contiguous
    along r)."""
    full, rest = divmod(extent, mr)
    panel, k, r = ctx.var("pn", max(full, 1)), ctx.var("kk", depth), ctx.var("r", mr)

    def at(panel_start: Expr, r_var: Expr) -> Expr:
        return add(mul(add(mul(panel_start, depth), k), mr), r_var)

    stmts: list[ir.Stmt] = []
    if full:
        store = ir.ArrayStore(name, at(panel, r), value(add(mul(panel, mr), r), k))
        # each row of the operand read once, whole (a head's K or V outgrows L1)
        if _reads_contiguously(ctx, store.value, k, r):  # K [n, d] as attention has it
            stmts.append(ir.Loop(panel, iconst(0), iconst(full), [
                ir.Loop(r, iconst(0), iconst(mr), [ir.Loop(k, iconst(0), iconst(depth),
                                                           [store])])]))
        else:  # V [n, dv], Kᵀ [d, n]: a row across the panels
            stmts.append(ir.Loop(k, iconst(0), iconst(depth), [
                ir.Loop(panel, iconst(0), iconst(full), [ir.Loop(r, iconst(0), iconst(mr),
                                                                 [store], simd=True)])]))
    if rest:
        last = iconst(full)
        r_in, r_out = ctx.var("r", rest), ctx.var("r", mr - rest, rest)
        stmts.append(ir.Loop(k, iconst(0), iconst(depth), [
            ir.Loop(r_in, iconst(0), iconst(rest), [
                ir.ArrayStore(name, at(last, r_in), value(add(full * mr, r_in), k))], simd=True),
            ir.Loop(r_out, iconst(rest), iconst(mr), [
                ir.ArrayStore(name, at(last, r_out), const(0, dtype))], simd=True)]))
    return stmts


def _pack_queries(ctx: StageCtx, g: Geometry, qt: str, i0: Expr,
                  value: Callable[[Expr, Expr], Expr], dtype: str) -> list[ir.Stmt]:
    """Qᵀ of the tile: qt[k·rows_pad + c] = value(i0 + c, k) = Q[i0 + c, k], zero past the last
    query row (a loop of its own, so that no read is clamped). Along Q's contiguous axis: a query
    row at a time where Q steps by one along k (Q [m, d], heads packed as [L, H·D]), whose
    scattered stores cost less than reads a row apart; where Q is a plain load, by the
    vectorised transpose of whole blocks (`ir.Transpose`; ViT-base's copy took 4 % of the
    stage's time one element at a time)."""
    k, c = ctx.var("kk", g.d), ctx.var("c", g.rows_pad)
    inside = imin(iconst(g.rows_pad), sub(iconst(g.m), i0))  # columns of real query rows
    store = ir.ArrayStore(qt, add(mul(k, g.rows_pad), c), value(add(i0, c), k))
    probe, lds = store.value, stride_of(store.value, c) if g.m > 1 else g.d
    if (probe.op == "load" and probe.name in ctx.graph.tensors and ctx.schedule.vector_bytes
            and stride_of(probe, k) == 1 and lds is not None and lds > 0):
        loops: list[ir.Stmt] = [ir.Transpose(
            dtype, probe.name, substitute(probe.args[0], {c: iconst(0), k: iconst(0)}), lds, qt,
            iconst(0), g.rows_pad, inside, iconst(g.d), ctx.schedule.vector_bytes)]
    elif _reads_contiguously(ctx, store.value, k, c):
        loops = [ir.Loop(c, iconst(0), inside, [ir.Loop(k, iconst(0), iconst(g.d), [store])])]
    else:
        loops = [ir.Loop(k, iconst(0), iconst(g.d), [ir.Loop(c, iconst(0), inside, [store],
                                                             simd=True)])]
    if g.tiles * g.rows_pad > g.m:
        k0, c0 = ctx.var("kk", g.d), ctx.var("c", g.rows_pad)
        loops.append(ir.Loop(k0, iconst(0), iconst(g.d), [
            ir.Loop(c0, inside, iconst(g.rows_pad),
                    [ir.ArrayStore(qt, add(mul(k0, g.rows_pad), c0), const(0, dtype))],
                    simd=True)]))
    return loops


def _reads_contiguously(ctx: StageCtx, value: Expr, along: Expr, across: Expr) -> bool:
    """Whether every tensor `value` reads along either loop (others are loop invariants) steps by
    one along `along` and not along `across` (a loop over `along` innermost reads each
    contiguously)."""
    steps = []
    for node in walk([value]):
        if node.op != "load" or node.name not in ctx.graph.tensors:
            continue
        offset = node.args[0]
        if along not in offset.free and across not in offset.free:
            continue
        at_zero = {v: np.zeros(2, np.int64) for v in offset.free}
        try:
            steps += [np.diff(evaluate_index(offset, {**at_zero, v: np.arange(2)}))[0]
                      if v in at_zero else 0 for v in (along, across)]
        except NotEvaluable:
            return False
    return bool(steps) and all(step == 1 for step in steps[0::2]) and 1 not in steps[1::2]


@dataclass(frozen=True)
class AOperand:
    """A product's A, `extent` rows by the sum: where panel p (`kernel.mr` rows) starts in
    `buffer`, the statements that fill a packed one (none for a tensor read in place), and how it
    is read (`source`, for the report)."""

    buffer: str
    start: Callable[[Expr], Expr]
    kernel: MicroKernel
    extent: int
    packing: list[ir.Stmt]
    source: str

    @property
    def in_place(self) -> bool:
        return not self.packing


def _a_operand(ctx: StageCtx, uk: MicroKernel, extent: int, depth: int,
               value: Callable[[Expr, Expr], Expr]) -> AOperand:
    """A = value(row, k) for `extent` rows and `depth` steps of the sum. Where A is a plain load
    of a tensor that steps by one along a row (K [n, d]: rows of key positions, read `lda`
    apart) or down a column (V [n, dv] read as Vᵀ, Kᵀ [d, n]: each step of the sum a row of the
    tensor, `a_step` apart), the micro-kernel reads it in place: packing it copied every element
    once more, in scalar transposing loops. Else panels in a local array (a fused prologue's
    arithmetic, a gather, rows whose lines share one L1 set)."""
    row, k = ctx.var("ar", extent), ctx.var("ak", depth)
    probe = value(row, k)
    if probe.op == "load" and probe.name in ctx.graph.tensors:
        kernel = _reading_in_place(uk, stride_of(probe, row) if extent > 1 else depth,
                                   stride_of(probe, k) if depth > 1 else extent)
        if kernel is not None:
            offset = probe.args[0]
            return AOperand(probe.name, lambda p: substitute(offset, {row: mul(p, uk.mr),
                                                                      k: iconst(0)}),
                            kernel, extent, [], "read in place")
    name = ctx.name("ap")
    panels = -(-extent // uk.mr)
    return AOperand(name, lambda p: mul(p, uk.mr * depth), uk, extent,
                    [ir.DeclArray(name, uk.dtype, panels * uk.mr * depth),
                     *_panels(ctx, name, uk.mr, extent, depth, value, uk.dtype)], "packed")


def _reading_in_place(uk: MicroKernel, row_stride: int | None, step_stride: int | None
                      ) -> MicroKernel | None:
    """The micro-kernel reading an A whose rows lie `row_stride` and whose steps of the sum lie
    `step_stride` elements apart, in place; None where neither is 1 (or the rows' lines would
    evict each other)."""
    if step_stride == 1 and row_stride and row_stride > 0:
        kernel = replace(uk, lda=row_stride)
        return None if rows_evict_each_other(kernel, row_stride * uk.itemsize) else kernel
    if row_stride == 1 and step_stride and step_stride > 0:
        return replace(uk, a_step=step_stride)
    return None


def _column(start: Expr) -> Expr:
    """The offset of row 0 at a column of a row-major local array."""
    return start


@dataclass(frozen=True)
class ValueRows:
    """V read in place as a product's B: its tensor, the offset of row 0 at a column, rows `ld`
    elements apart."""

    tensor: str
    at: Callable[[Expr], Expr]
    ld: int


def _values_in_place(ctx: StageCtx, g: Geometry, uk: MicroKernel,
                     value: Callable[[Expr, Expr], Expr]) -> ValueRows | None:
    """V = value(key position, column) as rows of B read in place: a plain load stepping by one
    along a row, its rows a constant distance apart, whole vectors per row (no micro-tile reads
    past a row's last column); None otherwise."""
    if g.dv % uk.lanes:
        return None
    j, col = ctx.var("vj", g.n), ctx.var("vc", g.dv)
    probe = value(j, col)
    if probe.op != "load" or probe.name not in ctx.graph.tensors:
        return None
    ld = stride_of(probe, j) if g.n > 1 else g.dv
    if stride_of(probe, col) != 1 or ld is None or ld < 0:
        return None
    offset = probe.args[0]
    return ValueRows(probe.name, lambda start: substitute(offset, {j: iconst(0), col: start}), ld)


def _scores_times_values(ctx: StageCtx, g: Geometry, uk: MicroKernel, st: str, v: ValueRows,
                         o: str) -> tuple[list[ir.Stmt], MicroKernel]:
    """o[c·dv + col] = Σ_j P[c, j] · V[j, col] over the tile's (padded) query columns c, and the
    micro-kernel: A the exponentials where they are (Pᵀ row-major is P column-major, `a_step`
    = rows_pad), B V's rows in place. O comes out row-major, so the epilogue runs along O's
    rows: the transposed Oᵀ = Vᵀ · Pᵀ left a gather per output element (BERT: a tenth of the
    stage's time)."""
    nr = uk.nr if g.dv % uk.nr == 0 else uk.lanes
    kernel = replace(uk, mr=panel_rows(g.rows_pad, uk.mr), nr=nr, a_step=g.rows_pad)
    probabilities = AOperand(st, lambda p: mul(p, kernel.mr), kernel, g.rows_pad, [],
                             "read in place")
    return _product(ctx, probabilities, g.n, (v.tensor, v.at, v.ld), o, g.dv, g.dv), kernel


def _product(ctx: StageCtx, a: AOperand, kc: int, b: tuple[str, Callable[[Expr], Expr], int],
             c: str, ldc: int, columns: int) -> list[ir.Stmt]:
    """C[rows × columns] = A · B with the micro-kernel, C row-major (`ldc`), B = (buffer, the
    offset of row 0 at a column, row stride), whole micro-tiles of columns: A's whole panels,
    then a last partial panel of A read in place with a kernel of just its rows (a packed one is
    padded with zeros)."""
    uk, (b_buffer, b_at, ldb) = a.kernel, b
    full, rest = divmod(a.extent, uk.mr)
    if not a.in_place and rest:
        full, rest = full + 1, 0
    jp, ip = ctx.var("jp", columns // uk.nr), ctx.var("ip", max(full, 1))

    def call_(kernel: MicroKernel, panel: Expr) -> ir.MicroKernelCall:
        return ir.MicroKernelCall(kernel, iconst(kc), a.buffer, a.start(panel), b_buffer,
                                  b_at(mul(jp, uk.nr)), ldb, c,
                                  add(mul(panel, uk.mr * ldc), mul(jp, uk.nr)), ldc,
                                  const(False, BOOL))

    per_column: list[ir.Stmt] = []
    if full:
        per_column.append(ir.Loop(ip, iconst(0), iconst(full), [call_(uk, ip)]))
    if rest:
        per_column.append(call_(replace(uk, mr=rest), iconst(full)))
    return [ir.Loop(jp, iconst(0), iconst(columns // uk.nr), per_column)]

