"""Distributive rules: factor a common operand out of a sum (Table 4's second block, Figure 2b),
push a scale or a shift through a linear op or a reduction into a constant, and fold per-channel
scales and shifts into the weights and bias of the contraction before them.

Floating-point only (a factored sum rounds differently; integer sums may overflow).
"""
from __future__ import annotations

import numpy as np

from kiln.ops import DISTRIBUTIVE
from kiln.rewrite import facts as f
from kiln.rewrite.dsl import (A, Add, B, C, Conv, Copt, Div, Exp, Fill, Gemm, K, Log, LogSoftmax,
                              MatMul, Max, Min, Mul, Neg, Pow, ReduceL1, ReduceL2,
                              ReduceLogSumExp, ReduceMax, ReduceMean, ReduceMin, ReduceSum,
                              ReduceSumSquare, Softmax, Sub, Var, W1, W2, Wc, X, X1, X2, ax, b,
                              b1, b2, c, c1, c2, rule, v)

TABLE4 = "Table 4"


def _dist(name, pattern, replacement, **kw):
    return rule(name, DISTRIBUTIVE, pattern, replacement, **kw)


# --- Table 4 -----------------------------------------------------------------------------------

_dist("factor_mul_add", Add(Mul(A, C), Mul(A, B)), Mul(A, Add(C, B)), source=TABLE4,
      note="A⊙C + A⊙B → A⊙(C + B); Figure 2(b)")
_dist("add_mul_self", Add(A, Mul(A, B)), Mul(A, Add(B, Fill(1))), source=TABLE4,
      note="A + A⊙B → A⊙(B + 1): no fewer FLOPs, A is read once (free when B is constant)")
_dist("square_sub_factor", Sub(Mul(X, X), Mul(X, C)), Mul(X, Sub(X, C)), source=TABLE4,
      note="Square(A+B) − (A+B)⊙C → (A+B)⊙(A+B−C), for any X = A+B")
_dist("pow_square_sub_factor", Sub(Pow(X, Fill(2)), Mul(X, C)), Mul(X, Sub(X, C)),
      source=TABLE4, note="the same row with Square written as Pow(X, 2)")

# --- common factors ----------------------------------------------------------------------------

_dist("factor_mul_sub", Sub(Mul(A, B), Mul(A, C)), Mul(A, Sub(B, C)))
_dist("factor_div_add", Add(Div(A, C), Div(B, C)), Div(Add(A, B), C),
      example={"domain": {"C": "away"}})
_dist("factor_div_sub", Sub(Div(A, C), Div(B, C)), Div(Sub(A, B), C),
      example={"domain": {"C": "away"}})
_dist("sub_mul_self", Sub(A, Mul(A, B)), Mul(A, Sub(Fill(1), B)))
_dist("mul_self_sub", Sub(Mul(A, B), A), Mul(A, Sub(B, Fill(1))))
_dist("add_self", Add(A, A), Mul(A, Fill(2)), note="A + A → 2⊙A: A read once")
_dist("exp_product", Mul(Exp(A), Exp(B)), Exp(Add(A, B)), note="e^A⊙e^B = e^(A+B)")
_dist("exp_quotient", Div(Exp(A), Exp(B)), Exp(Sub(A, B)))
_dist("log_sum", Add(Log(A), Log(B)), Log(Mul(A, B)),
      example={"domain": {"A": "pos", "B": "pos"}}, note="for A, B > 0")
_dist("log_difference", Sub(Log(A), Log(B)), Log(Div(A, B)),
      example={"domain": {"A": "pos", "B": "pos"}}, note="for A, B > 0")

_SAME_BC = f.same_shape("B", "C")
_dist("factor_matmul_left", Add(MatMul(A, B), MatMul(A, C)), MatMul(A, Add(B, C)),
      guard=_SAME_BC, example={"family": "matmul_factor"})
_dist("factor_matmul_right", Add(MatMul(B, A), MatMul(C, A)), MatMul(Add(B, C), A),
      guard=_SAME_BC, example={"family": "matmul_factor"})
_dist("factor_matmul_left_sub", Sub(MatMul(A, B), MatMul(A, C)), MatMul(A, Sub(B, C)),
      guard=_SAME_BC, example={"family": "matmul_factor"})
_dist("factor_matmul_right_sub", Sub(MatMul(B, A), MatMul(C, A)), MatMul(Sub(B, C), A),
      guard=_SAME_BC, example={"family": "matmul_factor"})
_dist("factor_conv_weights", Add(Conv(X, W1, name="k1"), Conv(X, W2, name="k2")),
      Conv(X, Add(W1, W2), like="k1"),
      guard=f.all_of(f.same_shape("W1", "W2"), f.same_attrs("k1", "k2")),
      example={"family": "conv_pair"})
_dist("factor_conv_weights_bias", Add(Conv(X, W1, b1, name="k1"), Conv(X, W2, b2, name="k2")),
      Conv(X, Add(W1, W2), Add(b1, b2), like="k1"),
      guard=f.all_of(f.same_shape("W1", "W2"), f.same_attrs("k1", "k2")),
      example={"family": "conv_pair"})
