"""Simplify: the algebraic clean-ups real exports need so that fusion finds more.

Identities (x·1, x+0, x/1, double negation), strength reduction (division by a constant into a
multiplication, Pow(x, 2) into x·x, Pow(x, 0.5) into Sqrt), data-movement chains (Transpose of a
Transpose, Reshape chains, a Reshape/Transpose pair that keeps the element order), casts that do
nothing, folding BatchNormalization into the Conv/Gemm before it and constant scales and shifts
into a Gemm, Sub/Neg normalization where it enables another rule, reductions that have an ONNX op
of their own, and the decomposed LayerNormalization and GELU that exporters emit.

These rules are local to a few ops and may involve ops without math properties, so they are not
confined to a partition.
"""
from __future__ import annotations

import math

import numpy as np

from kiln.rewrite import facts as f
from kiln.rewrite.dsl import (FLOAT32, NUMERIC, SIMPLIFY, Node, A, Abs, Add, B, Cast, Div, Erf,
                              Expand, Fill, Gemm, Identity, K, Log, MatMul, Mul, Neg, Pow,
                              Recip, ReduceSum, ReduceSumSquare, Relu, Sqrt, Square, Sub, Tanh,
                              Var, W1, Wc, X, alt, ax, c, one_of, op, rule, s, s1, s2)

EXPORTS = "export clean-up"
MOVES = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze")
REORGANIZE = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _simp(name, pattern, replacement, **kw):
    kw.setdefault("source", EXPORTS)
    return rule(name, SIMPLIFY, pattern, replacement, **kw)


# --- identities ----------------------------------------------------------------------------------
# Exact for every dtype; the engine refuses them where the constant would broadcast X.

_simp("mul_one", Mul(X, Fill(1)), X, dtypes=NUMERIC)
_simp("add_zero", Add(X, Fill(0)), X, dtypes=NUMERIC)
_simp("sub_zero", Sub(X, Fill(0)), X, dtypes=NUMERIC)
_simp("div_one", Div(X, Fill(1)), X, dtypes=NUMERIC)
_simp("pow_one", Pow(X, Fill(1)), X)
_simp("pow_zero", Pow(X, Fill(0)), K(lambda m: np.ones(m.out.shape, m.out.dtype), "ones"),
      note="x^0 = 1 for every x, 0 and NaN included")
_simp("neg_neg", Neg(Neg(X)), X, dtypes=NUMERIC)
_simp("recip_recip", Recip(Recip(X)), X, example={"domain": {"X": "away"}})
_simp("identity", Identity(X), X, dtypes=None)
_simp("idempotent_binary", one_of("Max", "Min", "And", "Or")(X, X), X, dtypes=None,
      note="max(x, x) = min(x, x) = x and x = x or x = x")
_simp("where_same", op("Where")(Var("cond", "index"), X, X), X, dtypes=None,
      example={"family": "where"})
for _fname in ("Abs", "Relu", "Ceil", "Floor", "Round", "Sign"):
    _f = op(_fname)
    _simp(f"{_fname.lower()}_idempotent", _f(_f(X)), _f(X), note=f"{_fname} of {_fname}")
_simp("abs_neg", Abs(Neg(X)), Abs(X))
_simp("relu_abs", Relu(Abs(X)), Abs(X))
_simp("abs_relu", Abs(Relu(X)), Relu(X))

# --- strength reduction ---------------------------------------------------------------------------

_simp("div_const_to_mul", Div(X, c), Mul(X, Recip(c)), guard=f.finite_nonzero("c"),
      example={"domain": {"c": "away"}},
      note="floating-point only: integer division truncates")
_simp("div_to_mul_recip", Div(X, B), Mul(X, Recip(B)), example={"domain": {"B": "away"}},
      note="x / y → x · (1/y): pays off when y is broadcast (LayerNorm's division by the std)")
