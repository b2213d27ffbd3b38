"""Commutative rules: swap two ops so the expensive one runs on fewer elements (Table 4's third
block, Figure 2c). A reduction commutes with an op that maps equal elements to equal results in
the right way: ReduceSum with a left shift and with negation, ReduceProd(Exp) with Exp(ReduceSum),
ReduceMax/ReduceMin with every non-decreasing function; an elementwise op commutes with the
data-movement ops that replicate or permute its input (Expand, Gather, Transpose).

Operand-order commutativity (A⊙B = B⊙A, Table 4's third row) is built into matching: every
binary op that allows it matches in either order, so it needs no rule of its own.
"""
from __future__ import annotations

import numpy as np

from kiln.ops import COMMUTATIVE
from kiln.rewrite import facts as f
from kiln.rewrite.dsl import (FLOAT, NUMERIC, UNSIGNED, A, Abs, Add, B, BitShift, Cast, Exp,
                              Expand, Gather, I, K, MatMul, Mul, Neg, ReduceL1, ReduceL2,
                              ReduceMax, ReduceMin, ReduceProd, ReduceSum, ReduceSumSquare, T,
                              Transpose, X, ax, c, op, rule, s)

ArgMax, ArgMin, ReduceMean = op("ArgMax"), op("ArgMin"), op("ReduceMean")

TABLE4 = "Table 4"


def _comm(name, pattern, replacement, **kw):
    return rule(name, COMMUTATIVE, pattern, replacement, **kw)


_RED = {"family": "reduce"}

# --- Table 4 -----------------------------------------------------------------------------------

_comm("reducesum_bitshift",
      ReduceSum(BitShift(A, c, direction="LEFT"), ax, name="r"),
      BitShift(ReduceSum(A, ax, like="r"),
               K(lambda m: f.reduced("c", "r", "A")(m).astype(m.dtype("c")), "c"),
               direction="LEFT"),
      guard=f.constant_on("c", f.reduced_axes("r"), "A"), dtypes=UNSIGNED, source=TABLE4,
      example={"family": "reduce"},
      note="left shifts only (a multiplication by 2^c, exact in unsigned arithmetic); a right "
           "shift drops different bits before and after summing")
_comm("reduceprod_exp", ReduceProd(Exp(A), ax, name="r"), Exp(ReduceSum(A, ax, like="r")),
      source=TABLE4, example=_RED, note="∏e^a = e^Σa")

# --- negation and absolute value ---------------------------------------------------------------

_comm("reducesum_neg", ReduceSum(Neg(A), ax, name="r"), Neg(ReduceSum(A, ax, like="r")),
      example=_RED)
_comm("reducemean_neg", ReduceMean(Neg(A), ax, name="r"),
      Neg(ReduceMean(A, ax, like="r")), example=_RED)
_comm("reducemax_neg", ReduceMax(Neg(A), ax, name="r"), Neg(ReduceMin(A, ax, like="r")),
      example=_RED, dtypes=FLOAT)
_comm("reducemin_neg", ReduceMin(Neg(A), ax, name="r"), Neg(ReduceMax(A, ax, like="r")),
      example=_RED, dtypes=FLOAT)
for _reduce in (ReduceL1, ReduceL2, ReduceSumSquare):
    _name = _reduce.__name__.lower()
    _comm(f"{_name}_neg", _reduce(Neg(A), ax, name="r"), _reduce(A, ax, like="r"), example=_RED,
          note="the norm ignores the sign")
    _comm(f"{_name}_abs", _reduce(Abs(A), ax, name="r"), _reduce(A, ax, like="r"), example=_RED,
          note="the norm ignores the sign")
_comm("reduceprod_abs", ReduceProd(Abs(A), ax, name="r"), Abs(ReduceProd(A, ax, like="r")),
      example=_RED)
