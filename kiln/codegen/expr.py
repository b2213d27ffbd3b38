"""Scalar expressions of the loop IR: an interned DAG with integer index simplification.

Every node is created through a constructor below and interned, so two structurally equal
expressions are the same object: common sub-expressions are shared by construction and the emitter
computes each once (DNNFusion §4.4.1's common sub-tree elimination).

Index arithmetic (dtype int64) is kept in a normal form — a `sum` of coefficient·atom terms plus a
constant, with floor division and modulo by positive constants as atoms — and simplified with the
value ranges of loop variables. This is what turns the composed index maps of Reshape/Transpose/
Slice/... (Souffle's quasi-affine maps, §5.2 and §6.2) back into plain affine offsets:
`(j // 64) * 64 + j % 64` becomes `j`, `(h*64 + d) // 64` becomes `h` when `0 <= d < 64`.

Data arithmetic (any dtype) uses generic ops that are only folded when every operand is constant
and the result is exact.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

INDEX = "int64"
BOOL = "bool"
FLOAT_TYPES = frozenset({"float32", "float64"})
SIGNED_TYPES = frozenset({"int8", "int16", "int32", "int64"})
UNSIGNED_TYPES = frozenset({"uint8", "uint16", "uint32", "uint64"})
INT_TYPES = SIGNED_TYPES | UNSIGNED_TYPES
DTYPES = FLOAT_TYPES | INT_TYPES | {BOOL}

Range = tuple[float, float]  # inclusive bounds; ±inf when unknown
UNKNOWN: Range = (-math.inf, math.inf)


class Expr:
    """One interned node. `op` names the node kind, `args` are child nodes, `attr` is hashable data."""

    __slots__ = ("__weakref__", "_free", "_key", "_range", "args", "attr", "dtype", "op")

    def __init__(self, op: str, dtype: str, args: tuple[Expr, ...], attr: Any):
        self.op = op
        self.dtype = dtype
        self.args = args
        self.attr = attr
        self._key: str | None = None
        self._range: Range | None = None
        self._free: frozenset[Expr] | None = None

    def __repr__(self) -> str:
        return self.key

    @property
    def key(self) -> str:
        """A deterministic structural description, used to order terms and in tests."""
        if self._key is None:
            inner = ",".join(a.key for a in self.args)
            self._key = f"{self.op}<{self.dtype}>{_attr_text(self.attr)}({inner})"
        return self._key

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def value(self) -> Any:
        assert self.op == "const"
        return self.attr[1]

    @property
    def name(self) -> str:
        assert self.op in ("var", "local", "acc", "lload", "load")
        return self.attr[0]

    @property
    def free(self) -> frozenset[Expr]:
        """Loop variables, locals and mutable nodes this expression depends on."""
        if self._free is None:
            if self.op in ("var", "local", "acc"):
                self._free = frozenset({self})
            elif self.op == "lload":
                self._free = frozenset({self}).union(*(a.free for a in self.args))
            else:
                self._free = frozenset().union(*(a.free for a in self.args))
        return self._free

    @property
    def range(self) -> Range:
        if self._range is None:
            self._range = _compute_range(self)
        return self._range


def _attr_text(attr: Any) -> str:
    if attr is None:
        return ""
    return "[" + ",".join(str(a) for a in attr) + "]" if isinstance(attr, tuple) else f"[{attr}]"


_INTERN: weakref.WeakValueDictionary[tuple, Expr] = weakref.WeakValueDictionary()


def make(op: str, dtype: str, args: Iterable[Expr] = (), attr: Any = None) -> Expr:
    args = tuple(args)
    key = (op, dtype, args, attr)
    node = _INTERN.get(key)
    if node is None:
        node = Expr(op, dtype, args, attr)
        _INTERN[key] = node
    return node


def _existing(op: str, dtype: str, args: tuple[Expr, ...], attr: Any) -> Expr | None:
    return _INTERN.get((op, dtype, args, attr))


# ---------------------------------------------------------------------------------------------
# Leaves

def const(value: Any, dtype: str) -> Expr:
    """A constant of `dtype`; the value is converted as numpy converts it."""
    v = np.asarray(value).astype(np.dtype(dtype)).item()
    if dtype in FLOAT_TYPES:
        return make("const", dtype, (), (float(v).hex(), float(v)))
    if dtype == BOOL:
        return make("const", dtype, (), ("b", bool(v)))
    return make("const", dtype, (), ("i", int(v)))


def iconst(value: int) -> Expr:
    return const(int(value), INDEX)


def var(name: str, extent: int, lo: int = 0) -> Expr:
    """A loop variable ranging over [lo, lo + extent)."""
    return make("var", INDEX, (), (name, lo, lo + extent - 1))


def local(name: str, dtype: str) -> Expr:
    """An immutable named scalar (defined once by a `Let`)."""
    return make("local", dtype, (), (name,))


def temporary(name: str, value: Expr) -> Expr:
    """A local naming `value` (a common sub-expression bound by `kiln.codegen.passes`), with the
    value's range, so that what is rendered from it decides as it would from the value."""
    return make("local", value.dtype, (), (name, *value.range))


