"""Output shape and dtype of an op a replacement creates, before it exists in a graph.

The ops replacements build most (elementwise, reductions, Transpose, Reshape, MatMul, Gemm) have
their rules here, chosen by the op record's `shape_rule`; anything else goes through ONNX's own
shape inference, as in the frontend.
"""
from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from kiln.ops import ShapeRule, op_info
from kiln.rewrite.dsl import attr_of
from kiln.rewrite.export import EXPORT_OPSET, node_from


class Info(Protocol):
    shape: tuple[int, ...]
    dtype: str
    data: np.ndarray | None


class ShapeError(ValueError):
    """The op is invalid for its inputs (the replacement does not apply)."""


def infer(op_type: str, inputs: Sequence[Info | None], attrs: dict[str, Any]
          ) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of the first output of `op_type` on `inputs`; ShapeError when invalid."""
    rule = _RULES.get(op_info(op_type).shape_rule)
    if rule is None:
        return _onnx_infer(op_type, inputs, attrs)
    try:
        return rule(inputs, attrs)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ShapeError(f"{op_type}: {exc}") from exc


def _same_as_first(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return tuple(inputs[0].shape), inputs[0].dtype


def _broadcast_rule(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    present = [i for i in inputs if i is not None]
    return _broadcast(present), present[0].dtype


def _compare(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return _broadcast([i for i in inputs if i is not None]), "bool"


def _select(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return _broadcast([i for i in inputs if i is not None]), inputs[1].dtype


def _cast(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return tuple(inputs[0].shape), _onnx_dtype(attrs["to"])


def _transpose(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    shape = inputs[0].shape
    perm = attrs.get("perm") or list(reversed(range(len(shape))))
    if sorted(perm) != list(range(len(shape))):
        raise ShapeError(f"perm {perm} does not fit rank {len(shape)}")
    return tuple(shape[p] for p in perm), inputs[0].dtype


def _reshape_rule(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return _reshape(inputs[0].shape, _data(inputs[1]), attrs), inputs[0].dtype


def _expand(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    target = _Shape(tuple(int(d) for d in _data(inputs[1])))
    return _broadcast([inputs[0], target]), inputs[0].dtype


def _matmul_rule(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return _matmul(inputs[0].shape, inputs[1].shape), inputs[0].dtype


def _gemm_rule(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    return _gemm(inputs, attrs), inputs[0].dtype


class _Shape:
    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def _data(info: Info | None) -> np.ndarray:
    if info is None or info.data is None:
        raise ShapeError("a parameter input is not constant")
    return np.asarray(info.data).reshape(-1)


def _broadcast(inputs: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in np.broadcast_shapes(*(tuple(i.shape) for i in inputs)))


def _arg_reduce(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    shape = tuple(inputs[0].shape)
    axes = [int(attrs.get("axis", 0)) % max(len(shape), 1)]
    return _reduced(shape, axes, attrs), "int64"


def _reduce(inputs: Sequence[Info | None], attrs: dict[str, Any]):
    shape = tuple(inputs[0].shape)
    rank = len(shape)
    given = inputs[1] if len(inputs) > 1 else None
    data = _data(given) if given is not None else np.asarray(attrs.get("axes", []))
    if data.size == 0:
        if attrs.get("noop_with_empty_axes", 0):
            return shape, inputs[0].dtype
        axes = list(range(rank))
    else:
        axes = [int(a) for a in data]
        if any(not -rank <= a < rank for a in axes):
            raise ShapeError(f"axes {axes} out of range for rank {rank}")
        axes = [a % rank for a in axes]
    return _reduced(shape, axes, attrs), inputs[0].dtype


def _reduced(shape: tuple[int, ...], axes: Sequence[int], attrs: dict[str, Any]) -> tuple[int, ...]:
    if attrs.get("keepdims", 1):
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reshape(shape: tuple[int, ...], target: np.ndarray, attrs: dict[str, Any]) -> tuple[int, ...]:
    dims = [int(d) for d in target]
    if not attrs.get("allowzero", 0):
        dims = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if dims.count(-1) > 1:
        raise ShapeError("more than one -1 in a Reshape")
    total = math.prod(shape)
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or total % known:
            raise ShapeError(f"cannot reshape {shape} to {dims}")
        dims[dims.index(-1)] = total // known
    if math.prod(dims) != total or any(d < 0 for d in dims):
        raise ShapeError(f"cannot reshape {shape} to {dims}")
    return tuple(dims)


def _matmul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ShapeError("MatMul of a scalar")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"MatMul of {a} and {b}")
    batch = tuple(int(d) for d in np.broadcast_shapes(a2[:-2], b2[:-2]))
    out = (*batch, a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _gemm(inputs: Sequence[Info | None], attrs: dict[str, Any]) -> tuple[int, ...]:
    a, b = inputs[0].shape, inputs[1].shape
    if len(a) != 2 or len(b) != 2:
        raise ShapeError("Gemm operands must be matrices")
    m, k = (a[1], a[0]) if attrs.get("transA", 0) else a
    k2, n = (b[1], b[0]) if attrs.get("transB", 0) else b
    if k != k2:
        raise ShapeError(f"Gemm of {a} and {b}")
    if len(inputs) > 2 and inputs[2] is not None:
        if tuple(np.broadcast_shapes(inputs[2].shape, (m, n))) != (m, n):
            raise ShapeError(f"Gemm bias {inputs[2].shape} does not broadcast to {(m, n)}")
    return (m, n)


def _onnx_dtype(to: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(int(to))).name


def _onnx_infer(op_type: str, inputs: Sequence[Info | None], attrs: dict[str, Any]):
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    node = node_from(op_type, names, ["out0"], attrs)
    types, data = {}, {}
    for name, x in zip(names, inputs):
        if x is None:
            continue
        types[name] = helper.make_tensor_type_proto(
            helper.np_dtype_to_tensor_dtype(np.dtype(x.dtype)), x.shape)
        if x.data is not None and x.data.size <= 4096:
            data[name] = numpy_helper.from_array(np.asarray(x.data), name)
    try:
        schema = onnx.defs.get_schema(op_type, EXPORT_OPSET, "")
        out = shape_inference.infer_node_outputs(
            schema, node, types, data, opset_imports=[helper.make_opsetid("", EXPORT_OPSET)])
    except Exception as exc:  # onnx raises several exception types for inference failures
        raise ShapeError(f"{op_type}: {exc}") from exc
    ttype = out.get("out0")
    if ttype is None or not ttype.tensor_type.HasField("shape") or any(
            not d.HasField("dim_value") for d in ttype.tensor_type.shape.dim):
        raise ShapeError(f"{op_type}: no static output shape")
    shape = tuple(d.dim_value for d in ttype.tensor_type.shape.dim)
    return shape, _onnx_dtype(ttype.tensor_type.elem_type)


_RULES = {
    ShapeRule.SAME_AS_FIRST: _same_as_first,
    ShapeRule.BROADCAST: _broadcast_rule,
    ShapeRule.COMPARE: _compare,
    ShapeRule.SELECT: _select,
    ShapeRule.CAST: _cast,
    ShapeRule.REDUCE: _reduce,
    ShapeRule.ARG_REDUCE: _arg_reduce,
    ShapeRule.TRANSPOSE: _transpose,
    ShapeRule.RESHAPE: _reshape_rule,
    ShapeRule.EXPAND: _expand,
    ShapeRule.MATMUL: _matmul_rule,
    ShapeRule.GEMM: _gemm_rule,
}

__all__ = ["infer", "ShapeError", "attr_of"]