_simp("recip_mul_to_div", Mul(X, Recip(B)), Div(X, B), example={"domain": {"B": "away"}},
      note="the other direction, when y is not broadcast")
_simp("pow_two", Pow(X, Fill(2)), Square(X))
_simp("pow_three", Pow(X, Fill(3)), Mul(Square(X), X))
_SQ = Square(X)
_simp("pow_four", Pow(X, Fill(4)), Mul(_SQ, _SQ))
_simp("pow_half", Pow(X, Fill(0.5)), Sqrt(X), example={"domain": {"X": "pos"}})
_simp("pow_minus_one", Pow(X, Fill(-1)), Recip(X), example={"domain": {"X": "away"}})
_simp("pow_minus_half", Pow(X, Fill(-0.5)), Recip(Sqrt(X)), example={"domain": {"X": "pos"}})
_simp("pow_minus_two", Pow(X, Fill(-2)), Recip(Square(X)), example={"domain": {"X": "away"}})
_simp("sqrt_square", Sqrt(Mul(X, X)), Abs(X), note="√(x²) = |x|")
_simp("reducesum_square", ReduceSum(alt(Mul(X, X), Pow(X, Fill(2))), ax, name="r"),
      ReduceSumSquare(X, ax, like="r"), example={"family": "reduce"})
_simp("reducesum_abs", ReduceSum(Abs(X), ax, name="r"), op("ReduceL1")(X, ax, like="r"),
      example={"family": "reduce"})
_simp("sqrt_reducesumsquare", Sqrt(ReduceSumSquare(X, ax, name="r")),
      op("ReduceL2")(X, ax, like="r"), example={"family": "reduce"})
_simp("log_reducesum", Log(ReduceSum(X, ax, name="r")), op("ReduceLogSum")(X, ax, like="r"),
      example={"family": "reduce", "domain": {"X": "pos"}})
_simp("log_reducesum_exp", Log(ReduceSum(op("Exp")(X), ax, name="r")),
      op("ReduceLogSumExp")(X, ax, like="r"), example={"family": "reduce"})

# --- Sub/Neg normalization ------------------------------------------------------------------------

_simp("sub_neg", Sub(A, Neg(B)), Add(A, B))
_simp("add_neg", Add(A, Neg(B)), Sub(A, B))
_simp("neg_sub", Neg(Sub(A, B)), Sub(B, A))
_simp("sub_const_to_add", Sub(X, c), Add(X, Neg(c)), enabling=True,
      note="x − c → x + (−c) where an Add-only rule then applies")
_simp("neg_mul_outward", Mul(Neg(A), B), Neg(Mul(A, B)), enabling=True,
      note="move a negation outward where it then cancels")

# --- casts ----------------------------------------------------------------------------------------

_simp("cast_identity", Cast(X, name="k"), X, dtypes=None,
      guard=lambda m: m.dtype("X") == m.dtype("k"), example={"family": "cast"})


def _lossless_first(m) -> bool:
    return np.can_cast(np.dtype(m.dtype("X")), np.dtype(m.dtype("k1")), "safe")


_simp("cast_cast", Cast(Cast(X, name="k1"), name="k2"),
      lambda m: X if m.dtype("X") == m.dtype("k2") else Cast(X, like="k2"),
      guard=_lossless_first, dtypes=None, replacement_text="Cast(X) (or X)",
      example={"family": "cast"},
      note="when the first cast is lossless, only the second matters")

# --- data movement --------------------------------------------------------------------------------


def _order_preserved(m) -> bool:
    """The chain of Transpose/Reshape-like ops keeps the elements in row-major order."""
    index = np.arange(m.numel("X")).reshape(m.shape("X"))
    for node in sorted(m.ops, key=lambda o: m.work.key[o.id]):
        out = m.work.tensors[node.outputs[0]].shape
        if node.op_type == "Transpose":
            index = np.transpose(index, node.attrs.get("perm") or None)
        else:
            index = index.reshape(out)
    return bool(np.array_equal(index.reshape(-1), np.arange(index.size)))


