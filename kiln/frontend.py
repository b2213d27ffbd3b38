"""Frontend: an ONNX file → the ECG.

Loads the model (external data confined to the model's folder), checks it, fixes every symbolic
dimension from caller-supplied shapes, infers static shapes node by node, folds constant
sub-graphs, drops Identity and inference-time Dropout, and builds the annotated ECG.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper, shape_inference
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model, uses_external_data

from kiln import ops as op_table
from kiln.ecg import Graph, Op, Tensor
from kiln.errors import ModelError, ShapeError, UnsupportedOpsError

DEFAULT_DOMAINS = ("", "ai.onnx")
MAX_TENSOR_ELEMENTS = 1 << 31  # larger tensors cannot be indexed with 32-bit offsets
FOLD_MAX_GROWTH = 4  # a folded constant may be at most this many times its inputs' bytes…
FOLD_SMALL_BYTES = 1 << 20  # …unless it is below this size
PASS_THROUGH_OPS = ("Identity", "Dropout")
FOLD_IR_VERSION = 10  # accepted by every onnxruntime Kiln supports
NON_FOLDABLE_OPS = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
    "Bernoulli", "If", "Loop", "Scan",
})

# Parameters that older opsets took as attributes and the latest opsets take as inputs:
# op type -> [(attribute, input position, numpy dtype, last opset that used the attribute)].
ATTRIBUTES_NOW_INPUTS: dict[str, list[tuple[str, int, str, int]]] = {
    "Squeeze": [("axes", 1, "int64", 12)],
    "Unsqueeze": [("axes", 1, "int64", 12)],
    "ReduceSum": [("axes", 1, "int64", 12)],
    **{op: [("axes", 1, "int64", 17)] for op in (
        "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
    "Split": [("split", 1, "int64", 12)],
    "Slice": [("starts", 1, "int64", 9), ("ends", 2, "int64", 9), ("axes", 3, "int64", 9)],
    "Pad": [("pads", 1, "int64", 10), ("value", 2, "float32", 10)],
    "Clip": [("min", 1, "float32", 10), ("max", 2, "float32", 10)],
    "TopK": [("k", 1, "int64", 9)],
}


@dataclass
class _Value:
    """A tensor while the frontend walks the model: its type and, if known, its constant value."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None


# ---------------------------------------------------------------------------------------------
# Loading

def read_model(path: str | Path, *, external_data: bool = True) -> onnx.ModelProto:
    """Parse an ONNX file and load its external data, refusing locations outside its folder.

    With `external_data=False` a model keeping tensor data outside its own protobuf is refused
    (the service stores each upload as one file, so such data could never be found again)."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())  # onnx.load takes twice as long on large files
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise ModelError(f"{path.name} is not a valid ONNX model: {exc}") from exc
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{path.name} is not a valid ONNX model: it has no graph")
    _check_external_data(model, path.parent)
    external = [t.name for t in _all_initializers(model) if uses_external_data(t)]
    if external and not external_data:
        raise ModelError(f"initializer(s) {', '.join(map(repr, external[:5]))} keep their data in "
                         "external files; send a self-contained model (saved without "
                         "save_as_external_data)")
    if external:
        load_external_data_for_model(model, str(path.parent))
    return model


def _all_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    found = list(model.graph.initializer)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                found.append(attr.t)
    return found


def _check_external_data(model: onnx.ModelProto, folder: Path) -> None:
    root = folder.resolve()
    for tensor in _all_initializers(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = Path(info.location)
        target = (root / location).resolve()
        if location.is_absolute() or not target.is_relative_to(root):
            raise ModelError(f"external data of initializer {tensor.name!r} points outside the "
                             f"model's folder: {info.location!r}")
        if not target.is_file():
            raise ModelError(f"external data file {info.location!r} of initializer "
                             f"{tensor.name!r} is missing")
        end = (info.offset or 0) + (info.length or 0)
        if end > target.stat().st_size:
            raise ModelError(f"external data of initializer {tensor.name!r} reads past the end "
                             f"of {info.location!r}")


# ---------------------------------------------------------------------------------------------
# Checking

def check_model(model: onnx.ModelProto) -> int:
    """Check the model and its operators; return the default-domain opset version."""
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if model.functions:
        model.CopyFrom(onnx.inliner.inline_local_functions(model))
    unsupported: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS or not op_table.is_known(node.op_type):
            key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
            unsupported.setdefault(key, []).append(node.name or f"#{i}")
    if unsupported:
        raise UnsupportedOpsError(unsupported)
    try:
        onnx.checker.check_model(_skeleton(model))
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the model fails ONNX's checker: {_first_line(exc)}") from exc
    return opset


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its initializers declared as typed inputs instead of carrying their data.

    The checker then validates structure, schemas and types without serializing the weights;
    each initializer's data is checked against its dims when the frontend reads it.
    """
    skeleton = onnx.ModelProto(ir_version=model.ir_version, producer_name=model.producer_name)
    skeleton.opset_import.extend(model.opset_import)
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {i.name for i in model.graph.input}
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                       for t in model.graph.initializer if t.name not in declared)
    return skeleton


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Shapes of the model's inputs

