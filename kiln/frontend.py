"""Frontend: an ONNX file → the ECG.

Loads the model (external data confined to the model's folder), inlines its local functions,
checks it (operators, string attribute values), fixes every symbolic dimension from
caller-supplied shapes, infers static shapes node by node, folds constant sub-graphs (`kiln.fold`),
drops Identity and inference-time Dropout, and builds the annotated ECG.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper, shape_inference
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model, uses_external_data

from kiln import fold
from kiln import ops as op_table
from kiln.ecg import Graph, Op, Tensor
from kiln.errors import ModelError, ShapeError, UnsupportedOpsError

DEFAULT_DOMAINS = ("", "ai.onnx")
MAX_TENSOR_ELEMENTS = 1 << 31  # larger tensors cannot be indexed with 32-bit offsets
MAX_INLINED_NODES = 1 << 18  # nodes a model may have once its local functions are inlined
FOLD_IR_VERSION = fold.IR_VERSION  # kiln.runtime.cli reads it here
# Floating-point types the code generator does not compute in (it computes float32 and float64).
NARROW_FLOATS = frozenset({"float16", "bfloat16"})


@dataclass
class _Value:
    """A tensor while the frontend walks the model: its type and, if known, its constant value."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


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
        inline_functions(model)
    unsupported: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS or not op_table.is_known(node.op_type):
            key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
            unsupported.setdefault(key, []).append(node.name or f"#{i}")
    if unsupported:
        raise UnsupportedOpsError(unsupported)
    for i, node in enumerate(model.graph.node):
        _check_string_attributes(node, i)
    try:
        onnx.checker.check_model(_skeleton(model))
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the model fails ONNX's checker: {_first_line(exc)}") from exc
    return opset


def inline_functions(model: onnx.ModelProto) -> None:
    """Replace calls of the model's local functions by their bodies, refusing (before inlining)
    a model whose inlined graph would exceed `MAX_INLINED_NODES` nodes or whose functions call
    themselves."""
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    sizes: dict[tuple[str, str, str], int] = {}
    calling: list[tuple[str, str, str]] = []

    def size(nodes: Sequence[onnx.NodeProto]) -> int:
        total = 0
        for node in nodes:
            key = (node.domain, node.op_type, node.overload)
            total += function_size(key) if key in functions else 1
            total += sum(size(g.node) for g in _subgraphs(node))
            if total > MAX_INLINED_NODES:
                break  # already too large: the caller reports it
        return total

    def function_size(key: tuple[str, str, str]) -> int:
        if key in calling:
            chain = " → ".join(k[1] for k in calling[calling.index(key):] + [key])
            raise ModelError(f"local function {key[1]!r} calls itself ({chain})")
        if key not in sizes:
            calling.append(key)
            sizes[key] = size(functions[key].node)
            calling.pop()
        return sizes[key]

    total = size(model.graph.node)
    if total > MAX_INLINED_NODES:
        raise ModelError(f"the model's local functions inline to more than {MAX_INLINED_NODES} "
                         f"nodes; Kiln refuses graphs this large")
    try:
        model.CopyFrom(onnx.inliner.inline_local_functions(model))
    except Exception as exc:  # onnx raises several exception types on malformed functions
        raise ModelError(f"could not inline the model's local functions: {_first_line(exc)}") from exc


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _check_string_attributes(node: onnx.NodeProto, index: int) -> None:
    """A string attribute must have one of the values the op's record allows."""
    info = op_table.op_info(node.op_type)
    for attr in node.attribute:
        if attr.type not in (onnx.AttributeProto.STRING, onnx.AttributeProto.STRINGS):
            continue
        value = helper.get_attribute_value(attr)
        values = value if isinstance(value, list) else [value]
        bad = info.invalid_string_attr(attr.name, [v.decode("utf-8", "replace") for v in values])
        if bad is not None:
            allowed = ", ".join(sorted(info.string_attrs[attr.name]))
            raise ModelError(f"{node.op_type} node {node.name or f'#{index}'!r}: attribute "
                             f"{attr.name} has an unknown value {bad[:80]!r}; allowed: {allowed}")


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
        inputs = [self.resolve(i) if i else "" for i in node.input]
        node = _with_named_outputs(_with_inputs(node, inputs))
        passes_through = _PASS_THROUGH.get(node.op_type)
        if passes_through is not None and passes_through(self, node, attrs):
            return
        if self.try_fold(node, attrs):
            return
        if not all(o in self.values for o in node.output if o):  # try_fold may have inferred them
            self.infer(node)  # at the model's opset, before its attributes move to inputs
        self.nodes.append(self.attributes_to_inputs(node, attrs))

    def drop_pass_through(self, node: onnx.NodeProto) -> bool:
        """Drop an op that passes its first input through: its output becomes an alias."""
        if node.output[0] in self.model_outputs and self.names_a_model_value(node.input[0]):
            return False  # dropping it would give one tensor two of the model's names
        self.alias[node.output[0]] = node.input[0]
        return True

    def attributes_to_inputs(self, node: onnx.NodeProto, attrs: dict[str, Any]):
        moves = [m for m in op_table.op_info(node.op_type).attributes_now_inputs
                 if self.opset <= m[3]]
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

    def try_fold(self, node: onnx.NodeProto, attrs: dict[str, Any]) -> bool:
        """Evaluate the node now if its inputs are constant and its result is worth storing.

        The result's size comes from shape inference before anything is evaluated; only when
        inference cannot tell (a data-dependent shape) is the node evaluated first, as its
        output is then bounded by its inputs."""
        if not fold.foldable(node.op_type):
            return False
        from_shape = _FROM_SHAPE.get(node.op_type)
        if from_shape is not None:
            self.add_constant(node.output[0], from_shape(self.value(node.input[0]).shape, attrs))
            return True
        present = [i for i in node.input if i]
        if not all(self.value(i).data is not None for i in present):
            return False
        in_bytes = (sum(self.value(i).data.nbytes for i in present)
                    + sum(v.nbytes for v in attrs.values() if isinstance(v, np.ndarray)))
        if self.infer(node, static_only=False):
            out_bytes = sum(self.value(o).nbytes for o in node.output)
            if not fold.worth_storing(out_bytes, in_bytes):
                return False
        results = fold.evaluate(node, [self.value(i).data if i else None for i in node.input],
                                self.opset)
        if not fold.worth_storing(sum(r.nbytes for r in results), in_bytes):
            return False
        for name, data in zip(node.output, results):
            if name:
                self.add_constant(name, data)
        return True

    def infer(self, node: onnx.NodeProto, static_only: bool = True) -> bool:
        """Infer the node's output types; False (with `static_only` off) when inference fails or
        gives a shape that depends on run-time values. Too large an output always raises."""
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
            if not static_only:
                return False
            raise ShapeError(f"shape inference failed at {node.op_type} node "
                             f"{node.name or node.output[0]!r}: {_first_line(exc)}") from exc
        values = [_value_from_type(name, out_types.get(name), node, static_only)
                  for name in node.output if name]
        if any(v is None for v in values):
            return False
        self.values.update((v.name, v) for v in values)
        return True