def _reshape_to_out(m):
    if m.out.shape == m.shape("X"):
        return X
    return op("Reshape")(X, K(lambda m_: np.asarray(m_.out.shape, np.int64), "shape"))


def _compose(m):
    rank = m.rank("X")
    inner = m.op("t1").attrs.get("perm") or list(reversed(range(rank)))
    outer = m.op("t2").attrs.get("perm") or list(reversed(range(rank)))
    perm = [inner[p] for p in outer]
    return X if perm == list(range(rank)) else op("Transpose")(X, perm=perm)


_Transpose = op("Transpose")
_simp("transpose_transpose", _Transpose(_Transpose(X, name="t1"), name="t2"), _compose,
      dtypes=None, replacement_text="Transpose(X, perm1∘perm2) (or X)",
      example={"family": "transpose_chain"})
_simp("transpose_identity", _Transpose(X, name="t"), X, dtypes=None,
      guard=lambda m: list(m.op("t").attrs.get("perm") or []) == list(range(m.rank("X"))),
      example={"family": "transpose_chain"})
_simp("reshape_chain", one_of(*REORGANIZE)(one_of(*REORGANIZE)(X, s1), s2), _reshape_to_out,
      dtypes=None, replacement_text="Reshape(X, shape) (or X)", example={"family": "reorganize"},
      note="two Reshape/Flatten/Squeeze/Unsqueeze in a row are one Reshape")
_simp("reshape_identity", one_of(*REORGANIZE)(X, s), X, dtypes=None,
      guard=lambda m: m.out.shape == m.shape("X"), example={"family": "reorganize"})
_simp("expand_identity", Expand(X, s), X, dtypes=None,
      guard=lambda m: m.out.shape == m.shape("X"), example={"family": "expand_same"})
_simp("movement_pair_to_reshape", one_of(*MOVES)(one_of(*MOVES)(X, s1), s2), _reshape_to_out,
      guard=f.all_of(lambda m: any(o.op_type == "Transpose" for o in m.ops), _order_preserved),
      dtypes=None, replacement_text="Reshape(X, shape) (or X)", example={"family": "movement"},
      note="a Reshape/Transpose pair that keeps the element order (it cancels) is one Reshape")
_simp("movement_triple_to_reshape",
      one_of(*MOVES)(one_of(*MOVES)(one_of(*MOVES)(X, s), s1), s2), _reshape_to_out,
      guard=f.all_of(lambda m: any(o.op_type == "Transpose" for o in m.ops), _order_preserved),
      dtypes=None, replacement_text="Reshape(X, shape) (or X)", example={"family": "movement"},
      note="e.g. split heads, transpose, transpose back and merge: one Reshape")


def _expand_subsumed(m) -> bool:
    """Broadcasting X itself gives the same shape: the Expand only materializes a broadcast."""
    return tuple(np.broadcast_shapes(m.shape("X"), m.shape("Y"))) == m.out.shape


_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "And", "Or", "Xor", "Equal")


def _without_expand(m):
    """The matched op with the Expand's output replaced by the Expand's input."""
    node = m.op("e")
    args = [X if t == m["x_expanded"] else Var("Y") for t in node.inputs]
    return op(node.op_type)(*args, like="e")


_simp("expand_into_broadcast",
      Node(_BROADCASTING, (Expand(X, s, name="x_expanded"), Var("Y")), name="e", any_order=True),
      _without_expand, guard=_expand_subsumed, dtypes=None, replacement_text="op(X, Y)",
      example={"family": "expand_broadcast", "domain": {"X": "pos", "Y": "pos"}},
      note="an Expand feeding a broadcasting op (in either operand) is done by the broadcast")

# --- clipping -------------------------------------------------------------------------------------