def input_values(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> list[_Value]:
    initializer_names = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializer_names]
    known = {i.name for i in inputs}
    strangers = sorted(set(shapes) - known)
    if strangers:
        raise ShapeError(f"--shape names unknown input(s) {', '.join(strangers)}; the model's "
                         f"inputs are {', '.join(sorted(known))}")
    return [_input_value(i, shapes.get(i.name)) for i in inputs]


def _input_value(info: onnx.ValueInfoProto, given: Sequence[int] | None) -> _Value:
    ttype = info.type.tensor_type
    if not info.type.HasField("tensor_type"):
        raise ModelError(f"input {info.name!r} is not a tensor; only tensor inputs are supported")
    dtype = _np_dtype(ttype.elem_type, f"input {info.name!r}")
    declared = list(ttype.shape.dim) if ttype.HasField("shape") else None
    if given is not None:
        shape = tuple(int(d) for d in given)
        if declared is not None and len(declared) != len(shape):
            raise ShapeError(f"--shape {info.name} has {len(shape)} dimensions but the model "
                             f"declares {len(declared)}")
        for axis, (dim, value) in enumerate(zip(declared or [], shape)):
            if dim.HasField("dim_value") and dim.dim_value != value:
                raise ShapeError(f"--shape {info.name}: axis {axis} is fixed to {dim.dim_value} "
                                 f"by the model, not {value}")
    else:
        if declared is None:
            raise ShapeError(f"input {info.name!r} has no declared shape; pass "
                             f"--shape {info.name}=d0,d1,…")
        shape = tuple(_static_dim(info.name, axis, dim) for axis, dim in enumerate(declared))
    if any(d < 0 for d in shape):
        raise ShapeError(f"input {info.name!r} has a negative dimension: {shape}")
    _check_size(info.name, shape)
    return _Value(info.name, dtype, shape)


def _static_dim(name: str, axis: int, dim: onnx.TensorShapeProto.Dimension) -> int:
    if dim.HasField("dim_value"):
        return dim.dim_value
    symbol = dim.dim_param or "?"
    raise ShapeError(f"input {name!r} has symbolic dimension {symbol!r} at axis {axis}; pass its "
                     f"value, e.g. --shape {name}=1,128")


def _check_size(name: str, shape: tuple[int, ...]) -> None:
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise ShapeError(f"tensor {name!r} of shape {shape} has more than {MAX_TENSOR_ELEMENTS} "
                         f"elements")


def _np_dtype(elem_type: int, what: str) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError) as exc:
        raise ModelError(f"{what} has an unsupported element type "
                         f"{onnx.TensorProto.DataType.Name(elem_type)}") from exc


# ---------------------------------------------------------------------------------------------
# Walking the nodes: shapes, constant folding, pass-through ops