def _drop_identity(walker: _Walker, node: onnx.NodeProto, attrs: dict[str, Any]) -> bool:
    return walker.drop_pass_through(node)


def _drop_dropout(walker: _Walker, node: onnx.NodeProto, attrs: dict[str, Any]) -> bool:
    """Dropout at inference (no training mode, or a constant false one) is the identity; its mask
    output, if used, is all ones."""
    if attrs.get("training_mode_input", False):
        return False
    if len(node.input) > 2 and node.input[2]:
        mode = walker.value(node.input[2]).data
        if mode is None or bool(np.asarray(mode).item()):
            return False
    if not walker.drop_pass_through(node):
        return False
    if len(node.output) > 1 and node.output[1]:
        walker.add_constant(node.output[1], np.ones(walker.value(node.input[0]).shape, dtype=bool))
    return True


# Ops that pass their input through at inference time, each with the test of when it does.
_PASS_THROUGH: dict[str, Callable[[_Walker, onnx.NodeProto, dict[str, Any]], bool]] = {
    "Identity": _drop_identity,
    "Dropout": _drop_dropout,
}


def _shape_of(shape: tuple[int, ...], attrs: dict[str, Any]) -> np.ndarray:
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.asarray(shape[slice(start, end)], dtype=np.int64)


def _size_of(shape: tuple[int, ...], attrs: dict[str, Any]) -> np.ndarray:
    return np.asarray(math.prod(shape), dtype=np.int64)


# Ops whose value follows from their input's (static) shape alone.
_FROM_SHAPE: dict[str, Callable[[tuple[int, ...], dict[str, Any]], np.ndarray]] = {
    "Shape": _shape_of,
    "Size": _size_of,
}


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


def _value_from_type(name: str, ttype: onnx.TypeProto | None, node: onnx.NodeProto,
                     static_only: bool = True) -> _Value | None:
    """The inferred value of output `name`: None (with `static_only` off) when its shape is not
    static; a ShapeError when it is too large."""
    where = f"output {name!r} of {node.op_type} node {node.name or name!r}"
    static = (ttype is not None and ttype.HasField("tensor_type")
              and ttype.tensor_type.HasField("shape")
              and all(d.HasField("dim_value") for d in ttype.tensor_type.shape.dim))
    if not static:
        if not static_only:
            return None
        if ttype is None or not ttype.HasField("tensor_type"):
            raise ShapeError(f"could not infer the type of {where}")
        raise ShapeError(f"could not infer a static shape for {where}; its shape depends on "
                         f"run-time values")
    tt = ttype.tensor_type
    shape = tuple(d.dim_value for d in tt.shape.dim)
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise ShapeError(f"{where} would have shape {shape}: {math.prod(shape)} elements, more "
                         f"than {MAX_TENSOR_ELEMENTS}")
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
    graph = build_graph(walker, inputs, name)
    _check_computable_dtypes(graph)
    return graph


def _check_computable_dtypes(graph: Graph) -> None:
    """Refuse a model that computes in a floating-point type Kiln does not generate code for
    (constants of that type folded away, e.g. float16 weights cast to float32, are fine)."""
    used = [*graph.inputs, *graph.outputs,
            *(t for op in graph.ops for t in (*op.present_inputs(), *op.outputs))]
    for tid in dict.fromkeys(used):
        tensor = graph.tensors[tid]
        if tensor.dtype in NARROW_FLOATS:
            raise ModelError(f"{tensor.dtype} is not supported: tensor "
                             f"{tensor.source_name or tid!r} is {tensor.dtype}; Kiln computes in "
                             f"float32 and float64 (convert the model to float32)")


def parse_shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse `name=1,128` from the command line."""
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, tuple(int(d) for d in dims.split(",") if d.strip() != "")
    except ValueError:
        raise ShapeError(f"--shape expects NAME=D0,D1,… with integer dimensions, got {text!r}")