Clip = op("Clip")
_LO, _HI = Var("lo", "const"), Var("hi", "const")
_LO2, _HI2 = Var("lo2", "const"), Var("hi2", "const")


def _bounds(m, lo: str, hi: str) -> tuple[float, float] | None:
    low, high = m.scalar(lo), m.scalar(hi)
    return None if low is None or high is None else (low, high)


def _clip_clip_ok(m) -> bool:
    inner, outer = _bounds(m, "lo", "hi"), _bounds(m, "lo2", "hi2")
    return (inner is not None and outer is not None
            and max(inner[0], outer[0]) <= min(inner[1], outer[1]))


def _scalar_like(m, name: str, value: float) -> np.ndarray:
    return np.asarray(value, dtype=m.dtype(name))


_simp("clip_clip", Clip(Clip(X, _LO, _HI), _LO2, _HI2),
      Clip(X, K(lambda m: _scalar_like(m, "lo", max(m.scalar("lo"), m.scalar("lo2"))), "max(lo)"),
           K(lambda m: _scalar_like(m, "hi", min(m.scalar("hi"), m.scalar("hi2"))), "min(hi)")),
      guard=_clip_clip_ok, example={"family": "clip"}, note="nested ranges intersect")
_simp("relu_clip", Relu(Clip(X, _LO, _HI)),
      Clip(X, K(lambda m: _scalar_like(m, "lo", max(m.scalar("lo"), 0.0)), "max(lo, 0)"), _HI),
      guard=lambda m: (b := _bounds(m, "lo", "hi")) is not None and max(b[0], 0.0) <= b[1],
      example={"family": "clip"})
_simp("clip_relu", Clip(Relu(X), _LO, _HI),
      Clip(X, K(lambda m: _scalar_like(m, "lo", max(m.scalar("lo"), 0.0)), "max(lo, 0)"), _HI),
      guard=lambda m: (b := _bounds(m, "lo", "hi")) is not None and max(b[0], 0.0) <= b[1],
      example={"family": "clip"})

# --- folding into Conv / Gemm ---------------------------------------------------------------------
# BatchNormalization(y) = (y − mean)·scale/√(var + ε) + bias: a per-channel affine map.

BatchNormalization = op("BatchNormalization")
_BN = BatchNormalization(Var("Y"), Var("bs", "const"), Var("bb", "const"), Var("bm", "const"),
                         Var("bv", "const"), name="bn")


def _bn_affine(m) -> tuple[np.ndarray, np.ndarray]:
    eps = float(m.attr("bn", "epsilon"))
    scale = m.value("bs") / np.sqrt(m.value("bv") + eps)
    return scale, m.value("bb") - m.value("bm") * scale


def _inference_bn(m) -> bool:
    return not m.attr("bn", "training_mode", 0) and all(
        m.rank(n) == 1 for n in ("bs", "bb", "bm", "bv"))


def _bn_into_conv(m):
    scale, shift = _bn_affine(m)
    bias = shift + (m.value("b") * scale if m["b"] is not None else 0)
    dtype = m.dtype("W")
    column = scale.reshape((-1,) + (1,) * (m.rank("W") - 1)).astype(dtype)
    return op("Conv")(X, Mul(Wc, K(lambda _: column, "scale")),
                      K(lambda _: np.asarray(bias, dtype), "(b − mean)⊙scale + bias"), like="conv")


def _bn_into_gemm(m):
    scale, shift = _bn_affine(m)
    trans = m.attr("g", "transB")
    alpha, beta = float(m.attr("g", "alpha")), float(m.attr("g", "beta"))
    dtype = m.dtype("W")
    factor = ((scale[:, None] if trans else scale) * alpha).astype(dtype)
    bias = shift + (m.value("C") * beta * scale if m["C"] is not None else 0)
    if np.ndim(bias) <= 1:
        bias = np.broadcast_to(np.asarray(bias), (m.out.shape[1],))
    return Gemm(A, Mul(Wc, K(lambda _: factor, "alpha⊙scale")),
                K(lambda _: np.asarray(bias, dtype), "(C − mean)⊙scale + bias"),
                like="g", alpha=1.0, beta=1.0)


