"""Helpers shared by the op lowerings of several families: scalar formula constructors, axis and
index normalisation, and `check` functions."""
from __future__ import annotations

from kiln.codegen.expr import (
    BOOL,
    Expr,
    as_index,
    binary,
    call,
    clamp,
    const,
    index_compare,
    make,
    select,
    unary,
)
from kiln.codegen.expr import add as iadd
from kiln.ecg import Graph, Op


# --- scalar formulas ---------------------------------------------------------------------------
def c(value, like: Expr) -> Expr:
    return const(value, like.dtype)


def add(a: Expr, b: Expr) -> Expr:
    return binary("add", a, b)


def sub(a: Expr, b: Expr) -> Expr:
    return binary("sub", a, b)


def mul(a: Expr, b: Expr) -> Expr:
    return binary("mul", a, b)


def div(a: Expr, b: Expr) -> Expr:
    return binary("div", a, b)


def cmp(op: str, a: Expr, b: Expr) -> Expr:
    return make(op, BOOL, (a, b))


def fn(name: str, *args: Expr) -> Expr:
    return call(name, args[0].dtype, *args)


def maximum(a: Expr, b: Expr) -> Expr:
    return binary("max", a, b)


def minimum(a: Expr, b: Expr) -> Expr:
    return binary("min", a, b)


def exp(x: Expr) -> Expr:
    return fn("exp", x)


def logistic_ratio(numerator: Expr, exponent: Expr) -> Expr:
    """numerator / (1 + exp(exponent)): sigmoid, SiLU and GELU's tanh form, the exponent given
    negated (a constant factor takes the sign). Their exp is `exp_flush`, whose flushed tails the
    sum absorbs: exp below 2^-126 changes no 1 + exp, and +inf stands for a quotient below the
    normal range."""
    return div(numerator, add(c(1, exponent), fn("exp_flush", exponent)))


def sigmoid(x: Expr) -> Expr:
    return logistic_ratio(c(1, x), unary("neg", x))


def softplus(x: Expr) -> Expr:
    """log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|)), one exp and one log1p
    (a select of two formulas would compute both in a vectorised loop)."""
    return add(maximum(x, c(0, x)), fn("log1p", exp(unary("neg", unary("abs", x)))))


def clip01(v: Expr) -> Expr:
    return select(cmp("lt", v, c(0, v)), c(0, v), select(cmp("gt", v, c(1, v)), c(1, v), v))


# --- axes and indices ----------------------------------------------------------------------------
def axis_of(value: int, rank: int) -> int:
    return value + rank if value < 0 else value


def wrapped(value: Expr, extent: int) -> Expr:
    """A run-time index: negative counts from the end; clamped into [0, extent)."""
    i = as_index(value)
    i = select(index_compare("lt", i, 0), iadd(i, extent), i)
    return clamp(i, 0, max(extent - 1, 0))


# --- checks ----------------------------------------------------------------------------------------
def needs_const_inputs(*positions: int):
    def check(op: Op, graph: Graph) -> str | None:
        for p in positions:
            if p < len(op.inputs) and op.inputs[p] is not None and not graph.is_constant(op.inputs[p]):
                return f"input {p} must be a constant"
        return None
    return check
