"""Attention (opsets 23–25): scaled dot-product attention per (batch, head, query) row.

Per row, in one parallel loop over rows: the scores q·k over the key/value positions (past cache
first, then the new keys) with softcap and the attention bias (mask, causal frontier, sliding
window, non-padded key lengths, exactly as the ONNX reference composes them) into a row buffer;
a numerically safe softmax over it (fully masked rows give zeros); then the probability-weighted
sum of values, accumulated over positions into a stack array of the value head size. The
optional outputs — present key/value (cache and new keys concatenated) and the QK matrix at the
requested stage — are written along the way. Grouped-query attention maps query head h to key
head h // (q_heads / kv_heads); 3-D inputs are read as (batch, seq, heads·size).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import helper

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    Expr,
    acc,
    add,
    array_load,
    as_index,
    binary,
    call,
    cast,
    const,
    floordiv,
    iconst,
    imax,
    imin,
    index_compare,
    load,
    local,
    logical_and,
    logical_or,
    make,
    mul,
    select,
    sub,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage
from kiln.ecg import Graph, Op

MAX_STACK_ROW = 16384  # scores of one row live on the stack up to this many key positions


@dataclass(frozen=True)
class Geometry:
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    new_len: int
    past_len: int
    head: int
    value_head: int
    three_d: bool

    @property
    def kv_len(self) -> int:
        return self.past_len + self.new_len


def _geometry(ctx: StageCtx) -> Geometry:
    q, k, v = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    past = ctx.shape(4)[2] if ctx.has(4) else 0
    if len(q) == 3:
        qh, kvh = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
        return Geometry(q[0], qh, kvh, q[1], k[1], past, q[2] // qh, v[2] // kvh, True)
    return Geometry(q[0], q[1], k[1], q[2], k[2], past, q[3], v[3], False)


def _check(op: Op, graph: Graph) -> str | None:
    dtypes = {graph.tensors[t].dtype for t in op.inputs[:3] if t}
    if not dtypes <= FLOAT_TYPES:
        return "floating-point inputs only"
    precision = op.attrs.get("softmax_precision")
    if precision and np.dtype(helper.tensor_dtype_to_np_dtype(precision)).name not in FLOAT_TYPES:
        return "softmax precision"
    return None


class _Reader:
    """Element reads of Q, K (cache then new), V and the mask, by (batch, head, position, dim)."""

    def __init__(self, ctx: StageCtx, g: Geometry):
        self.ctx, self.g = ctx, g

    def _head_layout(self, i: int, b: Expr, h: Expr, t: Expr, d: Expr, size: int) -> Expr:
        shape = self.ctx.shape(i)
        if self.g.three_d:
            return self.ctx.operand(i, Index(shape, dims=[b, t, add(mul(h, size), d)]))
        return self.ctx.operand(i, Index(shape, dims=[b, h, t, d]))

    def query(self, b: Expr, h: Expr, t: Expr, d: Expr) -> Expr:
        return self._head_layout(0, b, h, t, d, self.g.head)

    def cached(self, new: int, past: int, b: Expr, h: Expr, t: Expr, d: Expr, size: int) -> Expr:
        """Position t of the concatenation (cache, new) along the sequence."""
        fresh = self._head_layout(new, b, h, _at_least(sub(t, self.g.past_len), 0), d, size)
        if not self.ctx.has(past):
            return fresh
        old = self.ctx.operand(past, Index(self.ctx.shape(past),
                                           dims=[b, h, _at_most(t, self.g.past_len - 1), d]))
        return select(index_compare("lt", t, self.g.past_len), old, fresh)

    def key(self, b: Expr, h: Expr, t: Expr, d: Expr) -> Expr:
        return self.cached(1, 4, b, h, t, d, self.g.head)

    def value(self, b: Expr, h: Expr, t: Expr, d: Expr) -> Expr:
        return self.cached(2, 5, b, h, t, d, self.g.value_head)


def _at_least(x: Expr, lo: int) -> Expr:
    return imax(x, lo)


def _at_most(x: Expr, hi: int) -> Expr:
    return imin(x, max(hi, 0))


def _neg_inf(dtype: str) -> Expr:
    return const(-math.inf, dtype)


def _bias(ctx: StageCtx, g: Geometry, dtype: str, b: Expr, h: Expr, q: Expr, j: Expr) -> Expr:
    """The additive attention bias of (b, h, q, j), composed as the ONNX reference does."""
    zero, blocked = const(0, dtype), _neg_inf(dtype)
    mask = None
    if ctx.has(3):
        shape = ctx.shape(3)
        full = [b, h, q, j][4 - len(shape):]
        dims = [iconst(0) if n == 1 else d for d, n in zip(full, shape)]
        dims[-1] = _at_most(j, shape[-1] - 1)
        raw = ctx.operand(3, Index(shape, dims=dims))
        padded = index_compare("ge", j, shape[-1])
        mask = select(padded, blocked, select(raw, zero, blocked) if raw.dtype == BOOL else
                      cast(raw, dtype))
    nonpad = None
    if ctx.has(6):
        nonpad = as_index(ctx.operand(6, Index(ctx.shape(6), dims=[b])))
    offset = sub(nonpad, g.q_len) if nonpad is not None and not ctx.has(4) else iconst(g.past_len)
    bias = mask if mask is not None else zero
    if ctx.attr("is_causal", 0):
        allowed = make("le", BOOL, (j, add(q, offset)))
        bias = binary("add", bias, select(allowed, zero, blocked))
    left, right = ctx.attr("left_window_size", -1), ctx.attr("right_window_size", -1)
    if left >= 0 or right >= 0:
        diff = sub(add(q, offset), j)
        allowed = const(True, BOOL)
        if left >= 0:
            allowed = logical_and(allowed, make("le", BOOL, (diff, iconst(left))))
        if right >= 0:
            allowed = logical_and(allowed, make("le", BOOL, (mul(diff, -1), iconst(right))))
        bias = binary("add", bias, select(allowed, zero, blocked))
    if nonpad is not None:
        bias = binary("add", bias, select(make("lt", BOOL, (j, nonpad)), zero, blocked))
    return bias


def _nan_max(best: Expr, x: Expr) -> Expr:
    """np.max's rule for a running maximum: a NaN anywhere wins."""
    take = logical_or(make("gt", BOOL, (x, best)), make("ne", BOOL, (x, x)))
    return select(make("ne", BOOL, (best, best)), best, select(take, x, best))


