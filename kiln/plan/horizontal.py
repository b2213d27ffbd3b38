"""Souffle's horizontal transformation (§6.1) as a graph transformation: independent TEs that read
the same input become one TE whose output is their outputs concatenated.

For contractions with a constant operand (MatMul and Gemm over weights, Conv with group 1) that
read the same activation — BERT's Q, K and V projections, parallel 1×1 branches of a convnet —
the weights are concatenated into one constant and one contraction computes every branch; each
branch's result is a Slice of the merged output, a one-relies-on-one TE whose map is an offset
(`IndexMap` with c = the branch's start), so a consumer in the same kernel reads the merged
buffer in place. Elementwise TEs that follow every branch alike (a bias Add, a Relu) are merged
too, their constant operands concatenated along the same axis, so the slices come after them.

The result is an ordinary ECG (ONNX-equivalent: `kiln.rewrite.export.to_onnx` runs it) whose
model inputs and outputs are unchanged; every tensor a branch produced keeps its id, now the
output of its Slice, so nothing downstream changes.

What is concatenated where is op-specific (a contraction's output-channel axis), so each op type
that can be merged registers it (`@concatenable`), as the code generator registers lowerings.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from kiln.ecg import Graph, Op, Tensor
from kiln.mapping import MappingType
from kiln.ops import ShapeRule, ValueFlow, op_info
from kiln.rewrite.engine import Work


@dataclass(frozen=True)
class Concat:
    """How branches of one op type concatenate: the constant input and its axis that grow with
    the output, an optional 1-D bias input, and the output axis."""

    weight: int
    weight_axis: int
    bias: int | None
    out_axis: int


_RULES: dict[str, Callable[[Op, Graph], Concat | None]] = {}


def concatenable(op_type: str):
    def register(rule: Callable[[Op, Graph], Concat | None]):
        _RULES[op_type] = rule
        return rule
    return register


@concatenable("MatMul")
def _matmul(op: Op, graph: Graph) -> Concat | None:
    b = graph.tensors[op.inputs[1]]
    a = graph.tensors[op.inputs[0]]
    if not b.is_constant or len(b.shape) != 2 or len(a.shape) < 2:
        return None
    return Concat(weight=1, weight_axis=1, bias=None, out_axis=len(a.shape) - 1)


@concatenable("Gemm")
def _gemm(op: Op, graph: Graph) -> Concat | None:
    if not graph.is_constant(op.inputs[1]):
        return None
    bias = op.inputs[2] if len(op.inputs) > 2 else None
    if bias is not None and (not graph.is_constant(bias) or len(graph.tensors[bias].shape) != 1):
        return None
    return Concat(weight=1, weight_axis=0 if op.attrs.get("transB", 0) else 1,
                  bias=2 if bias is not None else None, out_axis=1)


@concatenable("Conv")
def _conv(op: Op, graph: Graph) -> Concat | None:
    if int(op.attrs.get("group", 1)) != 1 or not graph.is_constant(op.inputs[1]):
        return None
    bias = op.inputs[2] if len(op.inputs) > 2 else None
    if bias is not None and not graph.is_constant(bias):
        return None
    return Concat(weight=1, weight_axis=0, bias=2 if bias is not None else None, out_axis=1)


_BROADCASTING = (ShapeRule.BROADCAST, ShapeRule.COMPARE, ShapeRule.SELECT)


@dataclass(frozen=True)
class Merge:
    """One horizontal transformation: the branch ops replaced, and what replaced them."""

    branches: tuple[tuple[str, ...], ...]  # per branch: its contraction, then merged epilogue ops
    merged: tuple[str, ...]  # ids of the new ops (merged contraction, epilogues, slices)


def horizontal_transform(graph: Graph) -> tuple[Graph, list[Merge]]:
    """The graph with every group of mergeable sibling contractions merged (see module doc)."""
    merges: list[Merge] = []
    while True:
        group = _next_group(graph, {op for m in merges for op in m.merged})
        if group is None:
            return graph, merges
        graph, merge = _merge(graph, group)
        merges.append(merge)


def _signature(op: Op, graph: Graph, rule: Concat) -> tuple:
    weight = graph.tensors[op.inputs[rule.weight]]
    others = tuple(None if t is None or i in (rule.weight, rule.bias) else t
                   for i, t in enumerate(op.inputs))
    kept = tuple(n for i, n in enumerate(weight.shape) if i != rule.weight_axis)
    return (op.op_type, repr(sorted(op.attrs.items())), others, kept, weight.dtype,
            rule.bias is None)


def _next_group(graph: Graph, done: set[str]) -> list[Op] | None:
    """Sibling contractions with the same attributes reading the same activation. They depend
    only on that activation and constants, so none can depend on another: they are independent."""
    groups: dict[tuple, list[Op]] = {}
    for op in graph.ops:
        rule = _RULES.get(op.op_type)
        if op.id in done or rule is None or len(op.outputs) != 1:
            continue
        found = rule(op, graph)
        if found is not None and not graph.is_constant(op.inputs[0]):
            groups.setdefault(_signature(op, graph, found), []).append(op)
    return next((ops for ops in groups.values() if len(ops) > 1), None)


def _merge(graph: Graph, group: list[Op]) -> tuple[Graph, Merge]:
    """Replaces the branches of `group` by one op over concatenated constants (and their common
    epilogues), then a Slice per branch that produces the branch's last tensor under its id.
    The new ops take the first branch's place in the order (`Work`'s order keys)."""
    rule = _RULES[group[0].op_type](group[0], graph)
    assert rule is not None
    work = Work(graph)
    first, axis = group[0], rule.out_axis
    widths = [graph.tensors[op.outputs[0]].shape[axis] for op in group]
    inputs = list(first.inputs)
    inputs[rule.weight] = _constant(work, np.concatenate(
        [graph.tensors[op.inputs[rule.weight]].data for op in group], axis=rule.weight_axis))
    if rule.bias is not None:
        inputs[rule.bias] = _constant(work, np.concatenate(
            [graph.tensors[op.inputs[rule.bias]].data for op in group]))
    new_ops = [_widened(work, first, inputs, axis, sum(widths))]

    branches = [[op] for op in group]
    tails = [op.outputs[0] for op in group]
    while (step := _common_epilogue(graph, tails, axis)) is not None:
        ops, operands = step
        inputs = [new_ops[-1].outputs[0] if isinstance(o, str) else
                  None if o is None else _constant(work, o) for o in operands]
        new_ops.append(_widened(work, ops[0], inputs, axis, sum(widths)))
        for branch, op in zip(branches, ops):
            branch.append(op)
        tails = [op.outputs[0] for op in ops]

    merged, axes = new_ops[-1].outputs[0], _constant(work, np.array([axis], np.int64))
    for tail, start, width in zip(tails, np.cumsum([0, *widths[:-1]]), widths):
        new_ops.append(Op(work.new_op_id(), "Slice",
                          (merged, _constant(work, np.array([start], np.int64)),
                           _constant(work, np.array([start + width], np.int64)), axes), (tail,)))
    key = work.key[first.id]
    for op in (op for branch in branches for op in branch):
        work.remove_op(op.id)
    for i, op in enumerate(new_ops):
        work.add_op(op, (*key, i))
    merge = Merge(tuple(tuple(op.id for op in branch) for branch in branches),
                  tuple(op.id for op in new_ops))
    return work.to_graph(), merge


def _widened(work: Work, like: Op, inputs: list[str | None], axis: int, width: int) -> Op:
    """`like` over the merged inputs, its output `width` wide along `axis`."""
    out = work.tensors[like.outputs[0]]
    merged = work.new_tensor_id()
    shape = tuple(width if d == axis else n for d, n in enumerate(out.shape))
    work.set_tensor(Tensor(merged, shape, out.dtype, "horizontal"))
    return Op(work.new_op_id(), like.op_type, tuple(inputs), (merged,), dict(like.attrs),
              source_name=like.source_name)


def _common_epilogue(graph: Graph, tails: list[str], axis: int
                     ) -> tuple[list[Op], list[np.ndarray | None | str]] | None:
    """The elementwise op every branch applies next to its result alike, with its inputs as they
    become in the merged op (constants concatenated along `axis`), or None."""
    ops = []
    for tail in tails:
        readers = graph.consumers(tail)
        if tail in graph.outputs or len(readers) != 1:
            return None
        ops.append(_tail_first_like(readers[0], tail, readers[0] if not ops else ops[0], tails[0]))
    first = ops[0]
    info = op_info(first.op_type)
    if (first.mapping not in (MappingType.ONE_TO_ONE, MappingType.ONE_TO_MANY)
            or info.value_flow is not ValueFlow.NONE or info.opaque
            or any(op.op_type != first.op_type or op.attrs != first.attrs
                   or len(op.inputs) != len(first.inputs) or len(op.outputs) != 1 for op in ops)):
        return None
    # Operands of a broadcasting op are elements to concatenate; any other op's constants are
    # parameters (Clip's bounds, a LeakyRelu's slope) that every branch must share.
    elementwise_operands = info.shape_rule in _BROADCASTING
    rank = len(graph.tensors[tails[0]].shape)
    merged: list[np.ndarray | None | str] = []  # "tail": the merged result so far
    for i in range(len(first.inputs)):
        names = [op.inputs[i] for op in ops]
        if all(t == tail for t, tail in zip(names, tails)):
            merged.append("tail")
        elif all(t is None for t in names):
            merged.append(None)
        elif all(graph.is_constant(t) for t in names):
            arrays = [graph.tensors[t].data for t in names]
            if elementwise_operands:
                data = _concatenated(arrays, tails, graph, axis, rank)
            else:
                same = all(a.shape == arrays[0].shape and np.array_equal(a, arrays[0])
                           for a in arrays)
                data = arrays[0] if same else None
            if data is None:
                return None
            merged.append(data)
        else:
            return None
    if any(graph.tensors[op.outputs[0]].shape != graph.tensors[t].shape
           for op, t in zip(ops, tails)):
        return None
    return ops, merged


def _tail_first_like(op: Op, tail: str, first: Op, first_tail: str) -> Op:
    """`op` with its two operands swapped when it is symmetric and reads its branch's result at
    another position than the first branch's op does (a rewrite may have ordered them apart)."""
    if (len(op.inputs) == 2 and op_info(op.op_type).symmetric and first_tail in first.inputs
            and op.inputs.index(tail) != first.inputs.index(first_tail)):
        return replace(op, inputs=op.inputs[::-1])
    return op