class _Walker:
    def __init__(self, model: onnx.ModelProto, opset: int):
        self.model = model
        self.opset = opset
        self.values: dict[str, _Value] = {}
        self.alias: dict[str, str] = {}  # output of a dropped Identity/Dropout -> its input
        self.nodes: list[tuple[onnx.NodeProto, dict[str, Any]]] = []

    @cached_property
    def model_outputs(self) -> set[str]:
        return {o.name for o in self.model.graph.output}

    def names_a_model_value(self, name: str) -> bool:
        """Is `name` a model input, a model output or a constant (a name the model keeps)?"""
        inputs = {i.name for i in self.model.graph.input}
        return name in inputs or name in self.model_outputs or self.value(name).data is not None

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def value(self, name: str) -> _Value:
        return self.values[self.resolve(name)]

    def add_constant(self, name: str, data: np.ndarray) -> None:
        self.values[name] = _Value(name, data.dtype.name, tuple(data.shape), data)

    def walk(self, inputs: list[_Value]) -> None:
        for v in inputs:
            self.values[v.name] = v
        for t in self.model.graph.initializer:
            self.add_constant(t.name, _initializer_array(t))
        for node in self.model.graph.node:
            self.visit(node)

    def visit(self, node: onnx.NodeProto) -> None:
        attrs = _normalize_attrs(node, self.opset)
        if node.op_type == "Constant":
            self.add_constant(node.output[0], _constant_value(node))
            return
        inputs = [self.resolve(i) if i else "" for i in node.input]
        node = _with_named_outputs(_with_inputs(node, inputs))
        if node.op_type in PASS_THROUGH_OPS and self.passes_through(node, attrs):
            return
        if self.try_fold(node):
            return
        self.infer(node)  # at the model's opset, before its attributes move to inputs
        self.nodes.append(self.attributes_to_inputs(node, attrs))

    def passes_through(self, node: onnx.NodeProto, attrs: dict[str, Any]) -> bool:
        if node.op_type == "Dropout" and attrs.get("training_mode_input", False):
            return False
        if node.output[0] in self.model_outputs and self.names_a_model_value(node.input[0]):
            return False  # dropping it would give one tensor two of the model's names
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            mode = self.value(node.input[2]).data
            if mode is None or bool(np.asarray(mode).item()):
                return False
        self.alias[node.output[0]] = node.input[0]
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
            self.add_constant(node.output[1], np.ones(self.value(node.input[0]).shape, dtype=bool))
        return True

    def attributes_to_inputs(self, node: onnx.NodeProto, attrs: dict[str, Any]):
        moves = [m for m in ATTRIBUTES_NOW_INPUTS.get(node.op_type, []) if self.opset <= m[3]]
        if not moves or not any(name in attrs for name, *_ in moves):
            return node, attrs
        inputs = list(node.input)
        for name, position, dtype, _ in moves:
            if name not in attrs:
                continue
            const_name = f"{node.output[0]}::{name}"
            self.add_constant(const_name, np.asarray(attrs.pop(name), dtype=dtype))
            inputs += [""] * (position + 1 - len(inputs))
            inputs[position] = const_name
        return _with_inputs(node, inputs), attrs

    def try_fold(self, node: onnx.NodeProto) -> bool:
        if node.op_type in NON_FOLDABLE_OPS:
            return False
        present = [i for i in node.input if i]
        if node.op_type in ("Shape", "Size"):
            data = _shape_or_size(node, self.value(node.input[0]).shape, self.opset)
            self.add_constant(node.output[0], data)
            return True
        if not all(self.value(i).data is not None for i in present):
            return False
        results = _evaluate(node, [self.value(i).data if i else None for i in node.input],
                            self.opset)
        in_bytes = sum(self.value(i).data.nbytes for i in present)
        out_bytes = sum(r.nbytes for r in results)
        if out_bytes > FOLD_SMALL_BYTES and out_bytes > FOLD_MAX_GROWTH * in_bytes:
            return False  # e.g. a constant Expand to a huge shape: cheaper to compute than store
        for name, data in zip(node.output, results):
            if name:
                self.add_constant(name, data)
        return True

    def infer(self, node: onnx.NodeProto) -> None:
        types, data = {}, {}
        for name in node.input:
            if not name:
                continue
            v = self.value(name)
            types[name] = helper.make_tensor_type_proto(
                helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)), v.shape)
            if v.data is not None and v.data.size <= 4096:
                data[name] = numpy_helper.from_array(v.data, name)
        try:
            schema = onnx.defs.get_schema(node.op_type, self.opset, "")
            out_types = shape_inference.infer_node_outputs(
                schema, node, types, data, opset_imports=[helper.make_opsetid("", self.opset)])
        except Exception as exc:  # onnx raises several exception types for inference failures
            raise ShapeError(f"shape inference failed at {node.op_type} node "
                             f"{node.name or node.output[0]!r}: {_first_line(exc)}") from exc
        for name in node.output:
            if name:
                self.values[name] = _value_from_type(name, out_types.get(name), node)


def _initializer_array(tensor: onnx.TensorProto) -> np.ndarray:
    try:
        data = numpy_helper.to_array(tensor)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"initializer {tensor.name!r} does not hold the data its dims "
                         f"{list(tensor.dims)} declare: {_first_line(exc)}") from exc
    if tuple(data.shape) != tuple(tensor.dims):
        raise ModelError(f"initializer {tensor.name!r} holds shape {data.shape}, "
                         f"not its declared dims {list(tensor.dims)}")
    return data


def _with_inputs(node: onnx.NodeProto, inputs: Sequence[str]) -> onnx.NodeProto:
    if list(node.input) == list(inputs):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.input[:]
    copy.input.extend(inputs)
    return copy


