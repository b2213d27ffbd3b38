"""Rules as data (DNNFusion §4.2, Table 4): a pattern over ops, a guard, a replacement.

A pattern is a term: `Mul(Recip(A), Recip(Mul(A, B)))`. Its leaves are variables (`A`, `B`: any
tensor; `c`, `c1`, `c2`: constant tensors; `ax`, `s`: parameter inputs such as axes or a shape,
which may be omitted), or `Fill(v)`: a constant whose every element equals v. A variable used
twice must bind the same tensor. Node terms name an op type (or several alternatives) and may
require attribute values; a named node (`name="r"`) binds its output tensor under that name, so
a guard can read its attributes and a replacement can reuse it.

Binary ops whose operand order does not matter (their record says `symmetric`: Add, Mul, Max,
Min, And, Or, ...) match in either order, so a rule is written once for `A⊙B` and `B⊙A` (rules that differ only by operand
order are one rule).

A replacement is a term over the same constructors whose variables refer to what the pattern
bound, plus `K(fn, text)`: a constant computed from the match. Node attributes in a replacement
are values, or callables of the match; `like="r"` copies the attributes of the matched node `r`.
Ops of a replacement whose inputs are all constant are folded when the rule is applied, so
`Mul(X, Mul(c1, c2))` multiplies the two constants once, at compile time.

Every rule is checked by the engine as well: the replacement must produce the root's shape and
dtype, the values the pattern computes must have one of the rule's dtypes, and the FLOP and byte
delta (new ops minus the ops that become dead) must be an improvement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import numpy as np

from kiln.ecg import Op, Tensor
from kiln.ops import ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE, attr_default

if TYPE_CHECKING:
    from kiln.rewrite.engine import Work

SIMPLIFY = "simplify"
CATEGORIES = (ASSOCIATIVE, DISTRIBUTIVE, COMMUTATIVE, SIMPLIFY)

FLOAT = frozenset({"float16", "float32", "float64"})
FLOAT32 = frozenset({"float32"})
SIGNED = frozenset({"int8", "int16", "int32", "int64"})
UNSIGNED = frozenset({"uint8", "uint16", "uint32", "uint64"})
INTEGER = SIGNED | UNSIGNED
BOOL = frozenset({"bool"})
NUMERIC = FLOAT | INTEGER

def attr_of(op: Op, key: str, default: Any = None, opset: int | None = None) -> Any:
    """The op's attribute `key`, else ONNX's default for it at `opset` (None: the latest), else
    `default`."""
    if key in op.attrs:
        return op.attrs[key]
    schema_default = attr_default(op.op_type, key, opset)
    return default if schema_default is None else schema_default


# --- terms ------------------------------------------------------------------------------------

class Term:
    """A pattern or replacement expression."""


@dataclass(frozen=True, eq=False)
class Var(Term):
    """A leaf: `kind` is "any" (any tensor), "opt" (any tensor, or an omitted optional input),
    "const" (a constant), "index" (any tensor of indices) or "param" (a constant parameter input
    such as axes or a shape, possibly omitted). Index and param inputs are not subject to the
    rule's dtypes."""

    name: str
    kind: str = "any"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Fill(Term):
    """In a pattern: a constant whose every element equals `value`. In a replacement: that scalar,
    in the dtype of the op's other operands."""

    value: float

    def __str__(self) -> str:
        return f"{self.value:g}"


@dataclass(frozen=True, eq=False)
class K(Term):
    """Replacement only: a constant computed from the match (an ndarray of the right dtype)."""

    fn: Callable[["Match"], np.ndarray]
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, eq=False)
class Node(Term):
    ops: tuple[str, ...]  # alternatives; a replacement node uses ops[0]
    args: tuple[Term, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)  # pattern: value or predicate
    name: str | None = None
    like: str | None = None  # replacement: copy the attributes of this matched node
    any_order: bool = False  # pattern: match the two operands in either order (any op)

    def __str__(self) -> str:
        head = "|".join(_SHORT.get(o, o) for o in self.ops)
        parts = [str(a) for a in self.args]
        parts += [f"{k}={_attr_text(v)}" for k, v in self.attrs.items()]
        prefix = f"{self.name}=" if self.name else ""
        return f"{prefix}{head}({', '.join(parts)})"


