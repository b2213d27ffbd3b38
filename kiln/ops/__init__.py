"""The operator table: for every op of the default ONNX domain, its mapping type, compute intensity,
math properties and FLOP count, registered in one place (see `kiln.ops.table`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable, Union

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType

MappingRule = Union[MappingType, Callable[[Op, Graph], MappingType]]
FlopRule = Callable[[Op, Graph], int]

ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE = "associative", "commutative", "distributive"


@dataclass(frozen=True)
class OpInfo:
    op_type: str
    mapping: MappingRule
    flops: FlopRule
    compute_intensive: bool = False  # CIL of Table 5: each input element is used more than once
    properties: frozenset[str] = frozenset()
    in_paper: bool = False  # listed in DNNFusion's Table 2; otherwise classified by §3.1's definitions
    opaque: bool = False  # control flow / data-dependent output shape: never fused with anything

    def mapping_of(self, op: Op, graph: Graph) -> MappingType:
        return self.mapping if isinstance(self.mapping, MappingType) else self.mapping(op, graph)


_REGISTRY: dict[str, OpInfo] = {}
_LOADED = False
_LOAD_LOCK = threading.RLock()


def register(info: OpInfo) -> OpInfo:
    if info.op_type in _REGISTRY:
        raise ValueError(f"op {info.op_type} registered twice")
    _REGISTRY[info.op_type] = info
    return info


def op_info(op_type: str) -> OpInfo:
    _load_table()
    return _REGISTRY[op_type]


def known_ops() -> dict[str, OpInfo]:
    _load_table()
    return dict(_REGISTRY)


def is_known(op_type: str) -> bool:
    _load_table()
    return op_type in _REGISTRY


def annotate(op: Op, graph: Graph) -> Op:
    """Fill an op's ECG annotations from the table (the op's tensors must be in `graph`)."""
    info = op_info(op.op_type)
    tensors = [graph.tensors[t] for t in (*op.present_inputs(), *op.outputs)]
    return replace(
        op,
        mapping=info.mapping_of(op, graph),
        compute_intensive=info.compute_intensive,
        properties=info.properties,
        flops=int(info.flops(op, graph)),
        bytes=sum(t.nbytes for t in tensors),
    )


def _load_table() -> None:
    # A flag set once the import has finished, not "the registry is non-empty": another thread
    # may be half-way through registering (a threaded worker compiling two models at once).
    global _LOADED
    if _LOADED:
        return
    with _LOAD_LOCK:
        from kiln.ops import table  # noqa: F401  (registers every op on import)
        _LOADED = True