def _with_named_outputs(node: onnx.NodeProto) -> onnx.NodeProto:
    """Drop trailing omitted outputs and name inner ones, so outputs keep their positions."""
    outputs = list(node.output)
    while outputs and not outputs[-1]:
        outputs.pop()
    anchor = next((o for o in outputs if o), node.name or node.op_type)
    outputs = [o or f"{anchor}::unused{i}" for i, o in enumerate(outputs)]
    if outputs == list(node.output):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.output[:]
    copy.output.extend(outputs)
    return copy


def _value_from_type(name: str, ttype: onnx.TypeProto | None, node: onnx.NodeProto) -> _Value:
    where = f"output {name!r} of {node.op_type} node {node.name or name!r}"
    if ttype is None or not ttype.HasField("tensor_type"):
        raise ShapeError(f"could not infer the type of {where}")
    tt = ttype.tensor_type
    if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
        raise ShapeError(f"could not infer a static shape for {where}; its shape depends on "
                         f"run-time values")
    shape = tuple(d.dim_value for d in tt.shape.dim)
    _check_size(name, shape)
    return _Value(name, _np_dtype(tt.elem_type, where), shape)


def _normalize_attrs(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    attrs = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode("utf-8", "replace") for v in value]
        attrs[a.name] = value
    return attrs


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    return _evaluate(node, [], 0)[0]


def _shape_or_size(node: onnx.NodeProto, shape: tuple[int, ...], opset: int) -> np.ndarray:
    if node.op_type == "Size":
        return np.asarray(math.prod(shape), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.asarray(shape[slice(start, end)], dtype=np.int64)


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    """Run one node on constant inputs (constant folding): onnxruntime, else onnx's reference."""
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
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or 21)],
                              ir_version=FOLD_IR_VERSION)
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


# ---------------------------------------------------------------------------------------------
# Building the ECG

def build_graph(walker: _Walker, inputs: list[_Value], name: str) -> Graph:
    outputs = [walker.resolve(o.name) for o in walker.model.graph.output]
    nodes = _live_nodes(walker.nodes, outputs)
    ids: dict[str, str] = {}
    tensors: dict[str, Tensor] = {}

    def tensor_id(model_name: str) -> str:
        if model_name not in ids:
            v = walker.values[model_name]
            tid = f"t{len(ids)}"
            ids[model_name] = tid
            tensors[tid] = Tensor(tid, v.shape, v.dtype, model_name, v.data)
        return ids[model_name]

    for v in inputs:
        tensor_id(v.name)
    bare = []
    for index, (node, attrs) in enumerate(nodes):
        bare.append(Op(
            id=f"op{index}", op_type=node.op_type,
            inputs=tuple(tensor_id(i) if i else None for i in node.input),
            outputs=tuple(tensor_id(o) for o in node.output),
            attrs=attrs, source_name=node.name))
    output_ids = [tensor_id(o) for o in outputs]
    for model_name, tid in zip((o.name for o in walker.model.graph.output), output_ids):
        if tensors[tid].source_name != model_name:  # output of a dropped Identity: keep its name
            tensors[tid] = Tensor(tid, tensors[tid].shape, tensors[tid].dtype,
                                  model_name, tensors[tid].data)
    draft = Graph(tensors, bare, [ids[v.name] for v in inputs], output_ids, walker.opset, name)
    return draft.with_ops([op_table.annotate(op, draft) for op in bare])


def _live_nodes(nodes: list[tuple[onnx.NodeProto, dict]], outputs: list[str]):
    """Drop nodes none of whose outputs reach a model output."""
    needed = set(outputs)
    live = []
    for node, attrs in reversed(nodes):
        if any(o in needed for o in node.output if o):
            live.append((node, attrs))
            needed.update(i for i in node.input if i)
    return list(reversed(live))


def load(path: str | Path, shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """Load an ONNX model into a static-shape ECG."""
    return build(read_model(path), shapes or {}, Path(path).stem)


def build(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], name: str) -> Graph:
    """Check a loaded model, fix its shapes, fold constants and build the ECG."""
    opset = check_model(model)
    inputs = input_values(model, shapes)
    walker = _Walker(model, opset)
    walker.walk(inputs)
    return build_graph(walker, inputs, name)


def op_histogram(graph: Graph) -> Counter:
    return Counter(op.op_type for op in graph.ops)


def parse_shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse `name=1,128` from the command line."""
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, tuple(int(d) for d in dims.split(",") if d.strip() != "")
    except ValueError:
        raise ShapeError(f"--shape expects NAME=D0,D1,… with integer dimensions, got {text!r}")