_dist("factor_conv_inputs", Add(Conv(X1, W1, name="k1"), Conv(X2, W1, name="k2")),
      Conv(Add(X1, X2), W1, like="k1"),
      guard=f.all_of(f.same_shape("X1", "X2"), f.same_attrs("k1", "k2")),
      example={"family": "conv_pair"})

# --- a scale or shift into the weights and bias of a contraction ------------------------------

_dist("matmul_bias_scale_fold", Mul(Add(MatMul(X, Wc, name="mm"), b), c),
      Add(MatMul(X, Mul(Wc, K(f.last_vector("c"), "vector(c)"))), Mul(b, c)),
      guard=f.all_of(lambda m: m.rank("W") == 2, f.along_last("c", "mm")),
      example={"family": "matmul_bias"},
      note="(X·W + b)⊙c → X·(W⊙c) + b⊙c, c per output column (MobileBERT's NoNorm)")


def _gemm_scaled(m):
    """Gemm(A, W⊙c', C⊙c): the products are ops on constants, folded when the rule applies."""
    vector = f.last_vector("c")(m)
    scale = vector[:, None] if m.attr("g", "transB") and vector.ndim else vector
    args = [Var("A"), Mul(Var("W"), K(lambda m_: scale.astype(m_.dtype("W")), "c"))]
    if m["C"] is not None:
        args.append(Mul(Var("C"), K(lambda m_: vector.astype(m_.dtype("C")), "vector(c)")))
    return Gemm(*args, like="g")


_dist("gemm_scale_fold", Mul(Gemm(A, Wc, Copt, name="g"), c), _gemm_scaled,
      guard=f.all_of(f.along_last("c", "g"), lambda m: m.rank("W") == 2),
      example={"family": "gemm"}, replacement_text="Gemm(A, W⊙c, C⊙c)",
      note="a per-column scale after a Gemm folds into its weight and bias")


def _conv_scaled(m):
    """Conv(X, W⊙c, b⊙c) with c per output channel (folded when the rule applies)."""
    scale = f.channel("c", m.rank("W"))(m)
    args = [Var("X"), Mul(Var("W"), K(lambda m_: scale.astype(m_.dtype("W")), "c"))]
    if m["b"] is not None:
        args.append(Mul(Var("b"), K(lambda m_: scale.reshape(-1).astype(m_.dtype("b")),
                                    "vector(c)")))
    return Conv(*args, like="conv")


def _conv_bias(m):
    channels = m.shape("W")[0]
    shift = np.broadcast_to(np.asarray(m.value("c")).reshape(-1), (channels,))
    old = m.value("b") if m["b"] is not None else np.zeros(channels, m.dtype("c"))
    return Conv(Var("X"), Var("W"), K(lambda m_: (old + shift).astype(m_.dtype("c")), "b + c"),
                like="conv")


_dist("conv_scale_fold", Mul(Conv(X, Wc, Var("b", "param"), name="conv"), c), _conv_scaled,
      guard=f.per_channel("c", "conv"), example={"family": "conv"},
      replacement_text="Conv(X, W⊙c, b⊙c)",
      note="a per-channel scale after a Conv folds into its weights and bias")
_dist("conv_add_bias", Add(Conv(X, Wc, Var("b", "param"), name="conv"), c), _conv_bias,
      guard=f.per_channel("c", "conv"), example={"family": "conv"},
      replacement_text="Conv(X, W, b + c)", note="a per-channel shift becomes the Conv's bias")
_dist("matmul_neg_weight", MatMul(Neg(X), Wc), MatMul(X, Neg(Wc)),
      example={"family": "matmul_scale"})
_dist("neg_matmul_weight", Neg(MatMul(X, Wc)), MatMul(X, Neg(Wc)),
      example={"family": "matmul_scale"})
_dist("mul_add_distribute", Mul(Add(X, c1), c2), Add(Mul(X, c2), Mul(c1, c2)), enabling=True,
      note="(X + c1)⊙c2 → X⊙c2 + c1⊙c2 where that lets the scale fold further")

# --- negation ----------------------------------------------------------------------------------

_dist("neg_add_neg", Add(Neg(A), Neg(B)), Neg(Add(A, B)))
_dist("neg_mul_neg", Mul(Neg(A), Neg(B)), Mul(A, B))
_dist("neg_div_neg", Div(Neg(A), Neg(B)), Div(A, B), example={"domain": {"B": "away"}})
_dist("neg_mul_const", Mul(Neg(X), c), Mul(X, Neg(c)))
_dist("neg_of_mul_const", Neg(Mul(X, c)), Mul(X, Neg(c)))
_dist("neg_of_div_const", Neg(Div(X, c)), Div(X, Neg(c)), guard=f.finite_nonzero("c"),
      example={"domain": {"c": "away"}})

