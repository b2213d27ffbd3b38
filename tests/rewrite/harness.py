"""Random instances of a rule's pattern, built as ECGs, and their evaluation.

`Builder` walks a rule's pattern and makes one op per node, drawing what the pattern leaves open:
leaf shapes and values (per the rule's `example` family), parameter inputs (axes, shapes),
attributes (perms, keepdims, casts), and which alternative of a `one_of`/`alt` to use. In "wild"
mode it also draws what the rule's guard must refuse: other dtypes, constants that broadcast the
operand, zero divisors, negative scales, unrelated attribute values.

Graphs are evaluated with onnx's ReferenceEvaluator through `kiln.rewrite.export`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

from kiln.ecg import Graph, Op, Tensor, toposort
from kiln.ops import ShapeRule, annotate, known_ops, op_info
from kiln.rewrite import shapes
from kiln.rewrite.dsl import (BOOL, FLOAT, INTEGER, UNSIGNED, Alt, Fill, Node, Rule,
                              Term, Var)
from kiln.rewrite.export import run_reference

REDUCES = frozenset(name for name, info in known_ops().items()
                    if info.shape_rule is ShapeRule.REDUCE)


class Skip(Exception):
    """This draw cannot make a valid instance (the test assumes it away)."""


@dataclass
class Instance:
    graph: Graph
    feeds: dict[str, np.ndarray]


# --- drawing helpers --------------------------------------------------------------------------

def sub_shape(draw, base: tuple[int, ...], wild: bool = False) -> tuple[int, ...]:
    """A shape that broadcasts to `base` (some dims 1, some leading dims dropped); in wild mode
    sometimes one that broadcasts `base` to something larger."""
    if wild and base and draw(st.integers(0, 4)) == 0:
        extra = draw(st.integers(2, 3))
        return (extra, *base)
    keep = draw(st.integers(0, len(base)))
    shape = list(base[len(base) - keep:])
    for i in range(len(shape)):
        if draw(st.integers(0, 2)) == 0:
            shape[i] = 1
    return tuple(shape)


def base_shape(draw, min_rank: int = 0, max_rank: int = 3, max_side: int = 4) -> tuple[int, ...]:
    rank = draw(st.integers(min_rank, max_rank))
    return tuple(draw(st.integers(1, max_side)) for _ in range(rank))


def values(rng: np.random.Generator, shape, dtype: str, domain: str) -> np.ndarray:
    kind = np.dtype(dtype).kind
    if domain == "wild":  # zeros, signs, fractions: what guards on constants must look at
        data = rng.choice([0.0, -1.0, 1.0, 0.5, -2.0, 2.5, 3.0], size=shape)
        return np.asarray(data).astype(dtype)
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind == "u":
        if domain == "shift":
            return rng.integers(0, 4, size=shape).astype(dtype)
        low = 1 if domain in ("pos", "away") else 0
        return rng.integers(low, 16, size=shape).astype(dtype)
    if kind == "i":
        if domain == "pos":
            return rng.integers(1, 5, size=shape).astype(dtype)
        data = rng.integers(-4, 5, size=shape)
        if domain == "away":
            data = np.where(data == 0, 1, data)
        return data.astype(dtype)
    if domain == "pos":
        data = rng.uniform(0.5, 2.0, size=shape)
    elif domain == "neg":
        data = -rng.uniform(0.5, 2.0, size=shape)
    elif domain == "any":
        data = rng.uniform(-2.0, 2.0, size=shape)
    else:  # signed, away from zero
        data = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return np.asarray(data, dtype=dtype)


def dtype_for(draw, rule: Rule, wild: bool) -> str:
    allowed = rule.dtypes
    if wild and draw(st.booleans()):
        return draw(st.sampled_from(["float32", "float64", "int32", "int64", "uint32", "bool"]))
    if allowed is None or allowed & FLOAT:
        return "float32"
    if allowed == BOOL:
        return "bool"
    if allowed <= UNSIGNED:
        return draw(st.sampled_from(["uint32", "uint64"]))
    if allowed <= INTEGER:
        return draw(st.sampled_from(["int32", "int64"]))
    return "float32"


# --- the builder --------------------------------------------------------------------------------

@dataclass
class Plan:
    """What a family decided before the walk: leaf shapes, dtypes and domains, and hooks."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)
    data: dict[str, np.ndarray] = field(default_factory=dict)  # fixed leaf values
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by node name or op type
    params: dict[str, Any] = field(default_factory=dict)  # param var -> array | None | callable
    picks: dict[str, str] = field(default_factory=dict)  # node name -> op type
    const: set[str] = field(default_factory=set)  # "any" leaves to make constant
    reduce_axes: tuple[int, ...] | None = None
    keepdims: int | None = None
    alt: int | None = None  # which option of every `alt` to build
    perm: Callable[[Any, tuple[int, ...]], list[int]] | None = None  # Transpose perms


