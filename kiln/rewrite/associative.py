"""Associative rules: regroup a chain of one operation so constants meet and fold, repeated
operands combine, and the cheaper grouping of a product runs (Table 4's first block, Figure 2a).

Floating-point only: regrouping rounds differently (within the tolerance), and integer products
or sums may overflow in one grouping and not in the other.
"""
from __future__ import annotations

from kiln.ops import ASSOCIATIVE
from kiln.rewrite import facts as f
from kiln.rewrite.dsl import (BOOL, INTEGER, NUMERIC, A, Abs, Add, And, B, C, Conv, Copt, Div, Fill,
                              Gemm, K, MatMul, Max, Min, Mul, Or, Pow, Recip, ReduceSum, Sqrt,
                              Square, Sub, Var, W1c, W2c, Wc, X, Xor, Y, ax, bopt, c, c1, c2, op,
                              rule)

TABLE4 = "Table 4"


def _assoc(name, pattern, replacement, **kw):
    return rule(name, ASSOCIATIVE, pattern, replacement, **kw)


# --- Table 4 -----------------------------------------------------------------------------------

_assoc("recip_mul_recip", Mul(Recip(A), Recip(Mul(A, B))), Mul(Square(Recip(A)), Recip(B)),
       source=TABLE4, example={"domain": {"A": "away", "B": "away"}},
       note="Table 4's form: same FLOPs there, A loaded once; see recip_mul_recip_merged")
_assoc("recip_mul_recip_merged", Mul(Recip(A), Recip(Mul(A, B))), Recip(Mul(Square(A), B)),
       source="Figure 2", example={"domain": {"A": "away", "B": "away"}},
       note="Figure 2(a)'s form of the row, ((A⊙B)² ⊙ C)⁻¹: one reciprocal instead of two "
            "(Reciprocal costs 4 FLOPs in Kiln's table)")
_assoc("sqrt_mul_sqrt", Mul(Mul(A, Sqrt(B)), Mul(Sqrt(B), C)), Mul(Mul(A, B), C),
       source=TABLE4, example={"domain": {"B": "pos"}}, note="√B·√B = B for B ≥ 0")
_assoc("abs_mul_abs", Mul(Mul(Abs(A), B), Abs(C)), Mul(Abs(Mul(A, C)), B), source=TABLE4,
       note="the commutative swap of B and Abs(C) (Table 4's footnote) is part of matching")
_assoc("reducesum_mul_square",
       Mul(Mul(A, ReduceSum(B, ax, name="r")), Mul(Var("r"), C)),
       Mul(Mul(A, Square(Var("r"))), C), source=TABLE4,
       example={"family": "reduce_broadcast"})
_assoc("mul_shared_factor", Mul(Mul(A, X), Mul(X, C)), Mul(Mul(A, C), Square(X)),
       note="Table 4's ReduceSum row for any shared factor: pays off when X is broadcast")

# --- constants meet and fold -------------------------------------------------------------------

_assoc("mul_const_const", Mul(Mul(X, c1), c2), Mul(X, Mul(c1, c2)))
_assoc("add_const_const", Add(Add(X, c1), c2), Add(X, Add(c1, c2)))
_assoc("sub_const_const", Sub(Sub(X, c1), c2), Sub(X, Add(c1, c2)))
_assoc("add_sub_const", Sub(Add(X, c1), c2), Add(X, Sub(c1, c2)))
_assoc("sub_add_const", Add(Sub(X, c1), c2), Add(X, Sub(c2, c1)))
_assoc("rsub_add_const", Add(Sub(c1, X), c2), Sub(Add(c1, c2), X))
_assoc("rsub_sub_const", Sub(Sub(c1, X), c2), Sub(Sub(c1, c2), X))
_assoc("const_sub_rsub", Sub(c2, Sub(c1, X)), Add(X, Sub(c2, c1)))
_assoc("const_sub_add", Sub(c2, Add(X, c1)), Sub(Sub(c2, c1), X))
_assoc("const_sub_sub", Sub(c2, Sub(X, c1)), Sub(Add(c2, c1), X))