def _bn_as_affine(m):
    scale, shift = _bn_affine(m)
    rank, dtype = m.rank("Y"), m.dtype("Y")
    shape = (-1,) + (1,) * (rank - 2)
    return Add(Mul(Var("Y"), K(lambda _: scale.reshape(shape).astype(dtype), "scale")),
               K(lambda _: shift.reshape(shape).astype(dtype), "shift"))


_Conv = op("Conv")
_simp("batchnorm_into_conv",
      BatchNormalization(_Conv(X, Wc, Var("b", "param"), name="conv"), Var("bs", "const"),
                         Var("bb", "const"), Var("bm", "const"), Var("bv", "const"), name="bn"),
      _bn_into_conv, guard=_inference_bn, example={"family": "batchnorm_conv"},
      replacement_text="Conv(X, W⊙scale, (b − mean)⊙scale + bias)")
_simp("batchnorm_into_gemm",
      BatchNormalization(Gemm(A, Wc, Var("C", "param"), name="g"), Var("bs", "const"),
                         Var("bb", "const"), Var("bm", "const"), Var("bv", "const"), name="bn"),
      _bn_into_gemm, guard=_inference_bn, example={"family": "batchnorm_gemm"},
      replacement_text="Gemm(A, W⊙scale, (C − mean)⊙scale + bias)")
_simp("batchnorm_to_affine", _BN, _bn_as_affine,
      guard=f.all_of(_inference_bn, lambda m: m.rank("Y") >= 2), example={"family": "batchnorm"},
      replacement_text="Y⊙scale + shift", note="4 FLOPs per element become 2")


# A zero Pad of the spatial axes before a Conv (EfficientNet's stride-2 convs, TF "SAME" exports)
# is more of the Conv's own padding: the padded tensor is never written, whatever the partitioner.
_PAD = op("Pad")(X, Var("p", "param"), Var("v", "param"), Var("pax", "param"), name="pad")


def _pad_amounts(m) -> list[int]:
    return [int(v) for v in m.value("p").reshape(-1)]


def _pad_into_conv_ok(m) -> bool:
    rank = m.rank("X")
    if (m.attr("pad", "mode", "constant") != "constant" or m["p"] is None or m["pax"] is not None
            or m.attr("conv", "auto_pad", "NOTSET") not in ("NOTSET", "VALID") or rank < 3):
        return False
    if m["v"] is not None and m.value("v").reshape(-1)[:1].tolist() not in ([], [0]):
        return False
    pads = _pad_amounts(m)
    batch_and_channel = pads[:2] + pads[rank:rank + 2]
    return len(pads) == 2 * rank and not any(batch_and_channel) and min(pads) >= 0


def _conv_pads(m) -> list[int]:
    """The Conv's pads (none under auto_pad VALID) plus the Pad's spatial begins and ends."""
    rank, pads = m.rank("X"), _pad_amounts(m)
    extra = pads[2:rank] + pads[rank + 2:]
    explicit = m.attr("conv", "auto_pad", "NOTSET") == "NOTSET"
    own = (m.attr("conv", "pads") if explicit else None) or [0] * len(extra)
    return [int(a) + b for a, b in zip(own, extra)]


_simp("pad_into_conv", _Conv(_PAD, Wc, Var("b", "param"), name="conv"),
      _Conv(X, Wc, Var("b", "param"), like="conv", pads=_conv_pads,
            auto_pad="NOTSET"), guard=_pad_into_conv_ok,
      example={"family": "pad_conv"}, replacement_text="Conv(X, W, b, pads=pads + spatial pads)",
      note="zero padding is the Conv's own padding")

