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


# --- constant folding checks sizes before it allocates --------------------------------------------

_HOSTILE_FOLD = """
import sys, time
from onnx import TensorProto, helper, numpy_helper
import numpy as np
from kiln import frontend
from kiln.errors import ShapeError

rows, cols = int(sys.argv[1]), int(sys.argv[2])
shape = numpy_helper.from_array(np.array([rows, cols], np.int64), "shape")
node = helper.make_node("ConstantOfShape", ["shape"], ["big"], name="huge",
                        value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
add = helper.make_node("Add", ["big", "x"], ["y"])
graph = helper.make_graph([node, add], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, cols])], [shape])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
start = time.perf_counter()
try:
    graph = frontend.build(model, {}, "hostile")
    print("built", [op.op_type for op in graph.ops], round(time.perf_counter() - start, 2))
except ShapeError as exc:
    print("refused", round(time.perf_counter() - start, 2), exc)
"""


def _fold_in_a_small_address_space(rows: int, cols: int) -> str:
    """Build the model in a child limited to 3 GiB of address space: folding a 6 GiB (or 16 GiB)
    constant before checking its size fails there instead of swapping the test machine."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run([sys.executable, "-c", _HOSTILE_FOLD, str(rows), str(cols)],
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_constant_too_large_to_index_is_refused_before_it_is_allocated():
    # ConstantOfShape 65536² once made `kiln compile` reach 17 GiB and 33 s before its error.
    out = _fold_in_a_small_address_space(65536, 65536)
    verdict, seconds, message = out.split(" ", 2)
    assert verdict == "refused", out
    assert "ConstantOfShape" in message and "huge" in message and "4294967296" in message
    assert float(seconds) < 10


def test_a_large_constant_is_left_to_run_time_without_being_evaluated():
    # 40000² floats (6.4 GB) fit 32-bit indexing but are not worth storing: the op stays.
    out = _fold_in_a_small_address_space(40000, 40000)
    assert out.startswith("built ['ConstantOfShape', 'Add']"), out


def test_small_constants_are_still_folded(tmp_path):
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.0])),
             helper.make_node("Mul", ["c", "x"], ["y"])]
    path = save_model(tmp_path / "m.onnx", nodes, [float_input("x", (2, 3))],
                      [float_input("y", (2, 3))], [shape])
    graph = frontend.load(path)
    assert [op.op_type for op in graph.ops] == ["Mul"]
    folded = graph.tensors[graph.ops[0].inputs[0]].data
    assert np.array_equal(folded, np.full((2, 3), 2.0, np.float32))


# --- local functions --------------------------------------------------------------------------------

def _function_model(functions, nodes, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [float_input("x", (2, 3))], [float_input("y", (2, 3))])
    return helper.make_model(graph, functions=functions, ir_version=10,
                             opset_imports=[helper.make_opsetid("", opset),
                                            helper.make_opsetid("local", 1)])


def test_a_model_with_local_functions_is_inlined_and_computes_what_onnxruntime_does(tmp_path):
    import onnxruntime

    from kiln.rewrite.export import run_reference

    body = [helper.make_node("Mul", ["a", "a"], ["sq"]), helper.make_node("Relu", ["sq"], ["b"]),
            helper.make_node("Sub", ["b", "a"], ["out"])]
    square_relu = helper.make_function("local", "SquareRelu", ["a"], ["out"], body,
                                       [helper.make_opsetid("", 17)])
    model = _function_model([square_relu], [
        helper.make_node("SquareRelu", ["x"], ["h"], domain="local"),
        helper.make_node("SquareRelu", ["h"], ["y"], domain="local")])
    path = tmp_path / "functions.onnx"
    onnx.save(model, str(path))
    graph = frontend.load(path)
    assert [op.op_type for op in graph.ops] == ["Mul", "Relu", "Sub"] * 2
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    got = run_reference(graph, {graph.inputs[0]: x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_exponentially_nested_functions_are_refused_quickly():
    import time

    depth = 40  # f0 calls f1 twice, f1 calls f2 twice, …: 2^40 nodes once inlined
    functions = [helper.make_function("local", f"f{depth}", ["a"], ["out"],
                                      [helper.make_node("Relu", ["a"], ["out"])],
                                      [helper.make_opsetid("", 17)])]
    for level in reversed(range(depth)):
        calls = [helper.make_node(f"f{level + 1}", ["a"], ["m"], domain="local"),
                 helper.make_node(f"f{level + 1}", ["m"], ["out"], domain="local")]
        functions.append(helper.make_function("local", f"f{level}", ["a"], ["out"], calls,
                                              [helper.make_opsetid("", 17),
                                               helper.make_opsetid("local", 1)]))
    model = _function_model(functions, [helper.make_node("f0", ["x"], ["y"], domain="local")])
    start = time.perf_counter()
    with pytest.raises(ModelError, match="inline to more than"):
        frontend.build(model, {}, "nested")
    assert time.perf_counter() - start < 5


def test_a_function_calling_itself_is_refused():
    loop = helper.make_function("local", "Again", ["a"], ["out"],
                                [helper.make_node("Again", ["a"], ["out"], domain="local")],
                                [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    model = _function_model([loop], [helper.make_node("Again", ["x"], ["y"], domain="local")])
    with pytest.raises(ModelError, match="calls itself"):
        frontend.build(model, {}, "recursive")


# --- string attributes ------------------------------------------------------------------------------

def _conv_model(tmp_path, **attrs):
    weight = numpy_helper.from_array(np.ones((1, 1, 3, 3), np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[3, 3], **attrs)
    return save_model(tmp_path / "conv.onnx", [node], [float_input("x", (1, 1, 5, 5))],
                      [float_input("y", (1, 1, 5, 5))], [weight])


def test_an_unknown_string_attribute_value_is_a_model_error_naming_it(tmp_path):
    path = _conv_model(tmp_path, auto_pad="x;rm -rf /")  # compiled as NOTSET before
    with pytest.raises(ModelError) as err:
        frontend.load(path)
    message = str(err.value)
    assert "Conv" in message and "auto_pad" in message and "x;rm -rf /" in message
    assert "SAME_UPPER" in message  # the allowed values are listed


def test_a_defined_string_attribute_value_loads(tmp_path):
    graph = frontend.load(_conv_model(tmp_path, auto_pad="SAME_UPPER"))
    assert graph.ops[0].attrs["auto_pad"] == "SAME_UPPER"


def test_every_value_of_a_list_of_strings_is_checked(tmp_path):
    hidden, size = 2, 3
    w = numpy_helper.from_array(np.ones((1, hidden, size), np.float32), "w")
    r = numpy_helper.from_array(np.ones((1, hidden, hidden), np.float32), "r")
    node = helper.make_node("RNN", ["x", "w", "r"], ["", "y"], name="rnn", hidden_size=hidden,
                            activations=["Tanh", "tanh; echo"])
    path = save_model(tmp_path / "rnn.onnx", [node], [float_input("x", (4, 1, size))],
                      [float_input("y", (1, 1, hidden))], [w, r])
    with pytest.raises(ModelError, match="activations has an unknown value 'tanh; echo'"):
        frontend.load(path)


# --- float16 ----------------------------------------------------------------------------------------

def test_a_float16_model_is_reported_as_float16_not_as_unsupported_operators(tmp_path):
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT16, (2, 3))  # noqa: E731
    path = save_model(tmp_path / "half.onnx", [helper.make_node("Relu", ["x"], ["y"])],
                      [value("x")], [value("y")])
    with pytest.raises(ModelError, match="float16 is not supported") as err:
        frontend.load(path)
    assert not isinstance(err.value, UnsupportedOpsError)


def test_float16_weights_cast_to_float32_at_compile_time_are_fine(tmp_path):
    half = numpy_helper.from_array(np.full((2, 3), 0.5, np.float16), "half")
    nodes = [helper.make_node("Cast", ["half"], ["w"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "w"], ["y"])]
    path = save_model(tmp_path / "m.onnx", nodes, [float_input("x", (2, 3))],
                      [float_input("y", (2, 3))], [half])
    graph = frontend.load(path)
    assert [op.op_type for op in graph.ops] == ["Add"]
