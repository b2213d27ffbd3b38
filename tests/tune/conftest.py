import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.runtime.conftest import kiln_cache  # noqa: F401  (autouse: a fresh cache folder here too)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A feed-forward layer: MatMul + bias + Relu, MatMul, Softmax (two or three blocks)."""
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32) * 0.1, "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(96).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((96, 40)).astype(np.float32) * 0.1, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["o"]),
             helper.make_node("Softmax", ["o"], ["y"], axis=-1)]
    graph = helper.make_graph(
        nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 48, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 48, 40])], [w1, b1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("models") / "ffn.onnx"
    onnx.save(model, path)
    return path
