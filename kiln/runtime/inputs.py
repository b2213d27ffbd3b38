"""Random inputs that are valid for a model.

Floats are standard normal; bools are random; an input whose name mentions a mask is all ones;
an integer input is drawn from [0, n) where n is the smallest table it indexes: its consumers
are followed through value-preserving ops (Cast, Reshape, Unsqueeze, …: the op record's
`value_flow`) to the indices input of a gather (Gather, GatherElements, GatherND: its
`gather_indices`), whose data extent along the gathered axis is n. Integer
inputs that index nothing are drawn from [0, `DEFAULT_INT_BOUND`), or are zeros when no graph
is given (always a valid index).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kiln.ecg import Graph, Op
from kiln.ops import ValueFlow, attr_default, op_info
from kiln.runtime.artifact import TensorInfo

MASK_NAME = re.compile(r"mask", re.IGNORECASE)
DEFAULT_INT_BOUND = 10


def random_inputs(inputs: Sequence[TensorInfo], graph: Graph | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bounds = index_bounds(graph) if graph is not None else {}
    return {t.name: _random_value(t, bounds.get(t.name), graph is not None, rng) for t in inputs}


def _random_value(info: TensorInfo, bound: int | None, know_graph: bool,
                  rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(info.dtype)
    if MASK_NAME.search(info.name):
        return np.ones(info.shape, dtype=dtype)
    if dtype == np.bool_:
        return rng.random(info.shape) < 0.5
    if dtype.kind in "iu":
        high = bound if bound is not None else DEFAULT_INT_BOUND if know_graph else 1
        return rng.integers(0, max(high, 1), size=info.shape).astype(dtype)
    return rng.standard_normal(info.shape).astype(dtype)


def index_bounds(graph: Graph) -> dict[str, int]:
    """Model input name -> the smallest table extent it indexes (inputs that index tables)."""
    found = {}
    for t in graph.inputs:
        extents = list(_gathered_extents(graph, t))
        if extents:
            found[graph.tensors[t].source_name or t] = min(extents)
    return found


def _gathered_extents(graph: Graph, start: str):
    seen = {start}
    frontier = [start]
    while frontier:
        tensor = frontier.pop()
        for op in graph.consumers(tensor):
            info = op_info(op.op_type)
            indices = info.gather_indices
            if indices is not None and len(op.inputs) > indices and op.inputs[indices] == tensor:
                yield _gather_extent(graph, op)
            elif _carries_values(op, tensor, info.value_flow):
                fresh = [o for o in op.outputs if o not in seen]
                seen.update(fresh)
                frontier.extend(fresh)


def _carries_values(op: Op, tensor: str, flow: ValueFlow) -> bool:
    if flow is ValueFlow.EVERY_INPUT:
        return tensor in op.present_inputs()
    return flow is ValueFlow.FIRST_INPUT and op.inputs[0] == tensor


def _gather_extent(graph: Graph, op: Op) -> int:
    """The extent the gather's indices index: the data's extent along its `axis` (Gather,
    GatherElements), else (GatherND, which has no axis) the smallest dim after `batch_dims`."""
    shape = graph.tensors[op.inputs[0]].shape
    axis = op.attrs.get("axis", attr_default(op.op_type, "axis", graph.opset))
    if axis is None:
        return min(shape[op.attrs.get("batch_dims", 0):], default=1)
    return shape[axis] if shape else 1
