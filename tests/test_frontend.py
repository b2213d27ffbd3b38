"""Frontend: loading, checking, shapes, folding, and the errors users see."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import frontend
from kiln.errors import ModelError, ShapeError, UnsupportedOpsError
from kiln.mapping import MappingType
from tests.graphs import float_input, save_model


def relu_model(tmp_path, shape=(2, 3)):
    return save_model(tmp_path / "relu.onnx", [helper.make_node("Relu", ["x"], ["y"])],
                      [float_input("x", shape)], [float_input("y", shape)])


def test_loads_a_simple_model(tmp_path):
    graph = frontend.load(relu_model(tmp_path))
    assert [op.op_type for op in graph.ops] == ["Relu"]
    op = graph.ops[0]
    assert op.mapping == MappingType.ONE_TO_ONE and op.flops == 6 and op.bytes == 48
    assert graph.tensors[graph.outputs[0]].source_name == "y"


def test_kiln_ids_hide_model_names(tmp_path):
    path = save_model(tmp_path / "m.onnx", [helper.make_node("Relu", ["x; rm -rf /"], ["y\"*/"], name="n\n")],
                      [float_input("x; rm -rf /", (2,))], [float_input("y\"*/", (2,))])
    graph = frontend.load(path)
    assert all(t.startswith("t") and t[1:].isdigit() for t in graph.tensors)
    assert all(op.id.startswith("op") for op in graph.ops)


def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x08\x07this is not a protobuf\xff\xff\xff")
    with pytest.raises(ModelError, match="not a valid ONNX model"):
        frontend.load(path)


def test_truncated_file_is_a_clear_error(tmp_path):
    good = relu_model(tmp_path).read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelError, match="cut.onnx"):
        frontend.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        frontend.load(tmp_path / "nope.onnx")


def _external_model(tmp_path, location: str):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], vals=[0.0] * 4)
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    folder = tmp_path / "model"
    folder.mkdir()
    return save_model(folder / "m.onnx", [helper.make_node("Add", ["x", "w"], ["y"])],
                      [float_input("x", (4,))], [float_input("y", (4,))], [weight])


def test_external_data_inside_the_folder_loads(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    graph = frontend.load(path)
    weight = next(t for t in graph.tensors.values() if t.is_constant)
    np.testing.assert_array_equal(weight.data, [0, 1, 2, 3])


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"])
def test_external_data_escaping_the_folder_is_refused(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    path = _external_model(tmp_path, location)
    with pytest.raises(ModelError, match="outside the model's folder"):
        frontend.load(path)


def test_external_data_symlink_escaping_the_folder_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    path = _external_model(tmp_path, "link.bin")
    (path.parent / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(ModelError, match="outside the model's folder"):
        frontend.load(path)


def test_every_unsupported_op_is_listed_at_once(tmp_path):
    nodes = [helper.make_node("FancyOp", ["x"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Attention", ["b"], ["c"], domain="com.microsoft", name="attn"),
             helper.make_node("FancyOp", ["c"], ["y"], name="second")]
    graph = helper.make_graph(nodes, "g", [float_input("x", (2,))], [float_input("y", (2,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                     helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnsupportedOpsError) as info:
        frontend.load(path)
    assert set(info.value.unsupported) == {"FancyOp", "com.microsoft.Attention"}
    assert info.value.unsupported["FancyOp"] == ["first", "second"]
    assert "FancyOp" in str(info.value) and "com.microsoft.Attention" in str(info.value)


def test_symbolic_dimension_needs_a_value(tmp_path):
    path = relu_model(tmp_path, shape=("batch", 3))
    with pytest.raises(ShapeError, match="'batch'.*--shape x="):
        frontend.load(path)
    graph = frontend.load(path, {"x": (5, 3)})
    assert graph.tensors[graph.inputs[0]].shape == (5, 3)
    assert graph.tensors[graph.outputs[0]].shape == (5, 3)


def test_wrong_shape_values_are_refused(tmp_path):
    path = relu_model(tmp_path, shape=("batch", 3))
    with pytest.raises(ShapeError, match="fixed to 3"):
        frontend.load(path, {"x": (5, 4)})
    with pytest.raises(ShapeError, match="unknown input"):
        frontend.load(path, {"z": (1, 3)})
    with pytest.raises(ShapeError, match="more than"):
        frontend.load(path, {"x": (1 << 30, 3)})


def test_parse_shape_argument():
    assert frontend.parse_shape_arg("input_ids=1,128") == ("input_ids", (1, 128))
    with pytest.raises(ShapeError):
        frontend.parse_shape_arg("input_ids:1x128")


def test_constant_shape_computation_is_folded_and_identity_dropout_dropped(tmp_path):
    # y = Reshape(Dropout(Identity(x)), Concat(Shape(x)[0:1], [-1]))
    nodes = [helper.make_node("Identity", ["x"], ["xi"]),
             helper.make_node("Dropout", ["xi"], ["xd"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["s0"]),
             helper.make_node("Concat", ["s0", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["xd", "target"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("zero", 0), ("one", 1), ("minus_one", -1))]
    path = save_model(tmp_path / "fold.onnx", nodes, [float_input("x", (2, 3, 4))],
                      [float_input("y", (2, 12))], inits)
    graph = frontend.load(path)
    assert [op.op_type for op in graph.ops] == ["Reshape", "Relu"]
    reshape = graph.ops[0]
    assert reshape.inputs[0] == graph.inputs[0]
    np.testing.assert_array_equal(graph.tensors[reshape.inputs[1]].data, [2, -1])
    assert graph.tensors[graph.outputs[0]].shape == (2, 12)


def test_old_opset_attributes_become_inputs(tmp_path):
    nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),
             helper.make_node("ReduceSum", ["u"], ["y"], axes=[2], keepdims=0)]
    path = save_model(tmp_path / "old.onnx", nodes, [float_input("x", (2, 3))],
                      [float_input("y", (1, 2))], opset=11)
    graph = frontend.load(path)
    unsqueeze, reduce = graph.ops
    np.testing.assert_array_equal(graph.tensors[unsqueeze.inputs[1]].data, [0])
    np.testing.assert_array_equal(graph.tensors[reduce.inputs[1]].data, [2])
    assert "axes" not in reduce.attrs and graph.tensors[reduce.outputs[0]].shape == (1, 2)


def test_checker_failure_is_reported(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"], unknown_attribute=3)]
    path = save_model(tmp_path / "bad_attr.onnx", nodes, [float_input("x", (2,))], [float_input("y", (2,))])
    with pytest.raises(ModelError, match="checker"):
        frontend.load(path)


def test_initializer_with_too_little_data_is_refused(tmp_path):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], vals=[0.0] * 4)
    weight.raw_data = np.zeros(3, np.float32).tobytes()
    del weight.float_data[:]
    path = save_model(tmp_path / "short.onnx", [helper.make_node("Add", ["x", "w"], ["y"])],
                      [float_input("x", (4,))], [float_input("y", (4,))], [weight])
    with pytest.raises(ModelError, match="'w'"):
        frontend.load(path)


def test_an_output_that_copies_an_input_keeps_both_names(tmp_path):
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Dropout", ["x"], ["z"]),
             helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["s"])]
    path = save_model(tmp_path / "copy.onnx", nodes, [float_input("x", (2,))],
                      [float_input("y", (2,)), float_input("z", (2,)), float_input("s", (2,))])
    graph = frontend.load(path)
    assert graph.tensors[graph.inputs[0]].source_name == "x"
    assert [graph.tensors[t].source_name for t in graph.outputs] == ["y", "z", "s"]
    assert [op.op_type for op in graph.ops] == ["Identity", "Dropout", "Relu"]