_comm("reduceprod_neg", ReduceProd(Neg(A), ax, name="r"),
      Mul(ReduceProd(A, ax, like="r"),
          K(lambda m: np.asarray((-1.0) ** f.reduced_count("r")(m), m.dtype("A")), "(−1)^n")),
      example=_RED)

# --- ReduceMax/ReduceMin with a non-decreasing function: max f(a) = f(max a) ---------------------

_NON_NEGATIVE_ALPHA = lambda m: float(m.attr("f", "alpha")) >= 0  # noqa: E731
# (non-decreasing function, its guard, the domain its property test draws A from)
for _fname, _guard, _domain in (
        ("Exp", None, {}), ("Log", None, {"A": "pos"}), ("Sqrt", None, {"A": "pos"}),
        ("Sigmoid", None, {}), ("Tanh", None, {}), ("Relu", None, {}), ("Erf", None, {}),
        ("Softplus", None, {}), ("Atan", None, {}), ("Ceil", None, {}), ("Floor", None, {}),
        ("Round", None, {}), ("LeakyRelu", _NON_NEGATIVE_ALPHA, {})):
    _f = op(_fname)
    for _reduce in (ReduceMax, ReduceMin):
        _rname = _reduce.__name__.lower()
        _comm(f"{_rname}_{_fname.lower()}", _reduce(_f(A, name="f"), ax, name="r"),
              _f(_reduce(A, ax, like="r"), like="f"), guard=_guard,
              example={"family": "reduce", "domain": _domain},
              note=f"{_fname} is non-decreasing")


def _monotone_cast(m) -> bool:
    """Casts to a float type are non-decreasing (from any int or float type)."""
    target = m.dtype("r")
    return np.dtype(target).kind == "f" and np.dtype(m.dtype("A")).kind in "iuf"


for _reduce in (ReduceMax, ReduceMin):
    _rname = _reduce.__name__.lower()
    _comm(f"{_rname}_cast", _reduce(Cast(A, name="f"), ax, name="r"),
          Cast(_reduce(A, ax, like="r"), like="f"), guard=_monotone_cast, dtypes=None,
          example={"family": "reduce_cast"}, note="casting to a float type is non-decreasing")

_FLOAT_A = lambda m: m.dtype("A") in FLOAT  # noqa: E731
_comm("argmax_neg", ArgMax(Neg(A), name="r"), ArgMin(A, like="r"), guard=_FLOAT_A,
      dtypes=None, example={"family": "argmax"},
      note="the first largest −a is the first smallest a; only negation is exact: a rounding "
           "function could merge distinct values")
_comm("argmin_neg", ArgMin(Neg(A), name="r"), ArgMax(A, like="r"), guard=_FLOAT_A,
      dtypes=None, example={"family": "argmax"})

# --- elementwise ops before replication: compute once per source element -------------------------