def acc(name: str, dtype: str) -> Expr:
    """A mutable scalar accumulator (declared by `DeclAcc`, updated by `Assign`)."""
    return make("acc", dtype, (), (name,))


def array_load(name: str, dtype: str, index: Expr) -> Expr:
    """An element of a local (stack) array."""
    return make("lload", dtype, (index,), (name,))


def load(buffer: str, dtype: str, offset: Expr) -> Expr:
    """Element `offset` of a kernel buffer (a C pointer named `buffer`)."""
    return make("load", dtype, (offset,), (buffer,))


# ---------------------------------------------------------------------------------------------
# Ranges

def _compute_range(e: Expr) -> Range:
    op = e.op
    if op == "const":
        v = e.value
        return (float(v), float(v)) if e.dtype in FLOAT_TYPES else (int(v), int(v))
    if op == "var" or (op == "local" and len(e.attr) == 3):
        return (e.attr[1], e.attr[2])
    if op == "sum":
        lo = hi = e.attr[1]
        for a, k in zip(e.args, e.attr[0]):
            alo, ahi = a.range
            lo += min(k * alo, k * ahi)
            hi += max(k * alo, k * ahi)
        return (lo, hi)
    if op == "fdiv":
        lo, hi = e.args[0].range
        c = e.attr
        return (_floordiv(lo, c), _floordiv(hi, c))
    if op == "fmod":
        lo, hi = e.args[0].range
        c = e.attr
        if lo >= 0 and hi < c:
            return (lo, hi)
        return (0, c - 1)
    if op in ("min", "max"):
        (alo, ahi), (blo, bhi) = e.args[0].range, e.args[1].range
        f = min if op == "min" else max
        return (f(alo, blo), f(ahi, bhi))
    if op == "select":
        (alo, ahi), (blo, bhi) = e.args[1].range, e.args[2].range
        return (min(alo, blo), max(ahi, bhi))
    if e.dtype == BOOL:
        return (0, 1)
    if e.dtype in INT_TYPES and e.dtype != "int64" and e.dtype != "uint64":
        info = np.iinfo(np.dtype(e.dtype))
        return (int(info.min), int(info.max))
    if op == "cast" and e.args[0].dtype in INT_TYPES | {BOOL} and e.dtype in INT_TYPES:
        return e.args[0].range
    return UNKNOWN


def _floordiv(v: float, c: int) -> float:
    return v if math.isinf(v) else v // c


# ---------------------------------------------------------------------------------------------
# Index arithmetic (int64) in normal form

def _terms(e: Expr) -> tuple[dict[Expr, int], int]:
    if e.op == "const":
        return {}, e.value
    if e.op == "sum":
        return dict(zip(e.args, e.attr[0])), e.attr[1]
    return {e: 1}, 0


def add(*xs: Expr | int) -> Expr:
    """Sum of index expressions (ints are constants)."""
    terms: dict[Expr, int] = {}
    c = 0
    for x in xs:
        if isinstance(x, int):
            c += x
            continue
        assert x.dtype == INDEX, f"index arithmetic on {x.dtype}"
        t, k0 = _terms(x)
        c += k0
        for a, k in t.items():
            terms[a] = terms.get(a, 0) + k
    return _from_terms(terms, c)


def _from_terms(terms: dict[Expr, int], c: int) -> Expr:
    terms = {a: k for a, k in terms.items() if k != 0}
    c += _recombine(terms)
    if not terms:
        return iconst(c)
    if len(terms) == 1 and c == 0:
        (a, k), = terms.items()
        if k == 1:
            return a
    atoms = sorted(terms, key=lambda a: a.key)
    return make("sum", INDEX, atoms, (tuple(terms[a] for a in atoms), c))


