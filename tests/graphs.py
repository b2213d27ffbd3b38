"""Small ECGs and ONNX models built in code for tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.ecg import Graph, Op, Tensor
from kiln.ops import annotate

# One op type per mapping type, for random graphs.
OP_FOR_MAPPING = {"o2o": "Relu", "reo": "Reshape", "shu": "Transpose", "o2m": "Expand", "m2m": "Softmax"}


def ecg(ops: list[tuple[str, list[str], list[str]]], shapes: dict[str, tuple[int, ...]],
        inputs: list[str], outputs: list[str], constants: dict[str, np.ndarray] | None = None) -> Graph:
    """Build an annotated ECG from (op_type, inputs, outputs) triples; tensor names are ids."""
    constants = constants or {}
    tensors = {t: Tensor(t, shapes[t], "float32" if t not in constants else constants[t].dtype.name,
                         t, constants.get(t)) for t in shapes}
    bare = [Op(f"op{i}", op_type, tuple(ins), tuple(outs)) for i, (op_type, ins, outs) in enumerate(ops)]
    draft = Graph(tensors, bare, inputs, outputs)
    return draft.with_ops([annotate(op, draft) for op in bare])


def save_model(path: Path, nodes, inputs, outputs, initializers=(), opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.save(model, str(path))
    return path


def float_input(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def small_mlp(path: Path) -> Path:
    """x·W1 + b1 → Relu → ·W2 + b2 → Sigmoid (x: float [4, 16]): two GEMMs and their epilogues, a
    few fusion candidates and tuning groups, where a zoo model has many of the same kinds."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 8)), ("b2", (8,)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["h4"]),
             helper.make_node("Sigmoid", ["h4"], ["y"])]
    return save_model(path, nodes, [float_input("x", [4, 16])], [float_input("y", [4, 8])],
                      weights)
