"""ECG → ONNX: for evaluating a graph with onnxruntime or onnx's reference evaluator, and for
folding constants (`kiln.fold`).

ECG ops follow the latest opset's conventions (parameters such as axes and shapes are constant
inputs), so graphs are exported at `EXPORT_OPSET`. Tensors keep their Kiln ids as ONNX names;
op attributes are Python values (ndarrays for tensor attributes).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.ecg import Graph, Op
from kiln.fold import IR_VERSION

EXPORT_OPSET = 21
EXPORT_IR_VERSION = IR_VERSION  # accepted by every supported onnxruntime


def node_from(op_type: str, inputs: Sequence[str], outputs: Sequence[str],
              attrs: dict[str, Any], name: str = "") -> onnx.NodeProto:
    converted = {}
    for key, value in attrs.items():
        if isinstance(value, np.ndarray):
            value = numpy_helper.from_array(value)
        elif isinstance(value, np.generic):
            value = value.item()
        elif isinstance(value, (list, tuple)):
            if not value:
                continue  # an empty list has no attribute type; ONNX reads a missing one the same
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        converted[key] = value
    return helper.make_node(op_type, list(inputs), list(outputs), name=name or None, **converted)


def op_to_node(op: Op) -> onnx.NodeProto:
    return node_from(op.op_type, [t or "" for t in op.inputs], op.outputs, op.attrs, op.id)


def value_info(graph: Graph, tensor_id: str) -> onnx.ValueInfoProto:
    t = graph.tensors[tensor_id]
    return helper.make_tensor_value_info(
        tensor_id, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), t.shape)


def to_onnx(graph: Graph, opset: int = EXPORT_OPSET) -> onnx.ModelProto:
    """The graph as an ONNX model whose inputs and outputs are named by their Kiln ids."""
    nodes = [op_to_node(op) for op in graph.ops]
    used = {t for op in graph.ops for t in op.present_inputs()}
    initializers = [numpy_helper.from_array(np.asarray(graph.tensors[t].data), t)
                    for t in sorted(used) if graph.tensors[t].is_constant]
    produced = {t for op in graph.ops for t in op.outputs}
    for t in graph.outputs:  # a constant output: give it a node, outputs cannot be initializers
        tensor = graph.tensors[t]
        if t not in produced and tensor.is_constant and t not in used:
            alias = f"{t}__value"
            initializers.append(numpy_helper.from_array(np.asarray(tensor.data), alias))
            nodes.append(helper.make_node("Identity", [alias], [t]))
    onnx_graph = helper.make_graph(
        nodes, graph.name or "kiln", [value_info(graph, t) for t in graph.inputs],
        [value_info(graph, t) for t in graph.outputs], initializers)
    return helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=EXPORT_IR_VERSION, producer_name="kiln")


def run_reference(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Evaluate with onnx's reference evaluator; `feeds` are keyed by input tensor id."""
    from onnx.reference import ReferenceEvaluator

    return [np.asarray(r) for r in ReferenceEvaluator(to_onnx(graph)).run(None, feeds)]


def run_onnxruntime(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Evaluate with onnxruntime (graph optimizations off); `feeds` are keyed by input tensor id."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(to_onnx(graph).SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return [np.asarray(r) for r in session.run(list(graph.outputs), feeds)]