@dataclass(frozen=True, eq=False)
class Alt(Term):
    """Pattern only: matches when any of `options` matches (tried in order)."""

    options: tuple[Term, ...]

    def __str__(self) -> str:
        return "[" + " | ".join(str(o) for o in self.options) + "]"


def alt(*options: Term) -> Alt:
    return Alt(tuple(options))


def _attr_text(value: Any) -> str:
    return "…" if callable(value) else repr(value)


_SHORT = {"Reciprocal": "Recip"}


def op(op_type: str | tuple[str, ...]) -> Callable[..., Node]:
    """A term constructor: `Mul = op("Mul")`; `Mul(A, B, name="m")`."""
    ops = (op_type,) if isinstance(op_type, str) else tuple(op_type)

    def make(*args: Term, name: str | None = None, like: str | None = None, **attrs: Any) -> Node:
        return Node(ops, tuple(args), attrs, name, like)

    make.__name__ = ops[0]
    return make


def one_of(*op_types: str) -> Callable[..., Node]:
    return op(tuple(op_types))


Add, Sub, Mul, Div, Pow = op("Add"), op("Sub"), op("Mul"), op("Div"), op("Pow")
Max, Min, And, Or, Xor = op("Max"), op("Min"), op("And"), op("Or"), op("Xor")
Neg, Abs, Recip, Sqrt = op("Neg"), op("Abs"), op("Reciprocal"), op("Sqrt")
Exp, Log, Relu, Erf, Tanh, Sigmoid = (op("Exp"), op("Log"), op("Relu"), op("Erf"), op("Tanh"),
                                      op("Sigmoid"))
MatMul, Gemm, Conv = op("MatMul"), op("Gemm"), op("Conv")
ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd = (
    op("ReduceSum"), op("ReduceMean"), op("ReduceMax"), op("ReduceMin"), op("ReduceProd"))
ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSumExp, ReduceLogSum = (
    op("ReduceL1"), op("ReduceL2"), op("ReduceSumSquare"), op("ReduceLogSumExp"),
    op("ReduceLogSum"))
Transpose, Reshape, Expand, Cast, Identity = (op("Transpose"), op("Reshape"), op("Expand"),
                                              op("Cast"), op("Identity"))
Softmax, LogSoftmax, Gather, BitShift, Where, Clip = (
    op("Softmax"), op("LogSoftmax"), op("Gather"), op("BitShift"), op("Where"), op("Clip"))


def Square(x: Term) -> Node:  # noqa: N802  (Table 4's Square: x ⊙ x)
    return Mul(x, x)


# The usual variables.
A, B, C, D, X, Y, W = (Var(n) for n in "ABCDXYW")
W1, W2, X1, X2 = Var("W1"), Var("W2"), Var("X1"), Var("X2")
c, c1, c2, v, g, b = (Var(n, "const") for n in ("c", "c1", "c2", "v", "g", "b"))
b1, b2, a_, e_ = Var("b1", "const"), Var("b2", "const"), Var("a", "const"), Var("e", "const")
ax, ax1, ax2, s, s1, s2 = (Var(n, "param") for n in ("ax", "ax1", "ax2", "s", "s1", "s2"))
Wc, W1c, W2c = Var("W", "const"), Var("W1", "const"), Var("W2", "const")
Copt, bopt = Var("C", "opt"), Var("b", "opt")
I, T = Var("I", "index"), Var("T", "const")  # noqa: E741  (indices, a table)


# --- the match a guard and a replacement see ----------------------------------------------------