# --- reductions: Σ(c⊙x) = c⊙Σx, max(x + c) = max(x) + c, ... -----------------------------------
# v must be constant along the reduced axes (extent 1 there) and not add dims to X.

_ALONG = f.constant_on("v", f.reduced_axes("r"), "X")
_RED = {"family": "reduce"}


def _reduced(text: str, transform=lambda data, m: data):
    make = f.reduced("v", "r", "X")
    return K(lambda m: np.asarray(transform(make(m), m)).astype(m.dtype("v")), text)


for _name, _reduce, _replacement, _guard in (
        ("reducesum_scale", ReduceSum, lambda: Mul(ReduceSum(X, ax, like="r"), _reduced("v")),
         _ALONG),
        ("reducemean_scale", ReduceMean, lambda: Mul(ReduceMean(X, ax, like="r"), _reduced("v")),
         _ALONG),
        ("reducemax_scale_positive", ReduceMax,
         lambda: Mul(ReduceMax(X, ax, like="r"), _reduced("v")), f.all_of(_ALONG, f.positive("v"))),
        ("reducemin_scale_positive", ReduceMin,
         lambda: Mul(ReduceMin(X, ax, like="r"), _reduced("v")), f.all_of(_ALONG, f.positive("v"))),
        ("reducemax_scale_negative", ReduceMax,
         lambda: Mul(ReduceMin(X, ax, like="r"), _reduced("v")), f.all_of(_ALONG, f.negative("v"))),
        ("reducemin_scale_negative", ReduceMin,
         lambda: Mul(ReduceMax(X, ax, like="r"), _reduced("v")), f.all_of(_ALONG, f.negative("v"))),
        ("reducel1_scale", ReduceL1,
         lambda: Mul(ReduceL1(X, ax, like="r"), _reduced("|v|", lambda d, m: np.abs(d))), _ALONG),
        ("reducel2_scale", ReduceL2,
         lambda: Mul(ReduceL2(X, ax, like="r"), _reduced("|v|", lambda d, m: np.abs(d))), _ALONG),
        ("reducesumsquare_scale", ReduceSumSquare,
         lambda: Mul(ReduceSumSquare(X, ax, like="r"), _reduced("v²", lambda d, m: d * d)),
         _ALONG),
):
    _dist(_name, _reduce(Mul(X, v), ax, name="r"), _replacement(), guard=_guard, example=_RED)

for _name, _reduce, _replacement in (
        ("reducemean_shift", ReduceMean, lambda: Add(ReduceMean(X, ax, like="r"), _reduced("v"))),
        ("reducemax_shift", ReduceMax, lambda: Add(ReduceMax(X, ax, like="r"), _reduced("v"))),
        ("reducemin_shift", ReduceMin, lambda: Add(ReduceMin(X, ax, like="r"), _reduced("v"))),
        ("reducelogsumexp_shift", ReduceLogSumExp,
         lambda: Add(ReduceLogSumExp(X, ax, like="r"), _reduced("v"))),
        ("reducesum_shift", ReduceSum,
         lambda: Add(ReduceSum(X, ax, like="r"),
                     _reduced("n⊙v", lambda d, m: d * f.reduced_count("r")(m)))),
):
    _dist(_name, _reduce(Add(X, v), ax, name="r"), _replacement(), guard=_ALONG, example=_RED)


LEGACY_SOFTMAX_UNTIL = 13  # opsets before it flatten the input to 2-D at `axis`


def _softmax_axis_constant(m) -> bool:
    """`v` is constant along every axis the softmax normalises over: its `axis`, or before opset
    13 (the input seen as 2-D) every axis from `axis` on."""
    rank = m.rank("X")
    if m.rank("v") > rank or rank == 0:
        return False
    axis = int(m.attr("sm", "axis")) % rank
    last = rank if m.work.opset and m.work.opset < LEGACY_SOFTMAX_UNTIL else axis + 1
    return all(d == 1 for d in m.aligned("v", rank)[axis:last])


_dist("softmax_shift", Softmax(Add(X, v), name="sm"), Softmax(X, like="sm"),
      guard=_softmax_axis_constant, example={"family": "softmax"},
      note="softmax is invariant to a shift constant along its axis")
_dist("logsoftmax_shift", LogSoftmax(Add(X, v), name="sm"), LogSoftmax(X, like="sm"),
      guard=_softmax_axis_constant, example={"family": "softmax"})
_dist("max_shift", Max(Add(A, c), Add(B, c)), Add(Max(A, B), c))
_dist("min_shift", Min(Add(A, c), Add(B, c)), Add(Min(A, B), c))
_dist("max_scale", Max(Mul(A, c), Mul(B, c)), Mul(Max(A, B), c), guard=f.positive("c"),
      example={"domain": {"c": "pos"}}, note="for c > 0")
_dist("min_scale", Min(Mul(A, c), Mul(B, c)), Mul(Min(A, B), c), guard=f.positive("c"),
      example={"domain": {"c": "pos"}}, note="for c > 0")
