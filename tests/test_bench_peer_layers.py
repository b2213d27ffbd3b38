"""bench/peer_layers.py matches Kiln's kernels with OpenVINO's layers of the same ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.latency import bench_model

openvino = pytest.importorskip("openvino")


def _conv_model(path: Path) -> Path:
    """Conv 8 → 16 channels (3 × 3) → Relu → MaxPool, with node names as an exporter gives."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["/conv/Conv_output_0"], name="/conv/Conv",
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["/conv/Conv_output_0"], ["r"], name="/act/Relu"),
             helper.make_node("MaxPool", ["r"], ["y"], name="/pool/MaxPool", kernel_shape=[2, 2],
                              strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_every_kernel_of_a_conv_model_meets_the_openvino_layers_of_its_ops(tmp_path: Path) -> None:
    from bench.peer_layers import compare

    model = bench_model(str(_conv_model(tmp_path / "conv.onnx")))
    rows, wall, scale = compare(model, tmp_path, 1, 3)
    assert rows and all(layers >= 1 and kiln_ms > 0 and ov_ms > 0
                        for kiln_ms, ov_ms, layers, _ in rows), rows
    assert wall["kiln"] > 0 and wall["ov"] > 0 and scale > 0
