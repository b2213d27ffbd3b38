"""Random inputs follow indices through value-preserving ops (the op record's value flow) to the
gathers they index (its gather_indices), and stay within each table: onnxruntime, which refuses
out-of-range indices, runs the model on them."""
from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from kiln import frontend
from kiln.runtime.artifact import TensorInfo
from kiln.runtime.inputs import index_bounds, random_inputs
from tests.graphs import float_input, save_model


def test_indices_through_concat_into_gathernd_and_gather_along_an_axis(tmp_path):
    data = numpy_helper.from_array(np.ones((5, 7, 3), np.float32), "data")
    wide = numpy_helper.from_array(np.ones((4, 9), np.float32), "wide")
    nodes = [
        # both halves of each index pair come through Concat: every input carries values
        helper.make_node("Concat", ["rows", "cols"], ["pairs"], axis=1),
        helper.make_node("GatherND", ["data", "pairs"], ["picked"]),
        helper.make_node("Gather", ["wide", "column"], ["columns"], axis=1),
    ]
    ints = [helper.make_tensor_value_info("rows", TensorProto.INT64, [6, 1]),
            helper.make_tensor_value_info("cols", TensorProto.INT64, [6, 1]),
            helper.make_tensor_value_info("column", TensorProto.INT64, [8])]
    path = save_model(tmp_path / "gathers.onnx", nodes, ints,
                      [float_input("picked", [6, 3]), float_input("columns", [4, 8])], [data, wide])
    graph = frontend.load(path)
    # GatherND: the smallest dim after batch_dims bounds every component of an index tuple
    assert index_bounds(graph) == {"rows": 3, "cols": 3, "column": 9}
    specs = [TensorInfo("rows", "int64", (6, 1)), TensorInfo("cols", "int64", (6, 1)),
             TensorInfo("column", "int64", (8,))]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for seed in range(3):
        feeds = random_inputs(specs, graph, seed)
        session.run(None, feeds)  # raises on an index out of range