def _concatenated(arrays: list[np.ndarray], tails: list[str], graph: Graph, axis: int,
                  rank: int) -> np.ndarray | None:
    """The branches' constant operands as one, broadcast like each branch's: equal constants that
    do not vary along `axis` stay one; otherwise each is widened to its branch's extent there."""
    if any(a.ndim > rank for a in arrays):
        return None
    padded = [a.reshape((1,) * (rank - a.ndim) + a.shape) for a in arrays]
    if all(p.shape[axis] == 1 for p in padded) and all(
            p.shape == padded[0].shape and np.array_equal(p, padded[0]) for p in padded):
        return arrays[0]
    widened = []
    for p, tail in zip(padded, tails):
        width = graph.tensors[tail].shape[axis]
        if p.shape[axis] not in (1, width):
            return None
        shape = list(p.shape)
        shape[axis] = width
        widened.append(np.broadcast_to(p, shape))
    others = {w.shape[:axis] + w.shape[axis + 1:] for w in widened}
    if len(others) > 1:
        return None
    return np.ascontiguousarray(np.concatenate(widened, axis=axis))


def _constant(work: Work, data: np.ndarray) -> str:
    t = work.new_tensor_id()
    data = np.ascontiguousarray(data)
    work.set_tensor(Tensor(t, tuple(data.shape), data.dtype.name, "horizontal", data))
    return t