def _recombine(terms: dict[Expr, int]) -> int:
    """k·c·(x // c) + k·(x % c) → k·x, and k·a·((x // a) % b) + k·(x % a) → k·(x % (a·b)).

    Rewrites `terms` in place and returns the constant the rewriting adds.
    """
    extra = 0
    changed = True
    while changed:
        changed = False
        for atom, k in list(terms.items()):
            if atom.op != "fmod":
                continue
            x, c = atom.args[0], atom.attr
            quotient = _existing("fdiv", INDEX, (x,), c)
            if quotient is not None and terms.get(quotient, 0) == k * c:
                del terms[atom], terms[quotient]
                inner, k0 = _terms(x)
                for a, kk in inner.items():
                    terms[a] = terms.get(a, 0) + k * kk
                extra += k * k0
                changed = True
                break
            upper = next((o for o, ko in terms.items()
                          if o.op == "fmod" and o.args[0].op == "fdiv" and o.args[0].args[0] is x
                          and o.args[0].attr == c and ko == k * c), None)
            if upper is not None:
                del terms[atom], terms[upper]
                merged = modulo(x, c * upper.attr)
                terms[merged] = terms.get(merged, 0) + k
                changed = True
                break
        for a in [a for a, k in terms.items() if k == 0]:
            del terms[a]
    return extra


def mul(x: Expr, k: int) -> Expr:
    """An index expression times a constant."""
    if k == 0:
        return iconst(0)
    if k == 1:
        return x
    t, c = _terms(x)
    return _from_terms({a: kk * k for a, kk in t.items()}, c * k)


def imul(a: Expr, b: Expr) -> Expr:
    """Product of two index expressions (one of them usually constant)."""
    if b.is_const:
        return mul(a, b.value)
    if a.is_const:
        return mul(b, a.value)
    return make("imul", INDEX, sorted((a, b), key=lambda e: e.key))


def sub(a: Expr, b: Expr | int) -> Expr:
    return add(a, mul(b, -1) if isinstance(b, Expr) else -b)


def _divisor_candidates(terms: dict[Expr, int], c: int) -> list[int]:
    return sorted({math.gcd(k, c) for k in terms.values()} - {1, c}, reverse=True)