_simp("gemm_add_bias", Add(Gemm(A, B, name="g"), c), Gemm(A, B, c, like="g", beta=1.0),
      example={"family": "gemm"}, note="an added constant becomes the Gemm's bias")
_simp("matmul_bias_to_gemm", Add(MatMul(X, W1), c), Gemm(X, W1, c),
      guard=lambda m: m.rank("X") == 2 and m.rank("W1") == 2, example={"family": "matmul_bias"},
      note="a 2-D MatMul plus a constant is a Gemm with bias")


def _affine_into_gemm(m):
    """Gemm(X⊙g + b, W, C) = Gemm(X, g[:, None]⊙W, C + b·W) (g, b along X's last axis); the
    products are ops on constants, folded when the rule applies."""
    dtype = m.dtype("W")
    g = f.last_vector("g")(m)
    column = (g[:, None] if g.ndim else g).astype(dtype)
    row = np.broadcast_to(f.last_vector("b")(m), (m.shape("W")[0],)).astype(dtype)
    shift = MatMul(K(lambda _: row, "b"), Wc)
    bias = shift if m["C"] is None else Add(Var("C"), shift)
    reshaped = X if "r" not in m.nodes else op("Reshape")(X, s, like="r")
    return Gemm(reshaped, Mul(K(lambda _: column, "g"), Wc), bias, like="gm")


def _affine_gemm_ok(m) -> bool:
    if m.attr("gm", "transA") or m.attr("gm", "transB") or m.rank("W") != 2:
        return False
    if float(m.attr("gm", "alpha")) != 1.0 or float(m.attr("gm", "beta")) != 1.0:
        return False
    if "r" in m.nodes and m.shape("X")[-1:] != m.shape("r")[-1:]:
        return False  # the Reshape must keep the last axis
    return f.along_last("g", "X")(m) and f.along_last("b", "X")(m)


_AFFINE = Add(Mul(X, Var("g", "const")), Var("b", "const"))
_simp("affine_into_gemm", Gemm(_AFFINE, Wc, Var("C", "param"), name="gm"), _affine_into_gemm,
      guard=_affine_gemm_ok, example={"family": "affine_gemm"},
      replacement_text="Gemm(X, g⊙W, C + b·W)",
      note="a LayerNorm's scale and shift fold into the Gemm that reads it")
_simp("affine_into_gemm_through_reshape",
      Gemm(op("Reshape")(_AFFINE, s, name="r"), Wc, Var("C", "param"), name="gm"),
      _affine_into_gemm, guard=_affine_gemm_ok, example={"family": "affine_gemm_reshape"},
      replacement_text="Gemm(Reshape(X), g⊙W, C + b·W)",
      note="GPT-2's LayerNorm → Reshape → Gemm")

# --- decomposed ops that ONNX has as one op -------------------------------------------------------
# LayerNormalization (opset 17) and Gelu (opset 20): one op instead of nine or five to eight, one
# kernel instead of two (the two reductions of a decomposed LayerNorm never fuse, Table 3: red).

ReduceMean = op("ReduceMean")
_MEAN = ReduceMean(X, Var("ax1", "param"), name="mean")
_D = Sub(X, _MEAN, name="d")
_VAR = ReduceMean(alt(Pow(Var("d"), Fill(2)), Mul(Var("d"), Var("d"))), Var("ax2", "param"),
                  name="var")
_STD = Sqrt(Add(_VAR, Var("e", "const")))
_NORM = alt(Div(_D, _STD), Mul(_D, Recip(_STD)))


def _layernorm_axis(m) -> int | None:
    rank = m.rank("X")
    first, second = m.axes("mean"), m.axes("var")
    if not first or first != second or first != tuple(range(first[0], rank)):
        return None
    if not (m.attr("mean", "keepdims") and m.attr("var", "keepdims")):
        return None
    return first[0]


