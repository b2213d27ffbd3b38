"""Elementwise ops (One-to-One, and One-to-Many through broadcasting): scalar formulas.

Inputs are read with numpy broadcasting (`broadcast`), so an input of the output's shape passes the
output's index through untouched. Formulas follow the ONNX definitions; NaN handling follows
onnxruntime (Max/Min/Relu/Clip propagate NaN).
"""
from __future__ import annotations

import math

import numpy as np

from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    Expr,
    binary,
    call,
    cast,
    clamp,
    const,
    index_compare,
    logical_and,
    logical_or,
    make,
    select,
    unary,
)
from kiln.codegen.expr import add as iadd
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.contexts import InlineCtx
from kiln.codegen.ops.common import (add, c, clip01, cmp, div, exp, fn, logistic_ratio, maximum, minimum,
                                     mul, sigmoid, softplus, sub)
from kiln.codegen.ops.registry import inline
from kiln.ecg import Graph, Op


def operand(ctx: InlineCtx, i: int, index: Index) -> Expr:
    """Input i read with broadcasting at output `index`."""
    return ctx.input(i, broadcast(index, ctx.shape(i)))


def scalar(ctx: InlineCtx, i: int) -> Expr:
    return ctx.input(i, Index(ctx.shape(i), flat=const(0, "int64")))


def floats_only(op: Op, graph: Graph) -> str | None:
    dtypes = {graph.tensors[t].dtype for t in op.present_inputs()}
    return None if dtypes <= FLOAT_TYPES else "floating-point inputs only"


# --- unary maths --------------------------------------------------------------------------------
CALLS = {
    "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Sin": "sin", "Cos": "cos", "Tan": "tan",
    "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
    "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Erf": "erf", "Tanh": "tanh",
    "Ceil": "ceil", "Floor": "floor", "Round": "nearbyint",
}


@inline(*CALLS, check=floats_only)
def _call(ctx: InlineCtx, index: Index) -> Expr:
    return fn(CALLS[ctx.op.op_type], ctx.input(0, index))


def _unary_formula(ctx: InlineCtx, x: Expr) -> Expr:
    t, a = ctx.op.op_type, ctx.attr
    if t == "Abs":
        return unary("abs", x)
    if t == "Neg":
        return unary("neg", x)
    if t == "Relu":
        return select(cmp("lt", x, c(0, x)), c(0, x), x)
    if t == "LeakyRelu":
        return select(cmp("lt", x, c(0, x)), mul(c(a("alpha", 0.01), x), x), x)
    if t == "ThresholdedRelu":
        return select(cmp("gt", x, c(a("alpha", 1.0), x)), x, c(0, x))
    if t == "Reciprocal":
        return div(c(1, x), x)
    if t == "Sigmoid":
        return sigmoid(x)
    if t == "HardSigmoid":
        return clip01(add(mul(c(a("alpha", 0.2), x), x), c(a("beta", 0.5), x)))
    if t == "HardSwish":
        return mul(x, clip01(add(mul(c(1 / 6, x), x), c(0.5, x))))
    if t == "Softsign":
        return div(x, add(c(1, x), unary("abs", x)))
    if t == "Softplus":
        return softplus(x)
    if t == "Elu":
        return select(cmp("lt", x, c(0, x)), mul(c(a("alpha", 1.0), x), sub(exp(x), c(1, x))), x)
    if t == "Selu":
        alpha, gamma = c(a("alpha", 1.67326319217681884765625), x), c(a("gamma", 1.05070102214813232421875), x)
        return select(cmp("le", x, c(0, x)), mul(gamma, sub(mul(alpha, exp(x)), alpha)), mul(gamma, x))
    if t == "Celu":
        alpha = c(a("alpha", 1.0), x)
        negative = mul(alpha, sub(exp(div(x, alpha)), c(1, x)))
        return add(maximum(c(0, x), x), minimum(c(0, x), negative))
    if t == "Gelu":
        if a("approximate", "none") == "tanh":
            # 0.5·(1 + tanh(u)) = 1 / (1 + exp(-2u)): one exp and one divide
            cubic = add(x, mul(c(0.044715, x), mul(x, mul(x, x))))
            return logistic_ratio(x, mul(c(-2 * math.sqrt(2 / math.pi), x), cubic))
        return fn("gelu_erf", x)
    if t == "Mish":
        return mul(x, fn("tanh", softplus(x)))
    if t == "Swish":
        return logistic_ratio(x, mul(c(-a("alpha", 1.0), x), x))
    if t == "Shrink":
        bias, lambd = c(a("bias", 0.0), x), c(a("lambd", 0.5), x)
        return select(cmp("lt", x, unary("neg", lambd)), add(x, bias),
                      select(cmp("gt", x, lambd), sub(x, bias), c(0, x)))
    if t == "Sign":
        zero = c(0, x)
        inner = select(cmp("lt", x, zero), c(-1, x), select(cmp("eq", x, zero), zero, x)) \
            if x.dtype in FLOAT_TYPES else select(cmp("lt", x, zero), c(-1, x), zero)
        return select(cmp("gt", x, zero), c(1, x), inner)
    if t == "Not":
        return unary("not", x)
    if t == "BitwiseNot":
        return unary("bitnot", x)
    if t == "IsNaN":
        return cmp("ne", x, x)
    if t == "IsInf":
        found = const(False, BOOL)
        if a("detect_positive", 1):
            found = logical_or(found, cmp("eq", x, c(math.inf, x)))
        if a("detect_negative", 1):
            found = logical_or(found, cmp("eq", x, c(-math.inf, x)))
        return found
    raise AssertionError(t)