class Builder:
    def __init__(self, draw, rule: Rule, plan: Plan, dtype: str, wild: bool):
        self.draw, self.rule, self.plan, self.dtype, self.wild = draw, rule, plan, dtype, wild
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.bound: dict[str, str | None] = {}
        self.named = _named_nodes(rule.pattern)
        self.domains = {**_auto_domains(rule.pattern), **rule.example.get("domain", {}),
                        **plan.domains}

    def instance(self) -> Instance:
        out = self.term(self.rule.pattern, None)
        bare = toposort(self.ops, list(self.tensors))
        draft = Graph(self.tensors, bare, self.inputs, [out], 21, "instance")
        return Instance(draft.with_ops([annotate(op, draft) for op in bare]), self.feeds)

    # leaves
    def new_id(self) -> str:
        return f"t{len(self.tensors)}"

    def leaf(self, var: Var, dtype: str | None) -> str | None:
        if var.name in self.bound:
            return self.bound[var.name]
        if var.name in self.named:  # a node referenced by name before its definition
            return self.term(self.named[var.name], dtype)
        plan = self.plan
        if var.kind == "opt" and var.name not in plan.shapes:
            self.bound[var.name] = None
            return None
        shape = plan.shapes.get(var.name, ())
        dtype = plan.dtypes.get(var.name) or dtype or self.dtype
        const = var.kind in ("const", "param") or var.name in plan.const
        if var.name in plan.data:
            data = np.asarray(plan.data[var.name])
            shape, dtype = data.shape, data.dtype.name
        else:
            data = values(self.rng, shape, dtype, self.domains.get(var.name, "signed"))
        tid = self.new_id()
        if const:
            self.tensors[tid] = Tensor(tid, tuple(shape), dtype, var.name, np.asarray(data))
        else:
            self.tensors[tid] = Tensor(tid, tuple(shape), dtype, var.name)
            self.inputs.append(tid)
            self.feeds[tid] = np.asarray(data, dtype=dtype)
        self.bound[var.name] = tid
        return tid

    def constant(self, data: np.ndarray) -> str:
        tid = self.new_id()
        self.tensors[tid] = Tensor(tid, tuple(data.shape), data.dtype.name, "", data)
        return tid

    # terms
    def term(self, term: Term, dtype: str | None) -> str | None:
        if isinstance(term, Var):
            return self.leaf(term, dtype)
        if isinstance(term, Fill):
            shape = self.plan.shapes.get(f"fill{term.value:g}", ())
            dtype = dtype or self.dtype
            if np.dtype(dtype).kind in "iub" and (term.value != int(term.value) or
                                                  (term.value < 0 and np.dtype(dtype).kind != "i")):
                raise Skip(f"{term.value} is not a {dtype}")
            return self.constant(np.full(shape, term.value, dtype=dtype))
        if isinstance(term, Alt):
            index = self.plan.alt if self.plan.alt is not None else \
                self.draw(st.integers(0, len(term.options) - 1))
            return self.term(term.options[index], dtype)
        assert isinstance(term, Node)
        if term.name is not None and term.name in self.bound:
            return self.bound[term.name]
        key = term.name or ("root" if term is self.rule.pattern else "")
        op_type = self.plan.picks.get(key) or self.draw(st.sampled_from(term.ops))
        refs: list[str | None] = []
        for position, arg in enumerate(term.args):
            if isinstance(arg, Var) and arg.kind == "param":
                refs.append(self.param(arg, op_type, term, refs))
            elif isinstance(arg, Fill):
                refs.append(None)  # after the others, in their dtype
            else:
                refs.append(self.term(arg, self.arg_dtype(op_type, position, dtype)))
        sibling = next((self.tensors[r].dtype for r in refs if r is not None), dtype or self.dtype)
        for position, arg in enumerate(term.args):
            if isinstance(arg, Fill):
                refs[position] = self.term(arg, sibling)
        kinds = {np.dtype(self.tensors[r].dtype).kind for r in refs[:2] if r is not None}
        if op_type in ("And", "Or", "Xor", "Not") and kinds != {"b"}:
            raise Skip(f"{op_type} needs bool operands")
        if op_type.startswith("Bitwise") and not kinds <= {"i", "u"}:
            raise Skip(f"{op_type} needs integer operands")
        attrs = self.attrs(op_type, term, refs)
        if len(refs) == 2 and (op_info(op_type).symmetric or term.any_order) and self.draw(st.booleans()):
            refs.reverse()  # the pattern must match in either operand order
        while refs and refs[-1] is None:
            refs.pop()
        infos = [None if r is None else self.tensors[r] for r in refs]
        try:
            shape, out_dtype = shapes.infer(op_type, infos, attrs)
        except shapes.ShapeError as exc:
            raise Skip(str(exc)) from exc
        tid = self.new_id()
        self.tensors[tid] = Tensor(tid, shape, out_dtype)
        self.ops.append(Op(f"op{len(self.ops)}", op_type, tuple(refs), (tid,), attrs))
        if term.name is not None:
            self.bound[term.name] = tid
        return tid

    def arg_dtype(self, op_type: str, position: int, dtype: str | None) -> str | None:
        if op_type == "Where" and position == 0:
            return "bool"
        if op_type in ("Gather",) and position == 1:
            return "int64"
        return None

    def attrs(self, op_type: str, term: Node, refs: list[str | None]) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        first = self.tensors[refs[0]] if refs and refs[0] is not None else None
        draw = self.draw
        if op_type in REDUCES or op_type in ("ArgMax", "ArgMin"):
            keep = self.plan.keepdims
            attrs["keepdims"] = draw(st.sampled_from([0, 1])) if keep is None else keep
            if op_type in ("ArgMax", "ArgMin"):
                rank = len(first.shape)
                attrs["axis"] = draw(st.integers(-rank, rank - 1)) if rank else 0
                attrs["select_last_index"] = draw(st.sampled_from([0, 1]))
        elif op_type == "Transpose":
            rank = len(first.shape)
            attrs["perm"] = (self.plan.perm(draw, first.shape) if self.plan.perm else
                             list(draw(st.permutations(list(range(rank))))))
        elif op_type == "Cast":
            attrs["to"] = _onnx_type(draw(st.sampled_from(["float32", "float64", "int32",
                                                            "int64", "float16"])))
        elif op_type in ("Softmax", "LogSoftmax"):
            rank = len(first.shape)
            attrs["axis"] = draw(st.integers(-rank, rank - 1))
        elif op_type == "LeakyRelu":
            attrs["alpha"] = draw(st.sampled_from([0.0, 0.1, 0.5] + ([-0.2] if self.wild else [])))
        elif op_type == "Gemm":
            pass  # the gemm families set transA/transB/alpha/beta
        for key, want in term.attrs.items():
            if not callable(want):
                attrs[key] = want
        attrs.update(self.plan.attrs.get(op_type, {}))
        attrs.update(self.plan.attrs.get(term.name or "", {}))
        return attrs

    def param(self, var: Var, op_type: str, term: Node, refs: list[str | None]) -> str | None:
        if var.name in self.bound:
            return self.bound[var.name]
        data_shape = self.tensors[refs[0]].shape if refs and refs[0] is not None else ()
        given = self.plan.params.get(var.name, _MISSING)
        if given is _MISSING:
            given = self.default_param(op_type, data_shape)
        elif callable(given):
            given = given(self, data_shape)
        if given is None:
            self.bound[var.name] = None
            return None
        tid = self.constant(np.asarray(given))
        self.bound[var.name] = tid
        return tid

    def default_param(self, op_type: str, shape: tuple[int, ...]):
        draw, rank = self.draw, len(shape)
        if op_type in REDUCES:
            axes = self.plan.reduce_axes
            if axes is None:
                if rank == 0:
                    raise Skip("reduction of a scalar")
                axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
            if len(axes) == rank and draw(st.booleans()):
                return None  # omitted: reduce everything
            return np.asarray([a - rank if draw(st.booleans()) else a for a in axes], np.int64)
        if op_type == "Reshape":
            return np.asarray(random_factorization(draw, math.prod(shape)), np.int64)
        if op_type in ("Flatten", "Transpose"):
            return None  # no parameter input
        if op_type == "Squeeze":
            ones = [i for i, d in enumerate(shape) if d == 1]
            if not ones:
                raise Skip("nothing to squeeze")
            return np.asarray(sorted(draw(st.sets(st.sampled_from(ones), min_size=1))), np.int64)
        if op_type == "Unsqueeze":
            return np.asarray([draw(st.integers(0, rank))], np.int64)
        if op_type == "Expand":
            target = self.plan.params.get("expand_to")
            return np.asarray(target if target is not None else shape, np.int64)
        raise Skip(f"no parameter rule for {op_type}")


