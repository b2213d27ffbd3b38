"""Attention chains: a contraction, elementwise ops on its result, a normalisation over its last
axis, and a second contraction of the normalised result — QKᵀ → [scale, bias, mask] → Softmax →
·V — recognised from the graph's structure and the ops' records, whatever the model.

A chain's intermediate results (the scores and the probabilities) are read by the chain alone,
so one kernel can run it row tile by row tile with the scores of a tile in L1 (the fused
attention lowering, `kiln.codegen.ops.fused_attention`); partitioners keep a chain in one block.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import RowLocality, op_info


@dataclass(frozen=True)
class AttentionChain:
    scores: str  # the first contraction (Q·Kᵀ)
    between: tuple[str, ...]  # elementwise ops on the scores (scale, bias, mask), in order
    normaliser: str  # the normalisation over the scores' last axis (softmax)
    weighted: str  # the second contraction (probabilities · V)

    @property
    def op_ids(self) -> tuple[str, ...]:
        return (self.scores, *self.between, self.normaliser, self.weighted)


def attention_chains(graph: Graph) -> list[AttentionChain]:
    """Every attention chain of `graph`, in graph order; chains never share an op."""
    found: list[AttentionChain] = []
    taken: set[str] = set()
    for op in graph.ops:
        chain = chain_from(graph, op)
        if chain is not None and not taken & set(chain.op_ids):
            found.append(chain)
            taken |= set(chain.op_ids)
    return found


def chain_from(graph: Graph, first: Op) -> AttentionChain | None:
    """The attention chain whose first contraction is `first`, or None."""
    if not _is_matrix_rows(first) or len(first.outputs) != 1:
        return None
    scores_shape = graph.tensors[first.outputs[0]].shape
    if len(scores_shape) < 2:
        return None
    between: list[str] = []
    op = _sole_consumer(graph, first.outputs[0])
    while op is not None and _elementwise_on(graph, op, scores_shape):
        between.append(op.id)
        op = _sole_consumer(graph, op.outputs[0])
    if op is None or not _normalises_last_axis(graph, op, scores_shape):
        return None
    second = _sole_consumer(graph, op.outputs[0])
    if (second is None or not _is_matrix_rows(second) or second.inputs[0] != op.outputs[0]
            or op.outputs[0] in second.inputs[1:]
            or graph.tensors[second.outputs[0]].shape[:-1] != scores_shape[:-1]):
        return None
    return AttentionChain(first.id, tuple(between), op.id, second.id)


def _is_matrix_rows(op: Op) -> bool:
    return (op_info(op.op_type).row_locality is RowLocality.MATRIX_ROWS
            and not op.attrs.get("transA"))


def _sole_consumer(graph: Graph, tensor: str) -> Op | None:
    """The one op reading `tensor`, if it is read by exactly one op and is no model output."""
    consumers = graph.consumers(tensor)
    if len(consumers) != 1 or tensor in graph.outputs:
        return None
    return consumers[0]


def _elementwise_on(graph: Graph, op: Op, shape: tuple[int, ...]) -> bool:
    """An op computing each element of one tensor of the scores' shape from the same element of
    the scores (a scale, a bias, a mask; One-to-Many when another input is broadcast)."""
    return (op.mapping in (MappingType.ONE_TO_ONE, MappingType.ONE_TO_MANY)
            and not op_info(op.op_type).opaque and len(op.outputs) == 1
            and graph.tensors[op.outputs[0]].shape == shape)


def _normalises_last_axis(graph: Graph, op: Op, shape: tuple[int, ...]) -> bool:
    info = op_info(op.op_type)
    if info.row_locality is not RowLocality.LAST_AXIS or len(op.outputs) != 1:
        return False
    rank = len(shape)
    return (graph.tensors[op.inputs[0]].shape == shape
            and graph.tensors[op.outputs[0]].shape == shape
            and int(op.attrs.get("axis", -1)) % rank == rank - 1)