FLOAT_UNARY = ("LeakyRelu", "ThresholdedRelu", "Reciprocal", "Sigmoid", "HardSigmoid", "HardSwish",
               "Softsign", "Softplus", "Elu", "Selu", "Celu", "Gelu", "Mish", "Swish", "IsNaN",
               "IsInf")


@inline(*FLOAT_UNARY, check=floats_only)
def _float_unary(ctx: InlineCtx, index: Index) -> Expr:
    return _unary_formula(ctx, ctx.input(0, index))


@inline("Abs", "Neg", "Relu", "Shrink", "Sign", "Not", "BitwiseNot")
def _any_unary(ctx: InlineCtx, index: Index) -> Expr:
    return _unary_formula(ctx, ctx.input(0, index))


@inline("Clip")
def _clip(ctx: InlineCtx, index: Index) -> Expr:
    x = ctx.input(0, index)
    if ctx.has(1):
        lo = scalar(ctx, 1)
        x = select(cmp("lt", x, lo), lo, x)
    if ctx.has(2):
        hi = scalar(ctx, 2)
        x = select(cmp("gt", x, hi), hi, x)
    return x


@inline("Cast", "CastLike")
def _cast(ctx: InlineCtx, index: Index) -> Expr:
    return cast(ctx.input(0, index), ctx.out.dtype)


def _inference_dropout(op: Op, graph: Graph) -> str | None:
    if op.op_type != "Dropout":
        return None
    mode = op.inputs[2] if len(op.inputs) > 2 else None
    if mode is not None and (not graph.is_constant(mode)
                             or bool(graph.tensors[mode].data.reshape(-1)[0])):
        return "training mode"
    return None


@inline("Identity", "Dropout", check=_inference_dropout)
def _identity(ctx: InlineCtx, index: Index) -> Expr:
    """Identity, and Dropout at inference: the input, and a mask of ones."""
    if ctx.position == 1:
        return const(True, BOOL)
    return ctx.input(0, index)


def _batchnorm_check(op: Op, graph: Graph) -> str | None:
    if op.attrs.get("training_mode", 0) or len(op.outputs) > 1:
        return "training mode"
    return floats_only(op, graph)


@inline("BatchNormalization", check=_batchnorm_check)
def _batchnorm(ctx: InlineCtx, index: Index) -> Expr:
    x = ctx.input(0, index)
    rank = len(ctx.shape(1))
    channel = Index(ctx.shape(1), dims=index.dims[1:1 + rank])
    scale, bias, mean, variance = (ctx.input(i, channel) for i in (1, 2, 3, 4))
    eps = c(ctx.attr("epsilon", 1e-5), x)
    inv = div(scale, fn("sqrt", add(variance, eps)))
    return add(mul(sub(x, mean), inv), bias)


# --- binary and variadic ------------------------------------------------------------------------
ARITH = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}
COMPARE = {"Equal": "eq", "Greater": "gt", "GreaterOrEqual": "ge", "Less": "lt",
           "LessOrEqual": "le"}
BITWISE = {"BitwiseAnd": "bitand", "BitwiseOr": "bitor", "BitwiseXor": "bitxor"}