@stage("Attention", check=_check)
def _attention(ctx: StageCtx) -> None:
    g = _geometry(ctx)
    dtype = ctx.out(0).dtype
    read = _Reader(ctx, g)
    rows = g.batch * g.q_heads * g.q_len
    if ctx.output_used(1) or ctx.output_used(2):
        _present(ctx, g, read)
    if rows == 0:
        return
    scale = ctx.attr("scale")
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(g.head))
    softcap = ctx.attr("softcap") or 0.0
    mode = ctx.attr("qk_matmul_output_mode", 0)
    kv = g.kv_len
    p = var(ctx.name("p"), rows)
    b, h, q = Index((g.batch, g.q_heads, g.q_len), flat=p).dims
    kh = floordiv(h, g.q_heads // g.kv_heads)
    on_stack = kv <= MAX_STACK_ROW
    scores = ctx.name("scores") if on_stack else ctx.scratch(dtype, rows * kv)

    def slot(j: Expr) -> Expr:
        return j if on_stack else add(mul(p, kv), j)

    def score(j: Expr) -> Expr:
        return array_load(scores, dtype, slot(j)) if on_stack else load(scores, dtype, slot(j))

    def keep(j: Expr, value: Expr) -> ir.Stmt:
        return ir.ArrayStore(scores, slot(j), value) if on_stack else ir.Store(scores, slot(j), value)

    def qk_index(j: Expr) -> Index:
        return Index(ctx.out(3).shape, dims=[b, h, q, j])

    best, worst_bias = acc(ctx.name("max"), dtype), acc(ctx.name("maxbias"), dtype)
    j = var(ctx.name("j"), kv)
    d = var(ctx.name("d"), g.head)
    dot = acc(ctx.name("dot"), dtype)
    root_c = const(root, dtype)
    term = binary("mul", binary("mul", read.query(b, h, q, d), root_c),
                  binary("mul", read.key(b, kh, j, d), root_c))
    raw = local(ctx.name("s"), dtype)
    capped: Expr = raw
    if softcap > 0:
        cap = const(softcap, dtype)
        capped = binary("mul", call("tanh", dtype, binary("div", raw, cap)), cap)
    bias = local(ctx.name("bias"), dtype)
    biased = local(ctx.name("v"), dtype)
    phase_scores: list[ir.Stmt] = [
        ir.DeclAcc(dot, const(0, dtype)),
        ir.Loop(d, iconst(0), iconst(g.head), [ir.Assign(dot, binary("add", dot, term))],
                simd=True, reductions=(("+", dot),)),
        ir.Let(raw, dot), ir.Let(bias, _bias(ctx, g, dtype, b, h, q, j)),
        ir.Let(biased, binary("add", capped, bias)), keep(j, biased),
        ir.Assign(best, _nan_max(best, biased)), ir.Assign(worst_bias, _nan_max(worst_bias, bias))]
    if ctx.output_used(3) and mode in (0, 1, 2):
        phase_scores += ctx.results({3: (qk_index(j), biased if mode == 2 else capped)})
    shift = local(ctx.name("shift"), dtype)
    total = acc(ctx.name("sum"), dtype)
    j2 = var(ctx.name("j"), kv)
    e = local(ctx.name("e"), dtype)
    phase_exp = [ir.Let(e, call("exp", dtype, binary("sub", score(j2), shift))), keep(j2, e),
                 ir.Assign(total, binary("add", total, e))]
    masked = local(ctx.name("masked"), BOOL)
    inverse = local(ctx.name("inv"), dtype)
    j3 = var(ctx.name("j"), kv)
    prob = local(ctx.name("prob"), dtype)
    phase_norm: list[ir.Stmt] = [
        ir.Let(prob, select(masked, const(0, dtype), binary("mul", score(j3), inverse))),
        keep(j3, prob)]
    if ctx.output_used(3) and mode == 3:
        phase_norm += ctx.results({3: (qk_index(j3), prob)})
    out_acc = ctx.name("out")
    j4, dv = var(ctx.name("j"), kv), var(ctx.name("d"), g.value_head)
    weighted = binary("add", array_load(out_acc, dtype, dv),
                      binary("mul", score(j4), read.value(b, kh, j4, dv)))
    dv2 = var(ctx.name("d"), g.value_head)
    y_index = (Index(ctx.out(0).shape, dims=[b, q, add(mul(h, g.value_head), dv2)]) if g.three_d
               else Index(ctx.out(0).shape, dims=[b, h, q, dv2]))
    dv0 = var(ctx.name("d"), g.value_head)
    body: list[ir.Stmt] = []
    if on_stack:
        body.append(ir.DeclArray(scores, dtype, kv))
    body += [
        ir.DeclAcc(best, _neg_inf(dtype)), ir.DeclAcc(worst_bias, _neg_inf(dtype)),
        ir.Loop(j, iconst(0), iconst(kv), phase_scores),
        ir.Let(shift, select(make("eq", BOOL, (best, _neg_inf(dtype))), const(0, dtype), best)),
        ir.DeclAcc(total, const(0, dtype)),
        ir.Loop(j2, iconst(0), iconst(kv), phase_exp),
        ir.Let(masked, make("eq", BOOL, (worst_bias, _neg_inf(dtype)))),
        ir.Let(inverse, binary("div", const(1, dtype),
                               select(make("eq", BOOL, (total, const(0, dtype))), const(1, dtype),
                                      total))),
        ir.Loop(j3, iconst(0), iconst(kv), phase_norm),
        ir.DeclArray(out_acc, dtype, g.value_head),
        ir.Loop(dv0, iconst(0), iconst(g.value_head),
                [ir.ArrayStore(out_acc, dv0, const(0, dtype))], simd=True),
        ir.Loop(j4, iconst(0), iconst(kv),
                [ir.Loop(dv, iconst(0), iconst(g.value_head), [ir.ArrayStore(out_acc, dv, weighted)],
                         simd=True)]),
        ir.Loop(dv2, iconst(0), iconst(g.value_head),
                ctx.results({0: (y_index, array_load(out_acc, dtype, dv2))}))]
    ctx.stage(f"attention ({ctx.op.id})", [ir.Loop(p, iconst(0), iconst(rows), body, parallel=1)],
              rows * kv * (g.head + g.value_head))


def _present(ctx: StageCtx, g: Geometry, read: _Reader) -> None:
    """present_key / present_value: the cache followed by the new keys and values."""
    for position, size, fetch in ((1, g.head, read.key), (2, g.value_head, read.value)):
        if not ctx.output_used(position):
            continue
        shape = ctx.out(position).shape
        count = math.prod(shape)
        if count == 0:
            continue
        q = var(ctx.name("q"), count)
        b, h, t, d = Index(shape, flat=q).dims
        body = ctx.results({position: (Index(shape, flat=q), fetch(b, h, t, d))})
        ctx.stage(f"attention ({ctx.op.id}): present {'key' if position == 1 else 'value'}",
                  [ir.Loop(q, iconst(0), iconst(count), body, parallel=1)], count)
