"""The op registry: one record (`OpInfo`) per op of the default ONNX domain, registered in one
place (`kiln.ops.table`). Every pass asks the record about an op — mapping type, TVM-style
pattern, compute intensity, row locality, recurrence, foldability, value flow, operand symmetry,
the allowed values of its string attributes, its shape rule — instead of keeping a list of op
names of its own. Attribute defaults come from ONNX's schemas at the model's opset (`attr_default`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum
from functools import lru_cache
from typing import Any, Callable, Mapping, Union

import numpy as np
import onnx.defs
from onnx import helper

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType

MappingRule = Union[MappingType, Callable[[Op, Graph], MappingType]]
FlopRule = Callable[[Op, Graph], int]

ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE = "associative", "commutative", "distributive"


class Pattern(IntEnum):
    """TVM's OpPatternKind, in order of increasing difficulty to fuse (merging two groups is a max)."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2  # pure data movement: reshapes, slices, gathers, padding, resizing
    REDUCE = 3
    ANCHOR = 4  # compute-intensive: absorbs an elementwise epilogue
    OPAQUE = 5


class RowLocality(Enum):
    """Whether each row of the output (fixed leading indices) depends only on the same row of the
    first input, and which attribute or input says where the rows end."""

    NONE = "none"
    MATRIX_ROWS = "matrix rows"  # a row of A gives a row of A·B (B read whole by every row)
    REDUCED_AXES = "reduced axes"  # a reduction over constant `axes` (an input) ending at the last
    LAST_AXIS = "last axis"  # over its `axis` attribute, when that is the last axis
    FROM_AXIS = "from axis"  # over every axis from its `axis` attribute on


class ValueFlow(Enum):
    """Which inputs' values the output holds unchanged (some of them, possibly reordered)."""

    NONE = "none"
    FIRST_INPUT = "first input"
    EVERY_INPUT = "every input"


class ShapeRule(Enum):
    """How the rewriter infers the output shape and dtype of an op it creates (`kiln.rewrite.shapes`);
    ONNX: through ONNX's shape inference."""

    SAME_AS_FIRST = "same as first input"
    BROADCAST = "broadcast of the inputs"
    COMPARE = "broadcast of the inputs, bool"
    SELECT = "broadcast of the inputs, dtype of the second"
    CAST = "first input's shape, dtype from `to`"
    REDUCE = "reduce over axes"
    ARG_REDUCE = "reduce over axis, int64"
    TRANSPOSE = "permuted"
    RESHAPE = "reshaped"
    EXPAND = "expanded"
    MATMUL = "matmul"
    GEMM = "gemm"
    ONNX = "onnx shape inference"


ANY_TEXT = None  # a string attribute whose every value is meaningful (an equation, a name)


@dataclass(frozen=True)
class OpInfo:
    """Everything Kiln's passes know about one op. Every field is set by its registration (none
    has a default), so a new op cannot silently inherit a property."""

    op_type: str
    mapping: MappingRule
    flops: FlopRule
    pattern: Pattern
    compute_intensive: bool  # CIL of Table 5: each input element is used more than once
    row_locality: RowLocality
    recurrent: bool  # a recurrence over a sequence (its own kernel; stacked layers may share one)
    foldable: bool  # may be evaluated at compile time when its inputs are constant
    static_value: bool  # its value follows from static shapes and attributes: always folded
    value_flow: ValueFlow
    gather_indices: int | None  # input position holding indices into input 0, if it gathers
    symmetric: bool  # its two operands may be swapped
    properties: frozenset[str]  # math properties of Table 4 (associative, commutative, ...)
    # allowed values of each string attribute ONNX defines for the op, over every opset (ANY_TEXT:
    # free text, such as an equation)
    string_attrs: Mapping[str, frozenset[str] | None] = field(hash=False)
    shape_rule: ShapeRule
    # parameters older opsets took as attributes and the latest take as inputs:
    # (attribute, input position, numpy dtype, last opset that used the attribute)
    attributes_now_inputs: tuple[tuple[str, int, str, int], ...]
    in_paper: bool  # listed in DNNFusion's Table 2; otherwise classified by §3.1's definitions
    opaque: bool  # control flow / data-dependent output shape: never fused with anything

    def mapping_of(self, op: Op, graph: Graph) -> MappingType:
        return self.mapping if isinstance(self.mapping, MappingType) else self.mapping(op, graph)

    def invalid_string_attr(self, name: str, value: Any) -> str | None:
        """The first value of string attribute `name` this op does not define, or None."""
        allowed = self.string_attrs.get(name, ANY_TEXT)
        if allowed is ANY_TEXT:
            return None
        values = value if isinstance(value, (list, tuple)) else [value]
        return next((v for v in values if v not in allowed), None)


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


@lru_cache(maxsize=None)
def _schema_defaults(op_type: str, opset: int) -> dict[str, Any]:
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return {}
    return {name: helper.get_attribute_value(a.default_value)
            for name, a in schema.attributes.items() if a.default_value.name}


def attr_default(op_type: str, name: str, opset: int | None) -> Any:
    """ONNX's default of attribute `name` of `op_type` at `opset` (None: the op has no default).
    Strings are returned as str, as the frontend stores string attributes; floats as the shortest
    decimal of the schema's float32 (1e-05, not 9.99999974737875e-06)."""
    value = _schema_defaults(op_type, opset or onnx.defs.onnx_opset_version()).get(name)
    return [_plain(v) for v in value] if isinstance(value, list) else _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


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
