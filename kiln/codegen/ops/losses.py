"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (reductions none, sum, mean; class
weights; ignore_index), following the ONNX reference, including its choice of divisor for mean.

SoftmaxCrossEntropyLoss first computes log-probabilities over the class axis — per (n, d) row:
a max phase, a sum-of-exponentials phase, then x − max − log(sum) into scratch (and the optional
log_prob output) — and then the loss from them, like NegativeLogLikelihoodLoss.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from kiln.codegen import ir
from kiln.codegen.expr import (
    Expr,
    acc,
    add,
    as_index,
    binary,
    call,
    clamp,
    const,
    iconst,
    index_compare,
    load,
    local,
    mul,
    select,
    unary,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage
from kiln.codegen.reduction import reduction_phase
from kiln.ecg import Graph, Op

LogProb = Callable[[Expr, Expr, Expr], Expr]  # (n, class, d) -> log-probability


def _float_scores(op: Op, graph: Graph) -> str | None:
    return None if graph.tensors[op.inputs[0]].dtype in ("float32", "float64") else "float input"


def _loss(ctx: StageCtx, log_prob: LogProb, counts_everything: bool) -> None:
    shape, dtype = ctx.shape(0), ctx.tensor(0).dtype
    n_size, classes = shape[0], shape[1]
    extra = math.prod(shape[2:])
    target_shape = ctx.shape(1)
    ignore = ctx.attr("ignore_index")
    reduction = ctx.attr("reduction", "mean")

    def term(p: Expr) -> tuple[Expr, Expr]:
        n, d = Index((n_size, extra), flat=p).dims
        t = as_index(ctx.operand(1, Index(target_shape, flat=p)))
        cls = clamp(t, 0, classes - 1)
        weight = (ctx.operand(2, Index(ctx.shape(2), dims=[cls])) if ctx.has(2)
                  else const(1, dtype))
        if ignore is not None:
            weight = select(index_compare("eq", t, ignore), const(0, dtype), weight)
        return binary("mul", unary("neg", log_prob(n, cls, d)), weight), weight

    total = n_size * extra
    p = var(ctx.name("p"), total)
    if reduction == "none":
        loss, _ = term(p)
        body = ctx.results({0: (Index(target_shape, flat=p), loss)})
        ctx.stage(f"{ctx.op.op_type} ({ctx.op.id})",
                  [ir.Loop(p, iconst(0), iconst(total), body, parallel=1)], total)
        return
    loss, weight = term(p)
    loss_sum, weight_sum = acc(ctx.name("loss"), dtype), acc(ctx.name("weight"), dtype)
    loop = ir.Loop(p, iconst(0), iconst(total),
                   [ir.Assign(loss_sum, binary("add", loss_sum, loss)),
                    ir.Assign(weight_sum, binary("add", weight_sum, weight))], simd=True,
                   reductions=(("+", loss_sum), ("+", weight_sum)))
    result: Expr = loss_sum
    if reduction == "mean":
        divisor = const(total, dtype) if counts_everything else weight_sum
        result = binary("div", loss_sum, divisor)
    stmts = [ir.DeclAcc(loss_sum, const(0, dtype)), ir.DeclAcc(weight_sum, const(0, dtype)), loop,
             *ctx.results({0: (Index(ctx.out(0).shape, flat=iconst(0)), result)})]
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id}), {reduction}", stmts, total)


@stage("NegativeLogLikelihoodLoss", check=_float_scores)
def _nll(ctx: StageCtx) -> None:
    shape = ctx.shape(0)
    extra = math.prod(shape[2:])

    def log_prob(n: Expr, cls: Expr, d: Expr) -> Expr:
        return ctx.operand(0, Index(shape, flat=add(mul(add(mul(n, shape[1]), cls), extra), d)))

    everything = not ctx.has(2) and ctx.attr("ignore_index") == -1
    _loss(ctx, log_prob, everything)


@stage("SoftmaxCrossEntropyLoss", check=_float_scores)
def _softmax_cross_entropy(ctx: StageCtx) -> None:
    shape, dtype = ctx.shape(0), ctx.tensor(0).dtype
    n_size, classes = shape[0], shape[1]
    extra = math.prod(shape[2:])
    rows = n_size * extra
    scratch = ctx.scratch(dtype, n_size * classes * extra)
    row = var(ctx.name("o"), rows)
    n, d = Index((n_size, extra), flat=row).dims

    def at(cls: Expr) -> Expr:
        return add(mul(add(mul(n, classes), cls), extra), d)

    def score(cls: Expr) -> Expr:
        return ctx.operand(0, Index(shape, flat=at(cls)))

    biggest_stmts, biggest = reduction_phase(ctx.name, classes, lambda c: c, "max", dtype, score,
                                             False)
    total_stmts, total = reduction_phase(
        ctx.name, classes, lambda c: c, "sum", dtype,
        lambda c: call("exp", dtype, binary("sub", score(c), biggest)), False)
    shift = local(ctx.name("shift"), dtype)
    cls = var(ctx.name("c"), classes)
    value = binary("sub", binary("sub", score(cls), biggest), shift)
    store = [ir.Store(scratch, at(cls), value)]
    if ctx.output_used(1):
        store += ctx.results({1: (Index(shape, flat=at(cls)), value)})
    body = [*biggest_stmts, *total_stmts, ir.Let(shift, call("log", dtype, total)),
            ir.Loop(cls, iconst(0), iconst(classes), store, simd=True)]
    ctx.stage(f"log-softmax of {ctx.op.id}", [ir.Loop(row, iconst(0), iconst(rows), body,
                                                      parallel=1)], rows * classes * 3)

    def log_prob(nn: Expr, c: Expr, dd: Expr) -> Expr:
        return load(scratch, dtype, add(mul(add(mul(nn, classes), c), extra), dd))

    everything = not ctx.has(2) and ctx.attr("ignore_index") is None
    _loss(ctx, log_prob, everything)
