"""Tensor expressions (Souffle §3, §5): each op of the ECG lowered to TEs — one per output — with
their iteration domain, the index function from an output element to the input elements it reads,
and the analysis the Souffle partitioner works from:

* §5.2 element-wise dependence: a TE without reduction axes is *one-relies-on-one*, its index
  function a quasi-affine map `M·v + c` from the output index to the input index (`IndexMap`);
  a TE with reduction axes is *one-relies-on-many*, described by the extents of its reduction
  axes and the region of each input it reads (`Region`);
* §5.3 characterisation: compute- or memory-intensive by the ratio of arithmetic operations to
  tensor elements read and written (threshold 3, the paper's). The operations are the op's FLOPs
  from its record, which weigh a transcendental function or a normalisation's statistics as 8
  per element; so Gelu, Exp or LayerNormalization, one op in Kiln but several one-op TEs in
  Souffle, come out compute-intensive (on a CPU a vectorised erf is tens of instructions). They
  are partition candidates then, but with a row tile as working set they rarely split;
* §5.1 reuse: the tensors read by more than one TE, split into spatial reuse (the TEs are
  independent: horizontal transformation, §6.1) and temporal reuse (one depends on the other);
* §6.2 vertical composition: `IndexMap.then` composes the maps of a chain of one-relies-on-one
  TEs into one map (the paper's Eq. 2), so the chain is one TE reading its source directly.

Index functions are not written per op: they are read off the op itself. An op whose output holds
its input's values (`ValueFlow` in its record: Reshape, Transpose, Slice, Expand, Gather with
constant indices, ...) is evaluated once on an input whose every element holds its own offset,
and the map is fitted to where each output element came from (`probe_map`); an elementwise op
(One-to-One or One-to-Many by broadcasting) reads its inputs at numpy's broadcast index. The fit
is *quasi-affine* as in the paper's polyhedral notation: when no matrix maps the output index to
the input index (a Reshape that merges dims), output dims are split into digits (`k = 64·k₁ + k₂`,
floor division and modulo by constants) until one does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kiln import fold
from kiln.ecg import Graph, Op
from kiln.errors import ModelError
from kiln.mapping import MappingType
from kiln.ops import RowLocality, ValueFlow, op_info
from kiln.rewrite.export import EXPORT_OPSET, node_from

COMPUTE_RATIO = 3.0  # §5.3: fewer operations per element read or written: memory-intensive
MAX_PROBE_ELEMENTS = 1 << 22  # larger tensors are not probed (their maps stay unknown)
_EXACT_DTYPES = {"float32": 1 << 24, "float64": 1 << 53, "int32": 1 << 31, "int64": 1 << 62}


# --- quasi-affine index maps --------------------------------------------------------------------

@dataclass(frozen=True)
class IndexMap:
    """Input index = M·r + c, r the output index with output dim d split into the digits
    `split[d]` (outermost first; `(n,)` for an unsplit dim of extent n)."""

    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    split: tuple[tuple[int, ...], ...]
    matrix: tuple[tuple[int, ...], ...]  # len(in_shape) rows × len(domain) columns
    offset: tuple[int, ...]

    @property
    def domain(self) -> tuple[int, ...]:
        """The refined iteration domain: one variable per digit."""
        return tuple(f for digits in self.split for f in digits)

    @property
    def is_affine(self) -> bool:
        """No dim is split: the map is `M·v + c` on the output index itself."""
        return all(len(digits) == 1 for digits in self.split)

    @classmethod
    def affine(cls, out_shape, in_shape, matrix, offset) -> IndexMap:
        out_shape = tuple(out_shape)
        return cls(out_shape, tuple(in_shape), tuple((n,) for n in out_shape),
                   tuple(tuple(int(x) for x in row) for row in np.asarray(matrix).reshape(
                       len(in_shape), len(out_shape))),
                   tuple(int(x) for x in offset))

    def apply(self, index: tuple[int, ...]) -> tuple[int, ...]:
        refined = _digits(index, self.split)
        return tuple(int(sum(m * r for m, r in zip(row, refined)) + c)
                     for row, c in zip(self.matrix, self.offset))

    def table(self) -> np.ndarray:
        """The input index of every output element: shape out_shape + (len(in_shape),)."""
        grid = _grid(self.domain)
        matrix = np.asarray(self.matrix, dtype=np.int64).reshape(len(self.in_shape), -1)
        values = matrix @ grid + np.asarray(self.offset, dtype=np.int64)[:, None]
        return values.T.reshape(*self.out_shape, len(self.in_shape))

    def then(self, inner: IndexMap) -> IndexMap | None:
        """The map of the two TEs as one (§6.2, Eq. 2): `self` maps this TE's output to its input,
        which `inner` (the producer's TE) maps to the producer's input. Affine maps compose as
        matrices, M = M_inner·M_self and c = M_inner·c_self + c_inner; with split dims the
        composition is fitted again, and None when no quasi-affine map fits it."""
        assert self.in_shape == inner.out_shape, (self.in_shape, inner.out_shape)
        if self.is_affine and inner.is_affine:
            m_self, m_inner = _matrix(self), _matrix(inner)
            return IndexMap.affine(self.out_shape, inner.in_shape, m_inner @ m_self,
                                   m_inner @ np.asarray(self.offset, dtype=np.int64)
                                   + np.asarray(inner.offset, dtype=np.int64))
        mid = self.table()
        refined = _digits_array(mid, inner.split)
        values = np.tensordot(refined, _matrix(inner).T, axes=1) + np.asarray(inner.offset)
        return fit(values, self.out_shape, inner.in_shape)

    def __str__(self) -> str:
        return f"M={[list(r) for r in self.matrix]} c={list(self.offset)} split={list(self.split)}"


def _grid(domain: tuple[int, ...]) -> np.ndarray:
    """Every index of `domain`, one column each (a rank-0 domain has one, empty, index)."""
    return np.indices(domain, dtype=np.int64).reshape(len(domain), math.prod(domain))


def _matrix(m: IndexMap) -> np.ndarray:
    return np.asarray(m.matrix, dtype=np.int64).reshape(len(m.in_shape), len(m.domain))


def _digits(index: tuple[int, ...], split: tuple[tuple[int, ...], ...]) -> list[int]:
    refined = []
    for value, digits in zip(index, split):
        parts = []
        for f in reversed(digits):
            parts.append(value % f)
            value //= f
        refined += reversed(parts)
    return refined


def _digits_array(values: np.ndarray, split: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """`_digits` of every index in `values` (last axis: the index)."""
    columns = []
    for d, digits in enumerate(split):
        value = values[..., d]
        parts = []
        for f in reversed(digits):
            parts.append(value % f)
            value = value // f
        columns += reversed(parts)
    return np.stack(columns, axis=-1) if columns else np.zeros(values.shape[:-1] + (0,), np.int64)


def fit(values: np.ndarray, out_shape: tuple[int, ...], in_shape: tuple[int, ...]
        ) -> IndexMap | None:
    """The quasi-affine map whose table is `values` (out_shape + (len(in_shape),)), or None."""
    out_shape, in_shape = tuple(out_shape), tuple(in_shape)
    values = np.asarray(values, dtype=np.int64).reshape(*out_shape, len(in_shape))
    if math.prod(out_shape) == 0:
        return IndexMap.affine(out_shape, in_shape, np.zeros((len(in_shape), len(out_shape))),
                               np.zeros(len(in_shape)))
    origin = values[(0,) * len(out_shape)]
    split = []
    for d, n in enumerate(out_shape):
        line = values[tuple(slice(None) if i == d else 0 for i in range(len(out_shape)))]
        digits = _split_line(line - origin)
        if digits is None:
            return None
        split.append(digits)
    domain = tuple(f for digits in split for f in digits)
    refined = _grid(domain).T
    columns = []
    for j in range(len(domain)):
        unit = [0] * len(domain)
        unit[j] = 1 if domain[j] > 1 else 0
        columns.append(values[tuple(_undigit(unit, split))] - origin)
    matrix = np.stack(columns, axis=1) if columns else np.zeros((len(in_shape), 0), np.int64)
    predicted = refined @ matrix.T + origin
    if not np.array_equal(predicted, values.reshape(math.prod(out_shape), len(in_shape))):
        return None
    return IndexMap(out_shape, in_shape, tuple(split),
                    tuple(tuple(int(x) for x in row) for row in matrix),
                    tuple(int(x) for x in origin))


def _undigit(refined: list[int], split: list[tuple[int, ...]]) -> list[int]:
    index, k = [], 0
    for digits in split:
        value = 0
        for f in digits:
            value = value * f + refined[k]
            k += 1
        index.append(value)
    return index


def _split_line(line: np.ndarray) -> tuple[int, ...] | None:
    """Digits (outermost first) under which the input index along one output dim is affine:
    line[k] for k = q·f + r must be line[r] + q·line[f]."""
    n = len(line)
    if n <= 2 or np.array_equal(line, np.arange(n)[:, None] * line[1]):
        return (n,)
    for f in range(2, n):
        if n % f:
            continue
        k = np.arange(n)
        if np.array_equal(line, line[k % f] + (k // f)[:, None] * line[f]):
            inner = _split_line(line[:f])
            if inner is not None:
                return (n // f, *inner)
    return None


def broadcast_map(out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> IndexMap:
    """numpy broadcasting: the input's trailing dims follow the output's, size-1 dims read 0."""
    lead = len(out_shape) - len(in_shape)
    matrix = np.zeros((len(in_shape), len(out_shape)), dtype=np.int64)
    for i, n in enumerate(in_shape):
        if n != 1:
            matrix[i, lead + i] = 1
    return IndexMap.affine(out_shape, in_shape, matrix, np.zeros(len(in_shape)))


# --- tensor expressions -------------------------------------------------------------------------

class Dependence(Enum):
    ONE_RELIES_ON_ONE = "one-relies-on-one"
    ONE_RELIES_ON_MANY = "one-relies-on-many"


@dataclass(frozen=True)
class Region:
    """What a one-relies-on-many TE reads of one input for one output element: the input dims
    indexed by reduction variables (None: not analysed, the whole input)."""

    tensor: str
    reduced_dims: tuple[int, ...] | None


@dataclass(frozen=True)
class TensorExpr:
    op: str
    output: str
    domain: tuple[int, ...]  # iteration domain: the output shape
    reduction: tuple[int, ...]  # extents of the reduction axes (empty: one-relies-on-one)
    maps: dict[str, IndexMap | None]  # one-relies-on-one: input tensor -> map (None: unknown)
    regions: tuple[Region, ...]  # one-relies-on-many: what each input is read over
    arithmetic: int  # arithmetic operations (the op's FLOPs, shared among its outputs)
    elements: int  # tensor elements read and written

    @property
    def dependence(self) -> Dependence:
        return Dependence.ONE_RELIES_ON_MANY if self.reduction or self.regions else \
            Dependence.ONE_RELIES_ON_ONE

    @property
    def ratio(self) -> float:
        return self.arithmetic / max(1, self.elements)

    @property
    def compute_intensive(self) -> bool:
        return self.ratio >= COMPUTE_RATIO


@dataclass(frozen=True)
class Reuse:
    tensor: str
    readers: tuple[str, ...]  # op ids of the TEs reading it
    spatial: bool  # some two readers are independent (§6.1 may load the tensor once for both)
    temporal: bool  # some reader depends on another (§6.5: keep the tensor on chip between them)


@dataclass
class TEProgram:
    graph: Graph
    exprs: dict[str, TensorExpr]  # by output tensor
    by_op: dict[str, tuple[TensorExpr, ...]]
    reuse: tuple[Reuse, ...]

    def compute_intensive(self, op: Op) -> bool:
        return any(te.compute_intensive for te in self.by_op.get(op.id, ()))

    def one_relies_on_one(self, op: Op) -> bool:
        exprs = self.by_op.get(op.id, ())
        return bool(exprs) and all(te.dependence is Dependence.ONE_RELIES_ON_ONE for te in exprs)

    def chain_map(self, chain: list[str]) -> IndexMap | None:
        """The composed map of a chain of tensors t₀ → t₁ → … → tₙ, each computed by a
        one-relies-on-one TE from the one before: tₙ's index to t₀'s (§6.2)."""
        composed = None
        for source, target in reversed(list(zip(chain, chain[1:]))):
            step = self.exprs[target].maps.get(source)
            if step is None:
                return None
            composed = step if composed is None else composed.then(step)
            if composed is None:
                return None
        return composed


def lower_program(graph: Graph) -> TEProgram:
    """Every op of the graph as TEs, with the reuse analysis of §5.1."""
    exprs: dict[str, TensorExpr] = {}
    by_op: dict[str, tuple[TensorExpr, ...]] = {}
    for op in graph.ops:
        lowered = tuple(lower_op(graph, op))
        by_op[op.id] = lowered
        exprs.update((te.output, te) for te in lowered)
    return TEProgram(graph, exprs, by_op, tuple(_reuse(graph)))


def lower_op(graph: Graph, op: Op) -> list[TensorExpr]:
    info = op_info(op.op_type)
    inputs = graph.activation_inputs(op)
    elements = sum(graph.tensors[t].numel for t in (*op.present_inputs(), *op.outputs))
    share = max(1, len(op.outputs))
    found = []
    for position, out in enumerate(op.outputs):
        shape = graph.tensors[out].shape
        common = dict(op=op.id, output=out, domain=shape, arithmetic=op.flops // share,
                      elements=elements)
        if op.mapping is MappingType.MANY_TO_MANY or info.opaque:
            found.append(TensorExpr(reduction=_reduction(graph, op), maps={},
                                    regions=_regions(graph, op), **common))
            continue
        maps: dict[str, IndexMap | None] = {}
        for t in inputs:
            if info.value_flow is ValueFlow.NONE:
                maps[t] = broadcast_map(shape, graph.tensors[t].shape) if _broadcasts(
                    graph.tensors[t].shape, shape) else None
            else:
                maps[t] = probe_map(graph, op, t, position)
        found.append(TensorExpr(reduction=(), maps=maps, regions=(), **common))
    return found


def _broadcasts(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    if len(in_shape) > len(out_shape):
        return False
    tail = out_shape[len(out_shape) - len(in_shape):]
    return all(a in (1, b) for a, b in zip(in_shape, tail))


def _reduction(graph: Graph, op: Op) -> tuple[int, ...]:
    """Extents of a one-relies-on-many TE's reduction axes: for row-local ops the reduced
    trailing dims (or a contraction's K), else what each output element reads on average."""
    first = graph.tensors[op.inputs[0]] if op.inputs and op.inputs[0] else None
    rows = _reduced_dims(graph, op)
    if first is not None and rows is not None:
        return tuple(first.shape[d] for d in rows) or (1,)
    out = sum(graph.tensors[t].numel for t in op.outputs)
    reads = sum(graph.tensors[t].numel for t in graph.activation_inputs(op))
    return (max(1, reads // max(1, out)),)


def _reduced_dims(graph: Graph, op: Op) -> tuple[int, ...] | None:
    """The dims of the first input indexed by reduction variables, from the op's row locality."""
    locality = op_info(op.op_type).row_locality
    if locality is RowLocality.NONE or not op.inputs or op.inputs[0] is None:
        return None
    rank = len(graph.tensors[op.inputs[0]].shape)
    if rank == 0:
        return None
    if locality is RowLocality.MATRIX_ROWS:
        return (rank - 1,) if not op.attrs.get("transA", 0) else (rank - 2,)
    if locality is RowLocality.REDUCED_AXES:
        axes = op.inputs[1] if len(op.inputs) > 1 else None
        if axes is None or not graph.is_constant(axes):
            return None
        return tuple(sorted(int(a) % rank for a in graph.tensors[axes].data.reshape(-1)))
    first = int(op.attrs.get("axis", -1)) % rank
    return (first,) if locality is RowLocality.LAST_AXIS else tuple(range(first, rank))


def _regions(graph: Graph, op: Op) -> tuple[Region, ...]:
    dims = _reduced_dims(graph, op)
    return tuple(Region(t, dims if t == op.inputs[0] else None)
                 for t in graph.activation_inputs(op))


_PROBES: dict[tuple, np.ndarray | None] = {}
MAX_CACHED_PROBES = 4096


def _probe(op: Op, graph: Graph, position: int, source: str, base: int) -> np.ndarray | None:
    """Output `position` of the op evaluated with input `source` holding `base` + its offsets and
    its other runtime inputs zeros. Cached by op type, attributes, shapes and constant inputs."""
    tensors = [graph.tensors[t] if t is not None else None for t in op.inputs]
    key = (op.op_type, repr(sorted(op.attrs.items())), position, op.inputs.index(source), base,
           graph.tensors[source].dtype,
           tuple(None if t is None else (t.shape, t.data.tobytes() if t.is_constant and
                                        t.id != source else None) for t in tensors))
    if key in _PROBES:
        return _PROBES[key]
    dtype = graph.tensors[source].dtype
    feeds: list[np.ndarray | None] = []
    for t in tensors:
        if t is None:
            feeds.append(None)
        elif t.id == source:
            feeds.append((np.arange(t.numel) + base).astype(dtype).reshape(t.shape))
        elif t.is_constant:
            feeds.append(t.data)
        else:
            feeds.append(np.zeros(t.shape, dtype=dtype))
    names = [f"in{i}" if f is not None else "" for i, f in enumerate(feeds)]
    node = node_from(op.op_type, names, [f"out{i}" for i in range(len(op.outputs))], op.attrs)
    try:
        found = np.asarray(fold.evaluate(node, feeds, graph.opset or EXPORT_OPSET)[position])
    except (ModelError, IndexError, ValueError):
        found = None
    if len(_PROBES) >= MAX_CACHED_PROBES:
        _PROBES.clear()
    _PROBES[key] = found
    return found


def probe_map(graph: Graph, op: Op, tensor: str, position: int) -> IndexMap | None:
    """The quasi-affine map from output `position` of `op` to input `tensor`, read off the op's
    own evaluation; None when the op is not a pure reindexing of that input (a runtime index
    input, elements from elsewhere, a dtype that cannot hold offsets, a tensor too large)."""
    source = graph.tensors[tensor]
    out = graph.tensors[op.outputs[position]]
    limit = _EXACT_DTYPES.get(source.dtype)
    if limit is None or max(source.numel, out.numel) > min(limit, MAX_PROBE_ELEMENTS):
        return None
    others_runtime = any(t is not None and t != tensor and not graph.is_constant(t)
                         for t in op.inputs)
    if others_runtime and op_info(op.op_type).value_flow is ValueFlow.FIRST_INPUT:
        return None
    # Two evaluations, the offsets shifted by 1 and by 3: an element that moved with the input
    # differs by 2 between them; one from elsewhere (a pad value, another input) does not.
    first, second = (_probe(op, graph, position, tensor, base) for base in (1, 3))
    if first is None or second is None or first.shape != out.shape or second.shape != out.shape:
        return None
    if not np.array_equal(second.astype(np.int64) - first.astype(np.int64), np.full(out.shape, 2)):
        return None
    offsets = first.astype(np.int64) - 1
    if np.any(offsets < 0) or np.any(offsets >= max(1, source.numel)):
        return None
    values = np.stack(np.unravel_index(offsets.reshape(-1), source.shape), axis=-1) \
        if source.shape else np.zeros((offsets.size, 0), np.int64)
    return fit(values.reshape(*out.shape, len(source.shape)), out.shape, source.shape)


def _reuse(graph: Graph) -> list[Reuse]:
    """§5.1: tensors read by more than one TE; spatial when no reader depends on another."""
    below = _descendants(graph)
    found = []
    for t in graph.tensors:
        readers = graph.consumers(t)
        if len(readers) < 2:
            continue
        pairs = [_depends(below, graph, a, b) or _depends(below, graph, b, a)
                 for i, a in enumerate(readers) for b in readers[i + 1:]]
        found.append(Reuse(t, tuple(op.id for op in readers), not all(pairs), any(pairs)))
    return found


def _depends(below: dict[str, int], graph: Graph, first: Op, then: Op) -> bool:
    return bool((below[first.id] >> graph.order[then.id]) & 1)


def _descendants(graph: Graph) -> dict[str, int]:
    """For every op, the set of ops that depend on it, as a bitmask over topological positions."""
    below: dict[str, int] = {}
    for op in reversed(graph.ops):
        mask = 0
        for nxt in graph.successors(op):
            mask |= below[nxt.id] | (1 << graph.order[nxt.id])
        below[op.id] = mask
    return below