def _split_by(terms: dict[Expr, int], const_: int, g: int) -> tuple[Expr, Expr]:
    """Write sum = g·A + r with A the terms whose coefficient g divides."""
    big = {a: k // g for a, k in terms.items() if k % g == 0}
    rest = {a: k for a, k in terms.items() if k % g != 0}
    return _from_terms(big, const_ // g), _from_terms(rest, const_ % g)


def floordiv(x: Expr, c: int) -> Expr:
    """floor(x / c) for a positive constant c."""
    assert c > 0
    if c == 1:
        return x
    if x.is_const:
        return iconst(x.value // c)
    lo, hi = x.range
    if math.isfinite(lo) and math.isfinite(hi) and lo // c == hi // c:
        return iconst(int(lo // c))
    if x.op == "fdiv":
        return floordiv(x.args[0], x.attr * c)
    if x.op == "fmod" and x.attr % c == 0:
        return modulo(floordiv(x.args[0], c), x.attr // c)
    if x.op == "sum":
        terms, k0 = _terms(x)
        whole = {a: k // c for a, k in terms.items() if k % c == 0}
        if whole or k0 >= c or k0 < 0:
            rest = {a: k for a, k in terms.items() if k % c != 0}
            return add(_from_terms(whole, k0 // c), floordiv(_from_terms(rest, k0 % c), c))
        for g in _divisor_candidates(terms, c):
            big, rest = _split_by(terms, k0, g)
            rlo, rhi = rest.range
            if rlo >= 0 and rhi < g:
                return floordiv(big, c // g)
    return make("fdiv", INDEX, (x,), c)


def modulo(x: Expr, c: int) -> Expr:
    """x mod c (floor semantics: the result is in [0, c)) for a positive constant c."""
    assert c > 0
    if c == 1:
        return iconst(0)
    if x.is_const:
        return iconst(x.value % c)
    lo, hi = x.range
    if lo >= 0 and hi < c:
        return x
    if math.isfinite(lo) and math.isfinite(hi) and lo // c == hi // c:
        return sub(x, int(lo // c) * c)
    if x.op == "fmod" and x.attr % c == 0:
        return modulo(x.args[0], c)
    if x.op == "sum":
        terms, k0 = _terms(x)
        kept = {a: k for a, k in terms.items() if k % c != 0}
        if len(kept) != len(terms) or not 0 <= k0 < c:
            return modulo(_from_terms(kept, k0 % c), c)
        for g in _divisor_candidates(terms, c):
            big, rest = _split_by(terms, k0, g)
            rlo, rhi = rest.range
            if rlo >= 0 and rhi < g:
                return add(mul(modulo(big, c // g), g), rest)
    return make("fmod", INDEX, (x,), c)


def imin(a: Expr, b: Expr | int) -> Expr:
    b = iconst(b) if isinstance(b, int) else b
    if a is b:
        return a
    if a.range[1] <= b.range[0]:
        return a
    if b.range[1] <= a.range[0]:
        return b
    return make("min", INDEX, sorted((a, b), key=lambda e: e.key))


def imax(a: Expr, b: Expr | int) -> Expr:
    b = iconst(b) if isinstance(b, int) else b
    if a is b:
        return a
    if a.range[0] >= b.range[1]:
        return a
    if b.range[0] >= a.range[1]:
        return b
    return make("max", INDEX, sorted((a, b), key=lambda e: e.key))


def clamp(x: Expr, lo: int, hi: int) -> Expr:
    return imin(imax(x, lo), hi)


def linearize(dims: Iterable[Expr], shape: tuple[int, ...]) -> Expr:
    """Row-major offset of a multi-index."""
    offset: Expr = iconst(0)
    for d, n in zip(dims, shape):
        offset = add(mul(offset, n), d)
    return offset


def delinearize(offset: Expr, shape: tuple[int, ...]) -> tuple[Expr, ...]:
    """The multi-index of a row-major offset (the offset must be within the shape)."""
    if math.prod(shape) == 0:
        return tuple(iconst(0) for _ in shape)  # an empty tensor has no element to name
    dims = []
    stride = math.prod(shape)
    for i, n in enumerate(shape):
        stride //= n
        q = floordiv(offset, stride) if stride > 1 else offset
        dims.append(q if i == 0 else modulo(q, n))
    return tuple(dims)


def index_compare(op: str, a: Expr, b: Expr | int) -> Expr:
    """`a <op> b` for index expressions, folded when the ranges decide it."""
    b = iconst(b) if isinstance(b, int) else b
    (alo, ahi), (blo, bhi) = a.range, b.range
    decided = {
        "lt": (ahi < blo, alo >= bhi), "le": (ahi <= blo, alo > bhi),
        "ge": (alo >= bhi, ahi < blo), "gt": (alo > bhi, ahi <= blo),
        "eq": (alo == ahi == blo == bhi, ahi < blo or alo > bhi),
        "ne": (ahi < blo or alo > bhi, alo == ahi == blo == bhi),
    }[op]
    if decided[0]:
        return const(True, BOOL)
    if decided[1]:
        return const(False, BOOL)
    return make(op, BOOL, (a, b))


# ---------------------------------------------------------------------------------------------
# Data arithmetic (any dtype)

def unary(op: str, x: Expr, dtype: str | None = None) -> Expr:
    return make(op, dtype or x.dtype, (x,))


def binary(op: str, a: Expr, b: Expr, dtype: str | None = None) -> Expr:
    return make(op, dtype or a.dtype, (a, b))


def call(fn: str, dtype: str, *args: Expr) -> Expr:
    """A math-library call; `fn` is the double-precision C name (exp, tanh, ...)."""
    return make("call", dtype, args, fn)


def cast(x: Expr, dtype: str) -> Expr:
    if x.dtype == dtype:
        return x
    if x.is_const and (dtype not in INT_TYPES or x.dtype not in FLOAT_TYPES):
        return const(np.asarray(x.value, dtype=np.dtype(x.dtype)).astype(np.dtype(dtype)), dtype)
    return make("cast", dtype, (x,))


def select(cond: Expr, a: Expr, b: Expr) -> Expr:
    assert cond.dtype == BOOL and a.dtype == b.dtype, (cond.dtype, a.dtype, b.dtype)
    if cond.is_const:
        return a if cond.value else b
    if a is b:
        return a
    return make("select", a.dtype, (cond, a, b))


def logical_and(a: Expr, b: Expr) -> Expr:
    if a.is_const:
        return b if a.value else a
    if b.is_const:
        return a if b.value else b
    return make("and", BOOL, (a, b))


def logical_or(a: Expr, b: Expr) -> Expr:
    if a.is_const:
        return a if a.value else b
    if b.is_const:
        return b if b.value else a
    return make("or", BOOL, (a, b))


def as_index(x: Expr) -> Expr:
    """A data value used as an index."""
    return cast(x, INDEX)


# ---------------------------------------------------------------------------------------------
# Traversal

def substitute(e: Expr, mapping: dict[Expr, Expr], memo: dict[Expr, Expr] | None = None) -> Expr:
    """Replace nodes (usually loop variables) and rebuild through the simplifying constructors."""
    memo = {} if memo is None else memo
    if e in mapping:
        return mapping[e]
    if e in memo:
        return memo[e]
    if not e.args or not e.free & mapping.keys():
        result = e
    else:
        args = tuple(substitute(a, mapping, memo) for a in e.args)
        result = e if all(a is b for a, b in zip(args, e.args)) else rebuild(e, args)
    memo[e] = result
    return result


def replace_nodes(e: Expr, mapping: dict[Expr, Expr], memo: dict[Expr, Expr] | None = None) -> Expr:
    """`e` with every occurrence of a key of `mapping` (any node, not only the loop variables
    that `substitute` replaces) replaced by its value, rebuilt through the simplifying
    constructors."""
    memo = {} if memo is None else memo
    if e in mapping:
        return mapping[e]
    if e not in memo:
        args = tuple(replace_nodes(a, mapping, memo) for a in e.args)
        memo[e] = e if all(a is b for a, b in zip(args, e.args)) else rebuild(e, args)
    return memo[e]


def rebuild(e: Expr, args: tuple[Expr, ...]) -> Expr:
    """The node `e` with new children, simplified."""
    op = e.op
    if op == "sum":
        return add(*(mul(a, k) for a, k in zip(args, e.attr[0])), e.attr[1])
    if op == "fdiv":
        return floordiv(args[0], e.attr)
    if op == "fmod":
        return modulo(args[0], e.attr)
    if op == "imul":
        return imul(*args)
    if op in ("min", "max") and e.dtype == INDEX:
        return imin(*args) if op == "min" else imax(*args)
    if op in ("lt", "le", "gt", "ge", "eq", "ne") and args[0].dtype == INDEX:
        return index_compare(op, *args)
    if op == "select":
        return select(*args)
    if op == "cast":
        return cast(args[0], e.dtype)
    if op == "and":
        return logical_and(*args)
    if op == "or":
        return logical_or(*args)
    return make(op, e.dtype, args, e.attr)


def walk(roots: Iterable[Expr]) -> list[Expr]:
    """Every node reachable from `roots`, children before parents, each once."""
    seen: set[int] = set()
    order: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(r, False) for r in roots]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((a, False) for a in node.args if id(a) not in seen)
    return order



class NotEvaluable(Exception):
    """An expression needs run-time data (or an op the evaluator lacks)."""


def evaluate_index(e: Expr, env: dict[Expr, np.ndarray]) -> np.ndarray:
    """Evaluate an index expression with numpy over arrays of loop-variable values."""
    memo: dict[Expr, np.ndarray] = {}

    def ev(node: Expr) -> np.ndarray:
        if node in env:
            return env[node]
        if node in memo:
            return memo[node]
        op, a = node.op, node.args
        if op == "const":
            out = np.asarray(node.value)
        elif op == "sum":
            out = np.asarray(node.attr[1], dtype=np.int64)
            for arg, k in zip(a, node.attr[0]):
                out = out + k * ev(arg)
        elif op == "fdiv":
            out = ev(a[0]) // node.attr
        elif op == "fmod":
            out = ev(a[0]) % node.attr
        elif op == "imul":
            out = ev(a[0]) * ev(a[1])
        elif op in ("min", "max") and node.dtype == INDEX:
            out = (np.minimum if op == "min" else np.maximum)(ev(a[0]), ev(a[1]))
        elif op == "select":
            out = np.where(ev(a[0]), ev(a[1]), ev(a[2]))
        elif op in _NUMPY_COMPARE:
            out = _NUMPY_COMPARE[op](ev(a[0]), ev(a[1]))
        elif op == "and":
            out = np.logical_and(ev(a[0]), ev(a[1]))
        elif op == "or":
            out = np.logical_or(ev(a[0]), ev(a[1]))
        else:
            raise NotEvaluable(op)
        memo[node] = out
        return out

    return ev(e)


_NUMPY_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
                  "eq": np.equal, "ne": np.not_equal}