_MISSING = object()


def random_factorization(draw, n: int) -> list[int]:
    """A shape with `n` elements, rank 1 to 4 (dims of 1 included)."""
    dims = []
    rest = n
    for _ in range(draw(st.integers(0, 3))):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        rest //= d
    dims.append(rest)
    return dims


def _onnx_type(dtype: str) -> int:
    from onnx import helper
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _named_nodes(term: Term, found: dict[str, Node] | None = None) -> dict[str, Node]:
    found = {} if found is None else found
    if isinstance(term, Node):
        if term.name is not None:
            found.setdefault(term.name, term)
        for a in term.args:
            _named_nodes(a, found)
    elif isinstance(term, Alt):
        for o in term.options:
            _named_nodes(o, found)
    return found


_POSITIVE_UNDER = {"Sqrt", "Log"}
_AWAY_UNDER = {"Reciprocal"}


def _auto_domains(term: Term, out: dict[str, str] | None = None) -> dict[str, str]:
    """Leaves directly under Sqrt/Log are positive; under Reciprocal or a divisor, away from 0."""
    out = {} if out is None else out
    if isinstance(term, Node):
        for position, a in enumerate(term.args):
            if isinstance(a, Var):
                if set(term.ops) & _POSITIVE_UNDER:
                    out[a.name] = "pos"
                elif set(term.ops) & _AWAY_UNDER or (term.ops == ("Div",) and position == 1):
                    out.setdefault(a.name, "away")
            _auto_domains(a, out)
    elif isinstance(term, Alt):
        for o in term.options:
            _auto_domains(o, out)
    return out


