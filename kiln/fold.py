"""Constant folding: which ops may be evaluated at compile time, whether a folded result is worth
storing, and the evaluation itself (onnxruntime, else onnx's reference evaluator).

The frontend folds while it walks a model; the rewrite engine folds the constant ops its
replacements create and the ops whose inputs became constant. Both decide with `worth_storing`
on the sizes they know *before* evaluating, so a hostile constant (ConstantOfShape to 2^32
elements) is refused without being allocated.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import helper

from kiln import ops as op_table
from kiln.errors import ModelError

MAX_GROWTH = 4  # a folded constant may be at most this many times its inputs' bytes…
SMALL_BYTES = 1 << 20  # …unless it is below this size
IR_VERSION = 10  # accepted by every onnxruntime Kiln supports
DEFAULT_OPSET = 21


def foldable(op_type: str) -> bool:
    """May an op of this type be evaluated at compile time (its inputs being constant)?"""
    return op_table.is_known(op_type) and op_table.op_info(op_type).foldable


def worth_storing(out_bytes: int, in_bytes: int) -> bool:
    """Is a folded result of `out_bytes` worth storing instead of computing it from `in_bytes` of
    constants (e.g. not a constant Expand to a huge shape: cheaper to compute than to store)?"""
    return out_bytes <= max(SMALL_BYTES, MAX_GROWTH * in_bytes)


def evaluate(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int
             ) -> list[np.ndarray]:
    """Run one node on constant inputs (None: an omitted optional input); ModelError if neither
    onnxruntime nor the reference evaluator can."""
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.input[:]
    copy.input.extend(names)
    del copy.output[:]
    copy.output.extend(f"out{i}" if o else "" for i, o in enumerate(node.output))
    graph = helper.make_graph(
        [copy], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs) if n],
        [onnx.ValueInfoProto(name=o) for o in copy.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or DEFAULT_OPSET)],
                              ir_version=IR_VERSION)
    feeds = {n: x for n, x in zip(names, inputs) if n}
    try:
        return _run_onnxruntime(model, feeds)
    except Exception:  # an op or type onnxruntime lacks: the reference evaluator may have it
        pass
    try:
        from onnx.reference import ReferenceEvaluator
        return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]
    except Exception as exc:  # the reference ops raise arbitrary exceptions on bad constants
        raise ModelError(f"could not fold constant {node.op_type} node "
                         f"{node.name or node.output[0]!r}: {_first_line(exc)}") from exc


def _run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return [np.asarray(r) for r in session.run(None, feeds)]


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