@inline(*ARITH, *COMPARE, *BITWISE, "And", "Or", "Xor", "Mod", "BitShift", "PRelu")
def _binary(ctx: InlineCtx, index: Index) -> Expr:
    a, b = operand(ctx, 0, index), operand(ctx, 1, index)
    t = ctx.op.op_type
    if t in ARITH:
        return binary(ARITH[t], a, b)
    if t in COMPARE:
        return cmp(COMPARE[t], a, b)
    if t in BITWISE:
        return binary(BITWISE[t], a, b)
    if t == "And":
        return logical_and(a, b)
    if t == "Or":
        return logical_or(a, b)
    if t == "Xor":
        return make("xor", BOOL, (a, b))
    if t == "Mod":
        return binary("mod_c" if ctx.attr("fmod", 0) else "mod_py", a, b)
    if t == "BitShift":
        return binary("shl" if ctx.attr("direction") == "LEFT" else "shr", a, b)
    if t == "PRelu":
        return select(cmp("lt", a, c(0, a)), mul(b, a), a)
    raise AssertionError(t)


@inline("Pow")
def _pow(ctx: InlineCtx, index: Index) -> Expr:
    x = operand(ctx, 0, index)
    exponent = ctx.const(1)
    if exponent is not None and exponent.size == 1 and x.dtype in FLOAT_TYPES:
        e = float(exponent.reshape(-1)[0])
        if e == 1:
            return x
        if e == 2:
            return mul(x, x)
        if e == 3:
            return mul(x, mul(x, x))
    y = operand(ctx, 1, index)
    if x.dtype in FLOAT_TYPES:
        return fn("pow", x, cast(y, x.dtype))
    return cast(call("pow", "float64", cast(x, "float64"), cast(y, "float64")), x.dtype)


@inline("Where")
def _where(ctx: InlineCtx, index: Index) -> Expr:
    return select(operand(ctx, 0, index), operand(ctx, 1, index), operand(ctx, 2, index))


@inline("Sum", "Max", "Min", "Mean")
def _variadic(ctx: InlineCtx, index: Index) -> Expr:
    values = [operand(ctx, i, index) for i, t in enumerate(ctx.op.inputs) if t is not None]
    op = {"Sum": "add", "Mean": "add", "Max": "max", "Min": "min"}[ctx.op.op_type]
    result = values[0]
    for v in values[1:]:
        result = binary(op, result, v)
    if ctx.op.op_type == "Mean":
        result = div(result, c(len(values), result))
    return result


@inline("LRN", check=floats_only)
def _lrn(ctx: InlineCtx, index: Index) -> Expr:
    """x / (bias + alpha/size · Σ x² over the channel window)^beta; the window is unrolled."""
    size = ctx.attr("size")
    x = ctx.input(0, index)
    channels = ctx.shape(0)[1]
    dims = index.dims
    squares = c(0, x)
    for offset in range(-((size - 1) // 2), (size - 1) // 2 + (size - 1) % 2 + 1):
        ch = iadd(dims[1], offset)
        inside = logical_and(index_compare("ge", ch, 0), index_compare("lt", ch, channels))
        v = ctx.input(0, Index(ctx.shape(0), dims=[dims[0], clamp(ch, 0, channels - 1), *dims[2:]]))
        squares = add(squares, select(inside, mul(v, v), c(0, x)))
    scale = c(ctx.attr("alpha", 1e-4) / size, x)
    base = add(c(ctx.attr("bias", 1.0), x), mul(scale, squares))
    return div(x, fn("pow", base, c(ctx.attr("beta", 0.75), x)))


@inline("SwiGLU", check=floats_only)
def _swiglu(ctx: InlineCtx, index: Index) -> Expr:
    a, b = ctx.input(0, index), ctx.input(1, index)
    return mul(logistic_ratio(a, mul(c(-ctx.attr("alpha", 1.0), a), a)), b)


def _same_width(op: Op, graph: Graph) -> str | None:
    source, target = graph.tensors[op.inputs[0]].dtype, graph.tensors[op.outputs[0]].dtype
    if np.dtype(source).itemsize != np.dtype(target).itemsize or BOOL in (source, target):
        return "different bit widths"
    return None


@inline("BitCast", check=_same_width)
def _bitcast(ctx: InlineCtx, index: Index) -> Expr:
    return make("bitcast", ctx.out.dtype, (ctx.input(0, index),))