def _layernorm_ok(m, affine: bool) -> bool:
    axis = _layernorm_axis(m)
    eps = m.scalar("e")
    if axis is None or eps is None or not eps >= 0 or not math.isfinite(eps):
        return False
    if not affine:
        return True
    rank = m.rank("X")
    return all(m.rank(n) <= rank and all(d == 1 for d in m.aligned(n, rank)[:axis])
               for n in ("g", "b"))


def _layernorm(affine: bool):
    def make(m):
        axis = _layernorm_axis(m)
        normalized = m.shape("X")[axis:]
        dtype = m.dtype("X")

        def param(name: str | None, fill: float):
            if name is None:
                return np.full(normalized, fill, dtype)
            return np.broadcast_to(m.value(name).reshape(m.aligned(name, m.rank("X"))[axis:]),
                                   normalized).astype(dtype)

        scale = K(lambda _: param("g" if affine else None, 1.0), "g")
        bias = K(lambda _: param("b" if affine else None, 0.0), "b")
        return op("LayerNormalization")(X, scale, bias, axis=axis, epsilon=m.scalar("e"))
    return make


_LN_NOTE = "(x − mean)/√(var + ε)·g + b over trailing axes, as exporters decompose it"
_simp("layernorm", Add(Mul(_NORM, Var("g", "const")), Var("b", "const")), _layernorm(True),
      guard=lambda m: _layernorm_ok(m, True), dtypes=FLOAT32, example={"family": "layernorm"},
      replacement_text="LayerNormalization(X, g, b)", note=_LN_NOTE)
_simp("layernorm_plain", Div(_D, _STD), _layernorm(False),
      guard=lambda m: _layernorm_ok(m, False), dtypes=FLOAT32,
      example={"family": "layernorm"}, replacement_text="LayerNormalization(X, 1, 0)",
      note="the same without scale and shift")

_SQRT2 = math.sqrt(2.0)
_HALF_ERF = Add(Erf(alt(Div(X, Var("k", "const"), name="arg"),
                        Mul(X, Var("k", "const"), name="arg"))), Fill(1))


def _erf_argument_ok(m) -> bool:
    k = m.scalar("k")
    if k is None:
        return False
    want = _SQRT2 if m.op("arg").op_type == "Div" else 1 / _SQRT2
    return abs(k - want) <= 1e-6 * want


_GELU = op("Gelu")


def _one(op_type: str, guard):
    """Exactly one op of `op_type` matched (the two groupings below cannot both hold)."""
    return lambda m: sum(o.op_type == op_type for o in m.ops) == 1 and guard(m)


# 0.5·x·E, grouped either (x·E)·0.5 or (x·0.5)·E (the root Mul matches in either order).
_simp("gelu_erf", Mul(alt(Mul(X, _HALF_ERF), Mul(X, Fill(0.5))), alt(Fill(0.5), _HALF_ERF)),
      _GELU(X), guard=_one("Erf", _erf_argument_ok), example={"family": "gelu"},
      note="x·(1 + erf(x/√2))·0.5, BERT's GELU")

_CUBE = alt(Pow(X, Fill(3)), Mul(Mul(X, X), X))
_TANH = Add(Tanh(Mul(Add(X, Mul(_CUBE, Var("k1", "const"))), Var("k2", "const"))), Fill(1))


def _tanh_constants_ok(m) -> bool:
    k1, k2 = m.scalar("k1"), m.scalar("k2")
    return (k1 is not None and k2 is not None and abs(k1 - 0.044715) <= 1e-6
            and abs(k2 - math.sqrt(2 / math.pi)) <= 1e-6)


_simp("gelu_tanh", Mul(alt(Mul(X, _TANH), Mul(X, Fill(0.5))), alt(Fill(0.5), _TANH)),
      _GELU(X, approximate="tanh"), guard=_one("Tanh", _tanh_constants_ok),
      example={"family": "gelu_tanh"},
      note="0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), GPT-2's GELU")
