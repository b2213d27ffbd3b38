"""AGO's reformer layer (§V): a complicated subgraph is split, its parts tuned, their schedules
joined as the subgraph's starting point; the tuned artifact still verifies."""
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from kiln.cli import main
from kiln.pipeline import CompileOptions, compile_artifact, compile_model
from kiln.plan import partitioner
from kiln.profile.local import default_store
from kiln.target import host_target
from kiln.tune import tune_by_parts, tune_plan, tuner_for
from kiln.tune.reformer import is_complicated, join, split


@pytest.fixture(scope="module")
def block_model(tmp_path_factory):
    """Pointwise conv → ReLU6 → depthwise 3×3 → ReLU6 → pointwise conv: MobileNetV2's block."""
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((32, 8, 1, 1)), "w2": rng.standard_normal((32, 1, 3, 3)),
             "w3": rng.standard_normal((8, 32, 1, 1)), "lo": np.float32(0), "hi": np.float32(6)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]),
             helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], group=32, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["d"]),
             helper.make_node("Conv", ["d", "w3"], ["y"])]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 24, 24])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 24, 24])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("models") / "block.onnx"
    onnx.save(model, path)
    return path


def test_split_keeps_one_complex_op_per_part_and_join_prefers_the_slowest_part(block_model):
    store = default_store(":memory:")
    plan = compile_model(block_model, CompileOptions(partitioner="ago"), store).plan
    (block,) = plan.blocks
    assert is_complicated(plan.graph, block)
    parts = split(plan.graph, block, store)
    assert sorted(i for p in parts for i in p) == sorted(block.op_ids)
    assert [sum(plan.graph.op_by_id[i].op_type == "Conv" for i in p) for p in parts] == [1, 1, 1]
    assert join([(2.0, {"a": 1, "b": 2}), (1.0, {"a": 3, "c": 4})]) == {"a": 1, "b": 2, "c": 4}


def test_ago_plans_are_tuned_by_parts_and_the_artifact_verifies(block_model, tmp_path, capsys):
    assert tuner_for(partitioner("ago")) is tune_by_parts
    assert tuner_for(partitioner("dnnfusion")) is tune_plan
    store = default_store(tmp_path / "profiles.sqlite")
    plan = compile_model(block_model, CompileOptions(partitioner="ago"), store).plan
    result = tune_by_parts(plan, host_target(), store, "quick", 120)
    reformer = result.report["reformer"]
    assert reformer["split"] == {plan.blocks[0].id: 3}
    assert reformer["parts_measured"] > 0
    for part in split(plan.graph, plan.blocks[0], store):  # the parts' measurements are stored
        assert store.schedules(plan.graph, part)
    assert store.schedules(plan.graph, list(plan.blocks[0].op_ids))  # and the joined subgraph's
    out = tmp_path / "block.kiln"
    report = compile_artifact(block_model, out, CompileOptions(partitioner="ago", tune="quick",
                                                               tune_budget=120), store)
    assert "reformer" in report["tuning"]
    assert main(["verify", str(out), str(block_model)]) == 0, capsys.readouterr().out