# --- evaluation ---------------------------------------------------------------------------------

def evaluate(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return run_reference(graph, {t: feeds[t] for t in graph.inputs})


def assert_close(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-4,
                 atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
        else:
            scale = float(np.max(np.abs(w), initial=0.0)) if np.all(np.isfinite(w)) else 1.0
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol + rtol * scale)


def check_ecg(before: Graph, after: Graph) -> None:
    """What every rewritten graph must be: a valid, annotated, topologically ordered ECG with the
    same outputs, fresh ids for new tensors, and nothing dead."""
    assert after.outputs == before.outputs
    assert after.inputs == before.inputs
    for t in after.outputs:
        assert after.tensors[t].shape == before.tensors[t].shape
        assert after.tensors[t].dtype == before.tensors[t].dtype
    available = [t for t, v in after.tensors.items() if v.is_constant] + list(after.inputs)
    assert [op.id for op in toposort(after.ops, available)] == [op.id for op in after.ops]
    for op in after.ops:
        assert _same_annotation(annotate(op, after), op), op.id
        for t in op.outputs:
            assert t in after.tensors
    for t, tensor in after.tensors.items():
        if t in before.tensors and before.tensors[t].source_name:
            continue
        if t not in before.tensors:
            assert tensor.source_name == "", f"new tensor {t} reuses a model name"
        if tensor.is_constant:
            assert tensor.data.shape == tensor.shape and tensor.data.dtype.name == tensor.dtype, t
    used = {t for op in after.ops for t in op.present_inputs()} | set(after.outputs)
    for op in after.ops:
        assert any(t in used for t in op.outputs), f"dead op {op.id}"
    for t, tensor in after.tensors.items():
        assert t in used or t in after.inputs or any(t in op.outputs for op in after.ops), \
            f"unused tensor {t}"


def _same_annotation(a: Op, b: Op) -> bool:
    return (a.mapping, a.compute_intensive, a.properties, a.flops, a.bytes) == \
        (b.mapping, b.compute_intensive, b.properties, b.flops, b.bytes)


Family = Callable[[Any, Rule, bool], Plan]


# --- graphs by hand -----------------------------------------------------------------------------

class G:
    """A small ECG written op by op: `x = g.input((2, 3)); y = g.op("Mul", x, g.const(2.0))`."""

    def __init__(self):
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []

    def _id(self) -> str:
        return f"t{len(self.tensors)}"

    def input(self, shape, dtype: str = "float32") -> str:
        tid = self._id()
        self.tensors[tid] = Tensor(tid, tuple(shape), dtype, f"in{len(self.inputs)}")
        self.inputs.append(tid)
        return tid

    def const(self, value, dtype: str = "float32") -> str:
        data = np.asarray(value, dtype=dtype)
        tid = self._id()
        self.tensors[tid] = Tensor(tid, data.shape, data.dtype.name, "", data)
        return tid

    def op(self, op_type: str, *inputs: str | None, **attrs) -> str:
        infos = [None if t is None else self.tensors[t] for t in inputs]
        shape, dtype = shapes.infer(op_type, infos, attrs)
        tid = self._id()
        self.tensors[tid] = Tensor(tid, shape, dtype)
        self.ops.append(Op(f"op{len(self.ops)}", op_type, tuple(inputs), (tid,), attrs))
        return tid

    def graph(self, *outputs: str) -> Graph:
        draft = Graph(self.tensors, self.ops, self.inputs, outputs, 21, "handmade")
        return draft.with_ops([annotate(op, draft) for op in self.ops])
