"""Reductions and normalisations (Many-to-Many, one-relies-on-many): row ops.

Each op sees its input as rows (the kept axes) of elements (the reduced axes) and is written as
reduction phases plus results: per row (a reduction's output) or per element (a normalisation's
output). Row ops with the same rows share one stage (see `kiln.codegen.lower.RowStage`).
"""
from __future__ import annotations

import math

from kiln.codegen.expr import (
    FLOAT_TYPES,
    Expr,
    cast,
    const,
    floordiv,
    index_compare,
    modulo,
    select,
    unary,
)
from kiln.codegen.expr import add as iadd
from kiln.codegen.expr import mul as imul
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.contexts import Point, RowCtx, RowView
from kiln.codegen.ops.registry import row
from kiln.codegen.ops.common import add, c, cmp, div, exp, fn, mul, sub
from kiln.codegen.ops.common import axis_of
from kiln.ecg import Graph, Op


def _float_input(op: Op, graph: Graph) -> str | None:
    return None if graph.tensors[op.inputs[0]].dtype in FLOAT_TYPES else "floating-point input only"


def _const_axes(op: Op, graph: Graph) -> str | None:
    if len(op.inputs) > 1 and op.inputs[1] is not None and not graph.is_constant(op.inputs[1]):
        return "axes must be a constant"
    return None


def two_d(shape: tuple[int, ...], axis: int) -> RowView:
    """Rows are the dims before `axis`, elements the dims from `axis` on."""
    axis = axis_of(axis, len(shape))
    return RowView((math.prod(shape[:axis]), math.prod(shape[axis:])), (1,))


