"""bench/latency.py takes .onnx files as well as zoo names: valid inputs for symbolic dims, and
every contender computes what onnxruntime computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.latency import bench_model, contenders, max_diff

VOCAB, WIDTH = 37, 8


def _embedding_model(path: Path) -> Path:
    """ids [batch, seq] (symbolic) -> Gather from a [VOCAB, WIDTH] table -> Relu -> sum over seq."""
    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Relu", ["e"], ["r"]),
             helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_onnx_path_gets_inputs_of_the_given_shape_within_the_table(tmp_path: Path) -> None:
    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (2, 300)})
    ids = model.inputs["ids"]
    assert model.name == "emb" and ids.shape == (2, 300) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < VOCAB and ids.max() > VOCAB // 2  # spans the table


def test_contenders_agree_with_onnxruntime(tmp_path: Path) -> None:
    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (1, 16)})
    peers = ("ort", "ov") if _has_openvino() else ("ort",)
    calls, failures = contenders(model, 1, tmp_path, peers)
    assert not failures
    assert set(calls) == {"dnnfusion", "none", *peers}
    assert calls["dnnfusion"]()[0].shape == (1, WIDTH)
    assert all(diff < 1e-5 for diff in max_diff(calls).values())


def test_unknown_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a model of the zoo"):
        bench_model(str(tmp_path / "missing.onnx"))


def _has_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def test_fusion_share_counts_only_models_with_removable_time() -> None:
    from bench.fusion_ceiling import fusion_share

    # none 10 ms of which 6 ms contractions: 4 ms removable, dnnfusion removed 3 of them.
    assert fusion_share(10.0, 6.0, 7.0) == pytest.approx(0.75)
    assert fusion_share(10.0, 9.6, 9.5) is None  # 0.4 ms removable: under 5 % of none
    assert fusion_share(10.0, 9.5, 10.2) == pytest.approx(-0.4)  # fused slower: negative share


def test_partitioners_table_has_a_row_per_partitioner_and_peer(tmp_path: Path) -> None:
    import argparse

    from bench.partitioners import model_rows
    from kiln.plan import partitioner_names

    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (1, 16)})
    args = argparse.Namespace(threads=1, rounds=2, warmup=1)
    rows, notes, ratios = model_rows(model, partitioner_names(), ("ort",), args, tmp_path)
    assert not notes
    assert [r[1] for r in rows] == [*partitioner_names(), "onnxruntime"]
    assert all(float(r[7]) < 1e-5 for r in rows)  # every build computes what onnxruntime does
    assert set(ratios) == set(partitioner_names())