_DIV = {"domain": {"c1": "away", "c2": "away", "X": "away"}}
_NONZERO = f.finite_nonzero("c1", "c2")
_assoc("mul_div_const", Div(Mul(X, c1), c2), Mul(X, Div(c1, c2)), guard=_NONZERO, example=_DIV)
_assoc("div_mul_const", Mul(Div(X, c1), c2), Mul(X, Div(c2, c1)), guard=_NONZERO, example=_DIV)
_assoc("div_div_const", Div(Div(X, c1), c2), Mul(X, Recip(Mul(c1, c2))), guard=_NONZERO,
       example=_DIV)
_assoc("rdiv_mul_const", Mul(Div(c1, X), c2), Div(Mul(c1, c2), X), guard=_NONZERO, example=_DIV)
_assoc("rdiv_div_const", Div(Div(c1, X), c2), Div(Div(c1, c2), X), guard=_NONZERO, example=_DIV)
_assoc("const_div_mul", Div(c2, Mul(X, c1)), Div(Div(c2, c1), X), guard=_NONZERO, example=_DIV)
_assoc("const_div_div", Div(c2, Div(X, c1)), Div(Mul(c2, c1), X), guard=_NONZERO, example=_DIV)
_assoc("const_div_rdiv", Div(c2, Div(c1, X)), Mul(X, Div(c2, c1)), guard=_NONZERO, example=_DIV)

_assoc("mul_const_hoist", Mul(Mul(Mul(X, c1), Y), c2), Mul(Mul(X, Y), Mul(c1, c2)),
       note="constants separated by another factor")
_assoc("add_const_hoist", Add(Add(Add(X, c1), Y), c2), Add(Add(X, Y), Add(c1, c2)))
_assoc("mul_const_pair", Mul(Mul(X, c1), Mul(Y, c2)), Mul(Mul(X, Y), Mul(c1, c2)))
_assoc("add_const_pair", Add(Add(X, c1), Add(Y, c2)), Add(Add(X, Y), Add(c1, c2)))

# Exact for every dtype: max/min and the logical and bitwise ops neither round nor overflow.
_assoc("max_const_const", Max(Max(X, c1), c2), Max(X, Max(c1, c2)), dtypes=NUMERIC)
_assoc("min_const_const", Min(Min(X, c1), c2), Min(X, Min(c1, c2)), dtypes=NUMERIC)
_assoc("and_const_const", And(And(X, c1), c2), And(X, And(c1, c2)), dtypes=BOOL)
_assoc("or_const_const", Or(Or(X, c1), c2), Or(X, Or(c1, c2)), dtypes=BOOL)
_assoc("xor_const_const", Xor(Xor(X, c1), c2), Xor(X, Xor(c1, c2)), dtypes=BOOL)
for _name in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
    _op = op(_name)
    _assoc(f"{_name[7:].lower()}_bits_const_const", _op(_op(X, c1), c2), _op(X, _op(c1, c2)),
           dtypes=INTEGER)

# --- repeated unary operands combine ----------------------------------------------------------

_assoc("recip_product", Mul(Recip(A), Recip(B)), Recip(Mul(A, B)),
       example={"domain": {"A": "away", "B": "away"}})
_assoc("sqrt_product", Mul(Sqrt(A), Sqrt(B)), Sqrt(Mul(A, B)),
       example={"domain": {"A": "pos", "B": "pos"}}, note="for A, B ≥ 0")
_assoc("sqrt_quotient", Div(Sqrt(A), Sqrt(B)), Sqrt(Div(A, B)),
       example={"domain": {"A": "pos", "B": "pos"}}, note="for A ≥ 0, B > 0")
_assoc("abs_product", Mul(Abs(A), Abs(B)), Abs(Mul(A, B)))
_assoc("abs_quotient", Div(Abs(A), Abs(B)), Abs(Div(A, B)), example={"domain": {"B": "away"}})

_INT_EXP = {"domain": {"X": "pos"}, "family": "pow"}
_assoc("pow_product", Mul(Pow(X, c1), Pow(X, c2)), Pow(X, Add(c1, c2)),
       guard=f.integer_scalar("c1", "c2"), example=_INT_EXP, note="integer exponents")