def channels_view(shape: tuple[int, ...], groups: int = 0) -> RowView:
    """(N, C, *spatial) as rows of (N·C) channels — or N·groups channel groups."""
    n, ch = shape[0], shape[1]
    spatial = math.prod(shape[2:])
    rows = groups or ch
    return RowView((n * rows, ch // rows * spatial), (1,))


# --- Reduce* ------------------------------------------------------------------------------------
REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def _reduce_view(op: Op, graph: Graph) -> RowView:
    shape = graph.tensors[op.inputs[0]].shape
    rank = len(shape)
    axes_input = op.inputs[1] if len(op.inputs) > 1 else None
    axes = [] if axes_input is None else [int(a) for a in graph.tensors[axes_input].data.reshape(-1)]
    if not axes:
        axes = [] if op.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return RowView(shape, tuple(sorted({axis_of(a, rank) for a in axes})))


@row(*REDUCE_OPS, view=_reduce_view, check=_const_axes)
def _reduce(rc: RowCtx) -> None:
    t = rc.op.op_type
    dtype = rc.out().dtype
    n = rc.view.reduced

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    if t in ("ReduceMax", "ReduceMin"):
        result = rc.reduce("max" if t == "ReduceMax" else "min", dtype, x)
    elif t == "ReduceProd":
        result = rc.reduce("prod", dtype, x)
    elif t == "ReduceLogSumExp":
        m = rc.reduce("max", dtype, x)
        shift = select(cmp("eq", unary("abs", m), c(math.inf, m)), c(0, m), m)
        total = rc.reduce("sum", dtype, lambda p: exp(sub(x(p), shift)))
        result = add(fn("log", total), shift)
    elif t == "ReduceSum" and rc.keep_input(0):
        total, kept = rc.reduce_kept("sum", dtype, x)
        rc.share_row(0, kept)
        result = total
    else:
        term = {"ReduceL1": lambda p: unary("abs", x(p)),
                "ReduceL2": lambda p: mul(x(p), x(p)),
                "ReduceSumSquare": lambda p: mul(x(p), x(p))}.get(t, x)
        total = rc.reduce("sum", dtype, term)
        result = total
        if t == "ReduceMean":
            result = _in_float(total, lambda v: div(v, c(n, v)))
        elif t == "ReduceL2":
            result = _in_float(total, lambda v: fn("sqrt", v))
        elif t == "ReduceLogSum":
            result = _in_float(total, lambda v: fn("log", v))
    rc.reduced_output(0, result)


def _in_float(v: Expr, f) -> Expr:
    """Apply a floating-point formula to an integer value (then truncate back, as numpy does)."""
    if v.dtype in FLOAT_TYPES:
        return f(v)
    return cast(f(cast(v, "float64")), v.dtype)


def _arg_view(op: Op, graph: Graph) -> RowView:
    shape = graph.tensors[op.inputs[0]].shape
    return RowView(shape, (axis_of(op.attrs.get("axis", 0), len(shape)),))


@row("ArgMax", "ArgMin", view=_arg_view)
def _arg(rc: RowCtx) -> None:
    kind = "argmax" if rc.op.op_type == "ArgMax" else "argmin"
    where = rc.reduce(kind, rc.tensor(0).dtype, lambda p: rc.input(0, p),
                      select_last=bool(rc.attr("select_last_index", 0)))
    rc.reduced_output(0, where)


def _global_pool_view(op: Op, graph: Graph) -> RowView:
    return channels_view(graph.tensors[op.inputs[0]].shape)


@row("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", view=_global_pool_view,
     check=_float_input)
def _global_pool(rc: RowCtx) -> None:
    dtype = rc.out().dtype
    t = rc.op.op_type
    if t == "GlobalMaxPool":
        rc.reduced_output(0, rc.reduce("max", dtype, lambda p: rc.input(0, p)))
    elif t == "GlobalAveragePool":
        total = rc.reduce("sum", dtype, lambda p: rc.input(0, p))
        rc.reduced_output(0, div(total, c(rc.view.reduced, total)))
    else:
        p_norm = float(rc.attr("p", 2))
        total = rc.reduce("sum", dtype, lambda p: _abs_pow(rc.input(0, p), p_norm))
        rc.reduced_output(0, fn("pow", total, c(1 / p_norm, total)))


def _abs_pow(x: Expr, p: float) -> Expr:
    if p == 1:
        return unary("abs", x)
    if p == 2:
        return mul(x, x)
    return fn("pow", unary("abs", x), c(p, x))


# --- softmax family -------------------------------------------------------------------------------
def _softmax_view(op: Op, graph: Graph) -> RowView:
    shape = graph.tensors[op.inputs[0]].shape
    if graph.opset and graph.opset < 13:
        return two_d(shape, op.attrs.get("axis", 1))
    return RowView(shape, (axis_of(op.attrs.get("axis", -1), len(shape)),))


@row("Softmax", "LogSoftmax", "Hardmax", view=_softmax_view, check=_float_input)
def _softmax(rc: RowCtx) -> None:
    dtype = rc.out().dtype

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    if rc.op.op_type == "Hardmax":
        where = rc.reduce("argmax", dtype, x)
        rc.row_output(0, lambda p: select(index_compare("eq", p.r, where), const(1, dtype),
                                          const(0, dtype)))
        return
    m = rc.reduce("max", dtype, x)
    # exp(x − max) ≤ 1 and the sum ≥ 1: exp_flush's zero for terms below 2^-126
    # (kiln.codegen.cmath) changes no probability, and saves exp's tails
    if rc.op.op_type == "Softmax":
        total, exps = rc.reduce_kept("sum", dtype, lambda p: fn("exp_flush", sub(x(p), m)))
        inverse = div(c(1, total), total)
        rc.row_output(0, lambda p: mul(exps(p), inverse))
        return
    total = rc.reduce("sum", dtype, lambda p: fn("exp_flush", sub(x(p), m)))
    if rc.op.op_type == "LogSoftmax":
        shift = add(m, fn("log", total))
        rc.row_output(0, lambda p: sub(x(p), shift))


# --- normalisations ----------------------------------------------------------------------------
def _mean_and_inv_std(rc: RowCtx, x, eps: float, dtype: str) -> tuple[Expr, Expr, Expr]:
    n = rc.view.reduced
    total = rc.reduce("sum", dtype, x)
    mean = div(total, c(n, total))
    squares = rc.reduce("sum", dtype, lambda p: _square(sub(x(p), mean)))
    variance = div(squares, c(n, squares))
    return mean, variance, div(c(1, variance), fn("sqrt", add(variance, c(eps, variance))))


def _square(v: Expr) -> Expr:
    return mul(v, v)


def _layer_norm_view(op: Op, graph: Graph) -> RowView:
    return two_d(graph.tensors[op.inputs[0]].shape, op.attrs.get("axis", -1))


def _trailing(rc: RowCtx, i: int, p: Point) -> Expr:
    """Input i (broadcastable to the normalised dims) at the point's element."""
    shape = rc.tensor(0).shape
    axis = axis_of(rc.attr("axis", -1), len(shape))
    inner = Index(shape[axis:], flat=p.r)
    return rc.value(i, p, broadcast(inner, rc.tensor(i).shape))


@row("LayerNormalization", view=_layer_norm_view, check=_float_input)
def _layer_norm(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    mean, _, inv = _mean_and_inv_std(rc, x, rc.attr("epsilon", 1e-5), dtype)

    def y(p: Point) -> Expr:
        v = mul(mul(sub(x(p), mean), inv), _trailing(rc, 1, p))
        return add(v, _trailing(rc, 2, p)) if rc.has(2) else v

    rc.row_output(0, y)
    if len(rc.op.outputs) > 1:
        rc.reduced_output(1, mean)
    if len(rc.op.outputs) > 2:
        rc.reduced_output(2, inv)


@row("RMSNormalization", view=_layer_norm_view, check=_float_input)
def _rms_norm(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype
    n = rc.view.reduced
    squares = rc.reduce("sum", dtype, lambda p: _square(rc.input(0, p)))
    eps = c(rc.attr("epsilon", 1e-5), squares)
    inv = div(c(1, squares), fn("sqrt", add(div(squares, c(n, squares)), eps)))
    rc.row_output(0, lambda p: mul(mul(rc.input(0, p), inv), _trailing(rc, 1, p)))


def _instance_view(op: Op, graph: Graph) -> RowView:
    return channels_view(graph.tensors[op.inputs[0]].shape)


@row("InstanceNormalization", view=_instance_view, check=_float_input)
def _instance_norm(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype
    channels = rc.tensor(0).shape[1]

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    mean, _, inv = _mean_and_inv_std(rc, x, rc.attr("epsilon", 1e-5), dtype)

    def y(p: Point) -> Expr:
        ch = Index((channels,), dims=[modulo(p.o, channels)])
        return add(mul(mul(sub(x(p), mean), inv), rc.value(1, p, ch)), rc.value(2, p, ch))

    rc.row_output(0, y)


def _group_view(op: Op, graph: Graph) -> RowView:
    return channels_view(graph.tensors[op.inputs[0]].shape, op.attrs["num_groups"])


@row("GroupNormalization", view=_group_view, check=_float_input)
def _group_norm(rc: RowCtx) -> None:
    shape = rc.tensor(0).shape
    dtype = rc.tensor(0).dtype
    groups, channels = rc.attr("num_groups"), shape[1]
    spatial = math.prod(shape[2:])

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    mean, _, inv = _mean_and_inv_std(rc, x, rc.attr("epsilon", 1e-5), dtype)
    per_group = rc.tensor(1).shape[0] == groups and groups != channels

    def y(p: Point) -> Expr:
        group = modulo(p.o, groups)
        if per_group:
            where = Index((groups,), dims=[group])
        else:
            where = Index((channels,), dims=[iadd(imul(group, channels // groups),
                                                  floordiv(p.r, spatial))])
        return add(mul(mul(sub(x(p), mean), inv), rc.value(1, p, where)), rc.value(2, p, where))

    rc.row_output(0, y)


def _mvn_view(op: Op, graph: Graph) -> RowView:
    shape = graph.tensors[op.inputs[0]].shape
    axes = op.attrs.get("axes", [0, 2, 3])
    return RowView(shape, tuple(sorted(axis_of(a, len(shape)) for a in axes)))


@row("MeanVarianceNormalization", view=_mvn_view, check=_float_input)
def _mvn(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    mean, variance, _ = _mean_and_inv_std(rc, x, 0.0, dtype)
    denominator = add(fn("sqrt", variance), c(1e-9, variance))
    rc.row_output(0, lambda p: div(sub(x(p), mean), denominator))


def _lp_view(op: Op, graph: Graph) -> RowView:
    shape = graph.tensors[op.inputs[0]].shape
    return RowView(shape, (axis_of(op.attrs.get("axis", -1), len(shape)),))


@row("LpNormalization", view=_lp_view, check=_float_input)
def _lp_norm(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype
    p_norm = rc.attr("p", 2)

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    total = rc.reduce("sum", dtype, lambda p: _abs_pow(x(p), p_norm))
    norm = fn("sqrt", total) if p_norm == 2 else total
    zero = c(0, norm)
    rc.row_output(0, lambda p: select(cmp("eq", norm, zero), zero, div(x(p), norm)))
