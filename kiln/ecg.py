"""The Extended Computational Graph (DNNFusion §3.2): ops and tensors with static shapes, annotated
with mapping types, compute intensity, math properties, FLOPs and bytes.

Tensors and ops carry Kiln's own identifiers (`t12`, `op7`); the model's names are kept in
`source_name` for reports only, so nothing a model names reaches generated code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from kiln.mapping import MappingType


@dataclass(frozen=True, eq=False)
class Tensor:
    id: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    source_name: str = ""
    data: np.ndarray | None = None  # constant value (weights, folded constants)

    @property
    def is_constant(self) -> bool:
        return self.data is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, eq=False)
class Op:
    id: str
    op_type: str
    inputs: tuple[str | None, ...]  # tensor ids; None for an omitted optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    source_name: str = ""
    # Annotations (filled by `annotate`):
    mapping: MappingType = MappingType.MANY_TO_MANY
    compute_intensive: bool = False
    properties: frozenset[str] = frozenset()  # "associative", "commutative", "distributive"
    flops: int = 0
    bytes: int = 0
    ir_removable: bool = False  # set by the planner: every consumer of the output is in the same block

    def present_inputs(self) -> tuple[str, ...]:
        return tuple(t for t in self.inputs if t is not None)


class Graph:
    """An immutable ECG: `ops` are in topological order."""

    def __init__(self, tensors: dict[str, Tensor], ops: Iterable[Op], inputs: Iterable[str],
                 outputs: Iterable[str], opset: int = 0, name: str = ""):
        self.tensors = dict(tensors)
        self.ops = tuple(ops)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.opset = opset
        self.name = name

    # --- structure -------------------------------------------------------------------------
    @cached_property
    def op_by_id(self) -> dict[str, Op]:
        return {op.id: op for op in self.ops}

    @cached_property
    def producer_of(self) -> dict[str, Op]:
        return {t: op for op in self.ops for t in op.outputs}

    @cached_property
    def consumers_of(self) -> dict[str, tuple[Op, ...]]:
        found: dict[str, list[Op]] = {}
        for op in self.ops:
            for t in dict.fromkeys(op.present_inputs()):
                found.setdefault(t, []).append(op)
        return {t: tuple(ops) for t, ops in found.items()}

    @cached_property
    def order(self) -> dict[str, int]:
        return {op.id: i for i, op in enumerate(self.ops)}

    def producer(self, tensor_id: str) -> Op | None:
        return self.producer_of.get(tensor_id)

    def consumers(self, tensor_id: str) -> tuple[Op, ...]:
        return self.consumers_of.get(tensor_id, ())

    def predecessors(self, op: Op) -> list[Op]:
        seen: dict[str, Op] = {}
        for t in op.present_inputs():
            p = self.producer_of.get(t)
            if p is not None:
                seen.setdefault(p.id, p)
        return list(seen.values())

    def successors(self, op: Op) -> list[Op]:
        seen: dict[str, Op] = {}
        for t in op.outputs:
            for c in self.consumers(t):
                seen.setdefault(c.id, c)
        return list(seen.values())

    def tensor(self, tensor_id: str) -> Tensor:
        return self.tensors[tensor_id]

    def is_constant(self, tensor_id: str | None) -> bool:
        return tensor_id is not None and self.tensors[tensor_id].is_constant

    def activation_inputs(self, op: Op) -> tuple[str, ...]:
        """Inputs that are computed at run time (model inputs or other ops' outputs)."""
        return tuple(t for t in op.present_inputs() if not self.tensors[t].is_constant)

    # --- measures --------------------------------------------------------------------------
    @property
    def intermediate_tensors(self) -> list[Tensor]:
        """Results of ops that are not model outputs: the paper's intermediate results (IRS)."""
        outs = set(self.outputs)
        return [self.tensors[t] for op in self.ops for t in op.outputs if t not in outs]

    @property
    def irs_bytes(self) -> int:
        return sum(t.nbytes for t in self.intermediate_tensors)

    @property
    def total_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def with_ops(self, ops: Iterable[Op], tensors: dict[str, Tensor] | None = None) -> "Graph":
        return Graph(tensors if tensors is not None else self.tensors, ops, self.inputs,
                     self.outputs, self.opset, self.name)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.ops)} ops, {len(self.tensors)} tensors)"


def toposort(ops: Iterable[Op], available: Iterable[str]) -> list[Op]:
    """Order ops so every op follows the producers of its inputs; keeps the given order where it can.

    `available` are tensor ids present before any op runs (model inputs and constants).
    """
    pending = list(ops)
    ready = set(available)
    ordered: list[Op] = []
    while pending:
        progressed = []
        for op in pending:
            if all(t in ready for t in op.present_inputs()):
                ordered.append(op)
                ready.update(op.outputs)
            else:
                progressed.append(op)
        if len(progressed) == len(pending):
            names = ", ".join(op.id for op in progressed[:5])
            raise ValueError(f"graph has a cycle or a missing tensor among: {names}")
        pending = progressed
    return ordered