# (elementwise function, the domain its property test draws X from)
for _fname, _domain in (("Exp", {}), ("Log", {"X": "pos"}), ("Sqrt", {"X": "pos"}), ("Neg", {}),
                        ("Abs", {}), ("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("Erf", {}),
                        ("Reciprocal", {"X": "away"})):
    _f = op(_fname)
    _comm(f"{_fname.lower()}_expand", _f(Expand(X, s), name="f"), Expand(_f(X, like="f"), s),
          example={"family": "expand", "domain": _domain})
_comm("cast_expand", Cast(Expand(X, s), name="f"), Expand(Cast(X, like="f"), s), dtypes=None,
      example={"family": "expand"})
_comm("expand_scale", Mul(Expand(X, s), c), Expand(Mul(X, c), s), guard=f.scalar("c"),
      example={"family": "expand"})
_comm("expand_shift", Add(Expand(X, s), c), Expand(Add(X, c), s), guard=f.scalar("c"),
      example={"family": "expand"})


def _gather_row_constant(m) -> bool:
    """c is a scalar, or varies only along the last axis of rows gathered along axis 0."""
    if m.scalar("c") is not None:
        return True
    return int(m.attr("gt", "axis")) == 0 and m.rank("T") >= 2 and f.along_last("c", "gt")(m)


_GATHERED = K(lambda m: f.last_vector("c")(m), "vector(c)")
_comm("gather_scale", Mul(Gather(T, I, name="gt"), c), Gather(Mul(T, _GATHERED), I, like="gt"),
      guard=_gather_row_constant, example={"family": "gather"},
      note="scale the table once instead of every gathered row (the table folds)")
_comm("gather_shift", Add(Gather(T, I, name="gt"), c), Gather(Add(T, _GATHERED), I, like="gt"),
      guard=_gather_row_constant, example={"family": "gather"})

# --- elementwise ops and permutations -------------------------------------------------------------

_SAME_PERM = f.all_of(f.same_attrs("t1", "t2"), f.same_shape("A", "B"))
for _fname in ("Add", "Sub", "Mul", "Div"):
    _f = op(_fname)
    _comm(f"transpose_{_fname.lower()}", _f(Transpose(A, name="t1"), Transpose(B, name="t2")),
          Transpose(_f(A, B), like="t1"), guard=_SAME_PERM, dtypes=NUMERIC,
          example={"family": "transpose_pair",
                   "domain": {"B": "away"} if _fname == "Div" else {}},
          note="one transpose of the result instead of one per operand")


_comm("transpose_scale_inward", Mul(Transpose(X, name="t"), c), Transpose(Mul(X, c), like="t"),
      guard=f.scalar("c"), enabling=True, example={"family": "move_scale"},
      note="a scale moves before a transpose, toward a weight it can fold into")
_comm("reshape_scale_inward", Mul(op("Reshape")(X, s, name="r"), c),
      op("Reshape")(Mul(X, c), s, like="r"), guard=f.scalar("c"), enabling=True,
      example={"family": "move_scale"},
      note="a scale moves before a reshape, toward a weight it can fold into")


def _perm(m) -> list[int]:
    node = m.op("t")
    rank = m.rank("A")
    return list(node.attrs.get("perm") or reversed(range(rank)))


def _source_axes(m) -> np.ndarray:
    perm = _perm(m)
    return np.asarray(sorted(perm[a] for a in m.axes("r")), dtype=np.int64)


def _result_perm(m) -> list[int]:
    perm = _perm(m)
    if m.attr("r", "keepdims"):
        return perm
    reduced = set(m.axes("r"))
    kept = [perm[i] for i in range(len(perm)) if i not in reduced]
    order = sorted(kept)
    return [order.index(a) for a in kept]


for _reduce in (ReduceSum, ReduceMean, ReduceMax, ReduceMin):
    _rname = _reduce.__name__.lower()
    _comm(f"{_rname}_transpose", _reduce(Transpose(A, name="t"), ax, name="r"),
          Transpose(_reduce(A, K(_source_axes, "perm[axes]"), like="r"), perm=_result_perm),
          guard=lambda m: m.axes("r") is not None,
          dtypes=FLOAT if _rname in ("reducesum", "reducemean") else NUMERIC,
          example={"family": "reduce_transpose"},
          note="reduce first, then permute the (smaller) result")


def _swaps_last_two(m) -> bool:
    rank = m.rank("A")
    if rank < 2 or m.rank("B") != rank or m.shape("A")[:-2] != m.shape("B")[:-2]:
        return False
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    return all(list(m.op(t).attrs.get("perm") or reversed(range(rank))) == swap
               for t in ("t1", "t2"))


_comm("matmul_transposed_operands", MatMul(Transpose(A, name="t1"), Transpose(B, name="t2")),
      Transpose(MatMul(B, A), perm=lambda m: list(range(m.rank("A") - 2)) +
                [m.rank("A") - 1, m.rank("A") - 2]),
      guard=_swaps_last_two, example={"family": "matmul_transposes"},
      note="Aᵀ·Bᵀ = (B·A)ᵀ: one transpose instead of two")