class Match:
    """The bindings of one pattern match, and what guards need to know about them."""

    def __init__(self, work: "Work", root: Op, bind: dict[str, str | None], nodes: dict[str, Op],
                 ops: list[Op]):
        self.work = work
        self.root = root
        self.bind = bind
        self.nodes = nodes
        self.ops = ops  # every matched op, root first

    def __getitem__(self, name: str) -> str | None:
        return self.bind[name]

    def __contains__(self, name: str) -> bool:
        return self.bind.get(name) is not None

    # tensors
    def tensor(self, name: str) -> Tensor:
        return self.work.tensors[self.bind[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensor(name).shape

    def rank(self, name: str) -> int:
        return len(self.shape(name))

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def dtype(self, name: str) -> str:
        return self.tensor(name).dtype

    def value(self, name: str) -> np.ndarray | None:
        tid = self.bind.get(name)
        return None if tid is None else self.work.tensors[tid].data

    def is_const(self, name: str) -> bool:
        return self.value(name) is not None

    @property
    def out(self) -> Tensor:
        return self.work.tensors[self.root.outputs[0]]

    # ops
    def op(self, name: str) -> Op:
        return self.nodes[name]

    def attr(self, name: str, key: str, default: Any = None) -> Any:
        return attr_of(self.nodes[name], key, default, self.work.opset)

    # common facts
    def scalar(self, name: str) -> float | None:
        """The value of a constant with one element, else None."""
        data = self.value(name)
        return float(data.reshape(-1)[0]) if data is not None and data.size == 1 else None

    def aligned(self, name: str, rank: int) -> tuple[int, ...]:
        """The shape of `name` right-aligned to `rank` dims (leading 1s), as broadcasts see it."""
        shape = self.shape(name)
        return (1,) * (rank - len(shape)) + shape if len(shape) <= rank else shape

    def axes(self, name: str) -> tuple[int, ...] | None:
        """The sorted, non-negative axes a matched Reduce* node reduces (None: it is a no-op)."""
        node = self.nodes[name]
        rank = len(self.work.tensors[node.inputs[0]].shape)
        given = node.inputs[1] if len(node.inputs) > 1 else None
        data = self.work.tensors[given].data if given is not None else node.attrs.get("axes")
        if data is None or np.size(data) == 0:
            empty_is_noop = attr_of(node, "noop_with_empty_axes", 0, self.work.opset)
            return None if empty_is_noop else tuple(range(rank))
        return tuple(sorted({int(a) % rank for a in np.asarray(data).reshape(-1)}))


# --- rules --------------------------------------------------------------------------------------

Guard = Callable[[Match], bool]
Template = Term | Callable[[Match], Term]


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    category: str
    pattern: Node
    replacement: Template
    guard: Guard | None = None
    dtypes: frozenset[str] | None = FLOAT  # dtypes the pattern's values may have; None: any
    enabling: bool = False  # no gain by itself: applied only where it enables a profitable rule
    source: str = "implied"  # "Table 4", "Figure 2", "implied", "export clean-up"
    note: str = ""
    example: Mapping[str, Any] = field(default_factory=dict)  # hints for the property tests
    replacement_text: str = ""

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"rule {self.name}: unknown category {self.category!r}")
        if not isinstance(self.pattern, Node):
            raise ValueError(f"rule {self.name}: a pattern must be rooted at an op")

    @property
    def root_ops(self) -> tuple[str, ...]:
        return self.pattern.ops

    @cached_property
    def depth(self) -> int:
        """Ops on the longest path from the root to a leaf."""
        return _depth(self.pattern)

    def describe(self) -> str:
        shown = str(self.replacement) if isinstance(self.replacement, Term) else "(computed)"
        target = self.replacement_text or shown
        return f"{self.pattern}  ->  {target}"


def _depth(term: Term) -> int:
    if isinstance(term, Node):
        return 1 + max((_depth(a) for a in term.args), default=0)
    if isinstance(term, Alt):
        return max(_depth(o) for o in term.options)
    return 0


_RULES: dict[str, Rule] = {}


def rule(name: str, category: str, pattern: Node, replacement: Template, **kwargs: Any) -> Rule:
    """Define and register a rule (names are unique across categories)."""
    made = Rule(name, category, pattern, replacement, **kwargs)
    if name in _RULES:
        raise ValueError(f"rule {name} registered twice")
    _RULES[name] = made
    return made


def registered() -> list[Rule]:
    return list(_RULES.values())


def variables(term: Term) -> Iterable[Var]:
    if isinstance(term, Var):
        yield term
    elif isinstance(term, Node):
        for a in term.args:
            yield from variables(a)
    elif isinstance(term, Alt):
        for o in term.options:
            yield from variables(o)