_assoc("pow_mul_self", Mul(X, Pow(X, c)), Pow(X, Add(c, Fill(1))),
       guard=f.integer_scalar("c"), example=_INT_EXP, note="integer exponent")
_assoc("pow_pow", Pow(Pow(X, c1), c2), Pow(X, Mul(c1, c2)),
       guard=f.integer_scalar("c1", "c2"), example=_INT_EXP, note="integer exponents")
_assoc("pow_quotient", Div(Pow(X, c1), Pow(X, c2)), Pow(X, Sub(c1, c2)),
       guard=f.integer_scalar("c1", "c2"), example=_INT_EXP, note="integer exponents")

# --- products with a contraction -----------------------------------------------------------------
# (X·W)·c = X·(W·c): a scale varying along the output's columns folds into the weight's columns;
# (X·c)·W = X·(c·W): one varying along X's rows of K folds into the weight's rows.

_2D = lambda name: (lambda m: m.rank(name) == 2)  # noqa: E731

_assoc("matmul_const_chain", MatMul(MatMul(X, W1c), W2c), MatMul(X, MatMul(W1c, W2c)),
       guard=f.all_of(_2D("W1"), _2D("W2")), example={"family": "matmul_chain"},
       note="pays off when the inner width is large")
_assoc("matmul_scale_columns", Mul(MatMul(X, Wc, name="mm"), c),
       MatMul(X, Mul(Wc, K(f.last_vector("c"), "vector(c)"))),
       guard=f.all_of(_2D("W"), f.along_last("c", "mm")), example={"family": "matmul_scale"})
_assoc("matmul_scale_rows", MatMul(Mul(X, c), Wc),
       MatMul(X, Mul(K(f.column("c"), "column(c)"), Wc)),
       guard=f.all_of(_2D("W"), f.along_last("c", "X")), example={"family": "matmul_scale"})
_assoc("matmul_scale_to_left", Mul(MatMul(A, B), c), MatMul(Mul(A, c), B),
       guard=f.scalar("c"), example={"family": "matmul_pair"},
       note="pays off when A is smaller than the product (attention scores: S×d vs S×S)")
_assoc("matmul_scale_to_right", Mul(MatMul(A, B), c), MatMul(A, Mul(B, c)),
       guard=f.scalar("c"), example={"family": "matmul_pair"})
_assoc("matmul_scale_out_of_left", MatMul(Mul(A, c), B), Mul(MatMul(A, B), c),
       guard=f.scalar("c"), example={"family": "matmul_pair"},
       note="pays off when the product is smaller than A")
_assoc("matmul_scale_out_of_right", MatMul(A, Mul(B, c)), Mul(MatMul(A, B), c),
       guard=f.scalar("c"), example={"family": "matmul_pair"})
_assoc("gemm_scale_alpha", Mul(Gemm(A, B, name="g"), c), Gemm(A, B, like="g",
                                                              alpha=lambda m: _alpha(m)),
       guard=f.all_of(f.scalar("c"), f.finite("c")), example={"family": "gemm"},
       note="a scalar after a Gemm without bias becomes its alpha")
_assoc("gemm_bias_scale_alpha", Mul(Gemm(A, B, C, name="g"), c),
       Gemm(A, B, C, like="g", alpha=lambda m: _alpha(m), beta=lambda m: _beta(m)),
       guard=f.all_of(f.scalar("c"), f.finite("c")), example={"family": "gemm"})
_assoc("gemm_scale_in_alpha", Gemm(Mul(A, c), B, Copt, name="g"),
       Gemm(A, B, Copt, like="g", alpha=lambda m: _alpha(m)),
       guard=f.all_of(f.scalar("c"), f.finite("c")), example={"family": "gemm"})
_assoc("conv_scale_input", Conv(Mul(X, c), Wc, bopt, name="conv"),
       Conv(X, Mul(Wc, c), bopt, like="conv"), guard=f.scalar("c"), example={"family": "conv"},
       note="zero padding stays zero under scaling")


def _alpha(m) -> float:
    return float(m.attr("g", "alpha")) * m.scalar("c")


def _beta(m) -> float:
    return float(m.attr("g", "beta")) * m.scalar("c")

