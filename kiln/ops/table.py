"""Every operator of the default ONNX domain, registered with its record (`kiln.ops.OpInfo`).

The table is data-driven: `_TABLE` lists op families (names sharing one mapping rule and one FLOP
rule), and the sets below it mark the ops Table 2 of DNNFusion lists, the compute-intensive layers
(CIL of Table 5), the opaque ops, the math properties and every other fact a pass asks about an
op. Ops Table 2 does not list are classified by §3.1's definitions of the five mapping types.
These sets are the only lists of op names that decide a property; `_record` turns them into one
record per op.
"""
from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np
import onnx

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import (ANY_TEXT, ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE, FlopRule, MappingRule,
                      OpInfo, Pattern, RowLocality, ShapeRule, ValueFlow, attr_default,
                      register)

O2O, REO, SHU, O2M, M2M = (
    MappingType.ONE_TO_ONE,
    MappingType.REORGANIZE,
    MappingType.SHUFFLE,
    MappingType.ONE_TO_MANY,
    MappingType.MANY_TO_MANY,
)

_ONNX_TYPE_NAMES = tuple(onnx.TensorProto.DataType.keys())

# --- per-element costs (FLOPs) -----------------------------------------------------------------
_ARITH = 1  # add, mul, compare, select, min/max, logic, rounding, relu-like
_DIV = 4  # divide, reciprocal, sqrt, mod; piecewise-rational activations (HardSigmoid, Softsign)
_TRANS = 8  # exp, log, trig, erf, tanh, sigmoid, pow, and activations built on one of them
_BATCHNORM = 4  # (x - mean) * inv_std * scale + bias, statistics given as inputs
_NORM = 8  # normalizations computing statistics: mean, variance, normalize, scale, shift
_SOFTMAX = 5  # max, subtract, exp (counted as one pass), sum, divide


# --- mapping rules ------------------------------------------------------------------------------
def _broadcast_mapping(op: Op, graph: Graph) -> MappingType:
    """Elementwise ops with several inputs: One-to-Many when a runtime input is broadcast.

    Only activation inputs count: a constant (a bias vector, a scalar) read with broadcast is a
    weight access, not a fusion edge. When every input is constant the rule covers all of them.
    An input is broadcast when it has fewer elements than the output (padding a shape with leading
    1s, e.g. (3,) against (1, 3), keeps the element mapping one-to-one).
    """
    out = graph.tensors[op.outputs[0]].numel
    inputs = graph.activation_inputs(op) or op.present_inputs()
    return O2M if any(graph.tensors[t].numel < out for t in inputs) else O2O


# --- FLOP rules ---------------------------------------------------------------------------------
def _shape(graph: Graph, tensor_id: str) -> tuple[int, ...]:
    return graph.tensors[tensor_id].shape


def _input(op: Op, index: int) -> str | None:
    return op.inputs[index] if index < len(op.inputs) else None


def _out_numel(op: Op, graph: Graph) -> int:
    return graph.tensors[op.outputs[0]].numel


def _elementwise(cost: int) -> FlopRule:
    """`cost` FLOPs per output element."""
    return lambda op, graph: cost * _out_numel(op, graph)


def _variadic(cost: int, finish: int = 0) -> FlopRule:
    """Sum/Mean/Max/Min of k inputs: k - 1 combining steps (plus `finish`, Mean's scaling)."""
    def flops(op: Op, graph: Graph) -> int:
        steps = max(1, len(op.present_inputs()) - 1)
        return (cost * steps + finish) * _out_numel(op, graph)
    return flops


def _data_movement(op: Op, graph: Graph) -> int:
    return 0


def _reduction(op: Op, graph: Graph) -> int:
    """One combining step per element of the reduced input."""
    return graph.tensors[op.inputs[0]].numel


def _input_numel(op: Op, graph: Graph) -> int:
    """Estimate for irregular ops (control flow, sorting, data-dependent shapes, signal transforms,
    losses, string and sequence ops): one operation per input element."""
    return sum(graph.tensors[t].numel for t in op.present_inputs())


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """2·batch·M·N·K under numpy's rules: 1-D operands are promoted, batch dims broadcast."""
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    batch = math.prod(np.broadcast_shapes(a2[:-2], b2[:-2]))
    return 2 * batch * a2[-2] * a2[-1] * b2[-1]


def _matmul(a: int, b: int) -> FlopRule:
    """MatMul-like op whose operands are inputs `a` and `b` (QLinearMatMul interleaves scales)."""
    return lambda op, graph: _matmul_flops(_shape(graph, op.inputs[a]), _shape(graph, op.inputs[b]))


def _gemm(op: Op, graph: Graph) -> int:
    a, b = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    m, k = (a[1], a[0]) if op.attrs.get("transA", 0) else a
    n = b[0] if op.attrs.get("transB", 0) else b[1]
    bias = m * n if _input(op, 2) is not None else 0
    return 2 * m * n * k + bias


def _conv(weight: int, bias: int | None) -> FlopRule:
    """2·N·Cout·prod(out spatial)·(Cin/group)·prod(kernel), plus one add per output for the bias.

    Weights are (Cout, Cin/group, *kernel); `weight`/`bias` are their input positions.
    """
    def flops(op: Op, graph: Graph) -> int:
        out = _out_numel(op, graph)
        per_output = math.prod(_shape(graph, op.inputs[weight])[1:])
        has_bias = bias is not None and _input(op, bias) is not None
        return 2 * out * per_output + (out if has_bias else 0)
    return flops


def _conv_transpose(op: Op, graph: Graph) -> int:
    """Every input element times its (Cout/group)·prod(kernel) weights (W is (Cin, Cout/group, *k)),
    plus the bias."""
    per_input = math.prod(_shape(graph, op.inputs[1])[1:])
    bias = _out_numel(op, graph) if _input(op, 2) is not None else 0
    return 2 * graph.tensors[op.inputs[0]].numel * per_input + bias


def _causal_conv(op: Op, graph: Graph) -> int:
    """Depthwise causal 1-D conv (weight (C, 1, k)) with optional bias and fused SiLU."""
    out = _out_numel(op, graph)
    bias = out if _input(op, 2) is not None else 0
    activation = _TRANS * out if op.attrs.get("activation", "none") != "none" else 0
    return 2 * out * _shape(graph, op.inputs[1])[-1] + bias + activation


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> int:
    """2 × the product of every index extent (ellipsis dims broadcast across operands)."""
    terms = equation.replace(" ", "").split("->")[0].split(",")
    extents: dict[str, int] = {}
    ellipsis: tuple[int, ...] = ()
    for term, shape in zip(terms, shapes):
        letters = term.replace("...", "")
        dims = shape
        if "..." in term:
            start, width = term.index("..."), len(shape) - len(letters)
            ellipsis = np.broadcast_shapes(ellipsis, shape[start:start + width])
            dims = shape[:start] + shape[start + width:]
        for letter, extent in zip(letters, dims):
            extents[letter] = max(extents.get(letter, 1), extent)
    return 2 * math.prod(extents.values()) * math.prod(ellipsis)


def _einsum(op: Op, graph: Graph) -> int:
    shapes = [_shape(graph, t) for t in op.present_inputs()]
    return _einsum_flops(op.attrs["equation"], shapes)


def _recurrent(gates: int, state_update: int) -> FlopRule:
    """LSTM/GRU/RNN: per direction, step and batch row, the gate matmuls
    2·gates·hidden·(input + hidden), and per hidden unit two bias adds and an activation per gate
    plus the state update (LSTM: 3 mul, 1 add, tanh(c); GRU: 4 arithmetic ops)."""
    def flops(op: Op, graph: Graph) -> int:
        directions, gate_rows, input_size = _shape(graph, op.inputs[1])  # W
        hidden = gate_rows // gates
        steps_x_batch = graph.tensors[op.inputs[0]].numel // input_size
        matmuls = 2 * gate_rows * (input_size + hidden)
        elementwise = hidden * (gates * (2 * _ARITH + _TRANS) + state_update)
        return directions * steps_x_batch * (matmuls + elementwise)
    return flops


def _attention(op: Op, graph: Graph) -> int:
    """Q·Kᵀ and P·V (2·head_dim each per score) plus softmax, per (batch, head, query, key)."""
    q, k = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    if len(q) == 4:  # (batch, heads, seq, head_dim)
        head_dim, kv_len = q[-1], k[2]
    else:  # (batch, seq, heads·head_dim)
        head_dim, kv_len = q[-1] // op.attrs["q_num_heads"], k[1]
    past_key = _input(op, 4)
    if past_key is not None:
        kv_len += _shape(graph, past_key)[2]
    rows = math.prod(q) // head_dim
    v_dim = _out_numel(op, graph) // rows
    return rows * kv_len * (2 * head_dim + 2 * v_dim + _SOFTMAX)


def _linear_attention(op: Op, graph: Graph) -> int:
    """Per token and query head: the state update k⊗v and the readout qᵀS (2·d_k·d_v each), and
    for the delta rules the correction Sᵀk (another 2·d_k·d_v)."""
    heads = op.attrs["q_num_heads"]
    v_dim = _shape(graph, op.outputs[0])[-1] // heads
    passes = 6 if "delta" in op.attrs.get("update_rule", "gated_delta") else 4
    return passes * graph.tensors[op.inputs[0]].numel * v_dim


def _pool(op: Op, graph: Graph) -> int:
    return _out_numel(op, graph) * math.prod(op.attrs["kernel_shape"])


def _lrn(op: Op, graph: Graph) -> int:
    """Sum of squares over `size` channels, then (bias + alpha/size·sum)^beta and a divide."""
    return _out_numel(op, graph) * (2 * op.attrs["size"] + _TRANS + _DIV)


_TAPS = {"nearest": 0, "linear": 2, "bilinear": 2, "cubic": 4, "bicubic": 4}


def _interpolated_axes(op: Op, graph: Graph) -> int:
    if op.op_type == "GridSample":
        return len(_shape(graph, op.inputs[0])) - 2
    before, after = _shape(graph, op.inputs[0]), _shape(graph, op.outputs[0])
    return sum(b != a for b, a in zip(before, after))


def _interpolation(op: Op, graph: Graph) -> int:
    """Resize/Upsample/GridSample: a multiply-add per tap, taps^axes per output (nearest: 0)."""
    taps = _TAPS[op.attrs.get("mode", attr_default(op.op_type, "mode", graph.opset))]
    return 0 if taps == 0 else 2 * taps ** _interpolated_axes(op, graph) * _out_numel(op, graph)


def _affine_grid(op: Op, graph: Graph) -> int:
    """Each output coordinate is a dot product of a theta row with (x, y[, z], 1)."""
    spatial = _shape(graph, op.outputs[0])[-1]
    return 2 * (spatial + 1) * _out_numel(op, graph)


def _scatter(op: Op, graph: Graph) -> int:
    """A copy, unless updates are combined with a reduction (one op per update element)."""
    return 0 if op.attrs.get("reduction", "none") == "none" else graph.tensors[op.inputs[2]].numel


# --- the table ----------------------------------------------------------------------------------
# (op names, mapping type or rule, FLOP rule), grouped by family.
_TABLE: tuple[tuple[str, MappingRule, FlopRule], ...] = (
    # One-to-One: unary elementwise maths.
    ("Abs Neg Relu LeakyRelu ThresholdedRelu Shrink Sign Ceil Floor Round Clip Not BitwiseNot "
     "IsInf IsNaN", O2O, _elementwise(_ARITH)),
    ("Reciprocal Sqrt HardSigmoid HardSwish Softsign", O2O, _elementwise(_DIV)),
    ("Exp Log Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Erf Tanh Sigmoid Elu Selu "
     "Celu Gelu Mish Softplus Swish", O2O, _elementwise(_TRANS)),
    ("BatchNormalization", O2O, _elementwise(_BATCHNORM)),
    # One-to-One: copies, type changes, and pieces of one tensor (Concat/Slice/Split, Table 2).
    ("Identity Dropout Cast CastLike BitCast Concat Slice Split Trilu Constant", O2O,
     _data_movement),
    # Elementwise with several inputs: One-to-One, or One-to-Many when broadcast.
    ("Add Sub Mul PRelu Where Equal Greater GreaterOrEqual Less LessOrEqual And Or Xor BitShift "
     "BitwiseAnd BitwiseOr BitwiseXor", _broadcast_mapping, _elementwise(_ARITH)),
    ("Div Mod QuantizeLinear", _broadcast_mapping, _elementwise(_DIV)),
    ("DequantizeLinear", _broadcast_mapping, _elementwise(2 * _ARITH)),  # (x - zero_point) * scale
    ("Pow SwiGLU", _broadcast_mapping, _elementwise(_TRANS)),
    ("Sum Max Min", _broadcast_mapping, _variadic(_ARITH)),
    ("Mean", _broadcast_mapping, _variadic(_ARITH, finish=_ARITH)),
    # One-to-Many: one input element feeds several outputs (replication, gathers, padding).
    ("Expand Gather GatherElements GatherND Tile Pad CenterCropPad OneHot TensorScatter",
     O2M, _data_movement),
    ("Resize Upsample GridSample", O2M, _interpolation),
    # One-to-Many: generators, a few scalars (or only a shape) expanded to the whole output.
    ("ConstantOfShape EyeLike", O2M, _data_movement),
    ("Range MelWeightMatrix", O2M, _elementwise(_ARITH)),
    ("HannWindow HammingWindow BlackmanWindow", O2M, _elementwise(_TRANS)),
    ("RandomNormal RandomUniform RandomNormalLike RandomUniformLike", O2M, _elementwise(_TRANS)),
    ("Bernoulli", O2O, _elementwise(_TRANS)),
    # Reorganize: the same elements in the same order under a new shape.
    ("Flatten Reshape Squeeze Unsqueeze", REO, _data_movement),
    # Shuffle: a permutation of the elements.
    ("Transpose DepthToSpace SpaceToDepth ReverseSequence", SHU, _data_movement),
    # Many-to-Many: contractions.
    ("MatMul MatMulInteger", M2M, _matmul(0, 1)),
    ("QLinearMatMul", M2M, _matmul(0, 3)),
    ("Gemm", M2M, _gemm),
    ("Conv", M2M, _conv(weight=1, bias=2)),
    ("ConvInteger", M2M, _conv(weight=1, bias=None)),
    ("QLinearConv", M2M, _conv(weight=3, bias=8)),
    ("DeformConv", M2M, _conv(weight=1, bias=3)),  # offset sampling not counted
    ("ConvTranspose", M2M, _conv_transpose),
    ("CausalConvWithState", M2M, _causal_conv),
    ("Einsum", M2M, _einsum),
    ("LSTM", M2M, _recurrent(gates=4, state_update=3 * _ARITH + _ARITH + _TRANS)),
    ("GRU", M2M, _recurrent(gates=3, state_update=4 * _ARITH)),
    ("RNN", M2M, _recurrent(gates=1, state_update=0)),
    ("Attention", M2M, _attention),
    ("LinearAttention", M2M, _linear_attention),
    ("AffineGrid", M2M, _affine_grid),
    # Many-to-Many: reductions, scans and normalizations over an axis.
    ("ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd "
     "ReduceSum ReduceSumSquare ArgMax ArgMin CumSum CumProd Hardmax GlobalAveragePool "
     "GlobalMaxPool GlobalLpPool", M2M, _reduction),
    ("Softmax LogSoftmax", M2M, _elementwise(_SOFTMAX)),
    ("InstanceNormalization LayerNormalization GroupNormalization RMSNormalization "
     "MeanVarianceNormalization LpNormalization", M2M, _elementwise(_NORM)),
    ("LRN", M2M, _lrn),
    ("AveragePool MaxPool LpPool", M2M, _pool),
    ("RotaryEmbedding", M2M, _elementwise(3 * _ARITH)),  # x·cos ± x_pair·sin
    # Many-to-Many: data-dependent writes (an output element may come from any update).
    ("Scatter ScatterElements ScatterND MaxUnpool", M2M, _scatter),
    # Many-to-Many: shape metadata (with static shapes these fold to constants).
    ("Shape Size", M2M, _data_movement),
    # Many-to-Many: irregular ops; FLOPs are estimated as one per input element.
    ("TopK NonMaxSuppression NonZero Unique Compress MaxRoiPool RoiAlign Col2Im Det DFT STFT "
     "TfIdfVectorizer NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss Multinomial "
     "DynamicQuantizeLinear ImageDecoder", M2M, _input_numel),
    # Control flow, sequences and optionals (opaque).
    ("If Loop Scan SequenceMap SequenceAt SequenceConstruct SequenceEmpty SequenceErase "
     "SequenceInsert SequenceLength SplitToSequence ConcatFromSequence Optional "
     "OptionalGetElement OptionalHasElement", M2M, _input_numel),
    # String ops (opaque).
    ("StringConcat", _broadcast_mapping, _input_numel),
    ("RegexFullMatch", O2O, _input_numel),
    ("StringSplit", O2M, _input_numel),
    ("StringNormalizer", M2M, _input_numel),  # stop-word removal changes the shape
)

# Table 2 of DNNFusion ("Reduce (e.g. ReduceProd, ReduceMean)" covers every Reduce* op).
_IN_PAPER = frozenset((
    "Add Asin BatchNormalization Cast Ceil Clip Concat Cos Erf Exp Greater LeakyRelu Log Not "
    "PRelu Reciprocal Relu Round Sigmoid Sin Slice Split Sqrt Tanh Where "
    "Expand Gather Resize Upsample "
    "AveragePool Conv ConvTranspose CumSum Einsum Gemm InstanceNormalization MaxPool Softmax "
    "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd "
    "ReduceSum ReduceSumSquare "
    "Flatten Reshape Squeeze Unsqueeze "
    "DepthToSpace SpaceToDepth Transpose").split())

# Compute-intensive layers (Table 5's CIL: each input element is used more than once): the
# contractions. Attention and LinearAttention contain matmuls and CausalConvWithState is a conv.
# Activations, reductions, pooling and normalizations are memory-intensive (MIL).
_COMPUTE_INTENSIVE = frozenset((
    "MatMul Gemm Conv ConvTranspose ConvInteger MatMulInteger QLinearConv QLinearMatMul Einsum "
    "LSTM GRU RNN DeformConv Attention LinearAttention CausalConvWithState").split())

# Never fused with anything: control flow, data-dependent output shapes, random generators,
# sequences/optionals, strings, and recurrences (a recurrent op is its own kernel).
_OPAQUE = frozenset((
    "If Loop Scan SequenceMap "
    "NonZero Unique NonMaxSuppression Compress ImageDecoder "
    "RandomNormal RandomUniform RandomNormalLike RandomUniformLike Multinomial Bernoulli "
    "SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength "
    "SplitToSequence ConcatFromSequence Optional OptionalGetElement OptionalHasElement "
    "StringNormalizer RegexFullMatch StringSplit StringConcat "
    "LSTM GRU RNN LinearAttention").split())

# Math properties driving the graph rewriter (§4.2, Table 4). Mul distributes over Add/Sub;
# Sub/Div are distributed over; MatMul/Gemm chain associatively and distribute over Add; Conv
# distributes over an Add of inputs or weights. Reductions commute with the elementwise and
# permutation ops before them (ReduceSum(BitShift(A)) = BitShift(ReduceSum(A))), as do the
# unary ops of Table 4's rules. Ops with none of these (Reshape, Transpose, Softmax, Gather,
# Concat, Cast, Relu, ...) are where the rewriter partitions the graph.
_AC = frozenset({ASSOCIATIVE, COMMUTATIVE})
_PROPERTIES: dict[str, frozenset[str]] = {
    "Mul": frozenset({ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE}),
    **dict.fromkeys("Add Sum Max Min And Or Xor BitwiseAnd BitwiseOr BitwiseXor".split(), _AC),
    **dict.fromkeys("Sub Div Conv".split(), frozenset({DISTRIBUTIVE})),
    **dict.fromkeys("MatMul Gemm".split(), frozenset({ASSOCIATIVE, DISTRIBUTIVE})),
    **dict.fromkeys(
        ("ReduceSum ReduceProd ReduceMean ReduceMax ReduceMin ReduceL1 ReduceL2 ReduceLogSumExp "
         "ReduceLogSum ReduceSumSquare BitShift Exp Log Reciprocal Sqrt Abs Neg Pow").split(),
        frozenset({COMMUTATIVE})),
}


# TVM's injective ops: pure data movement (a reshape, a slice, a gather, padding, resizing).
_INJECTIVE = frozenset((
    "Reshape Flatten Squeeze Unsqueeze Transpose Slice Concat Split Gather GatherElements GatherND "
    "Expand Tile Pad DepthToSpace SpaceToDepth Resize Upsample ReverseSequence").split())

_RECURRENT = frozenset("LSTM GRU RNN".split())

# Row-local ops (see `RowLocality`): contractions whose B operand is read whole by every row,
# reductions over trailing axes, softmax over the last axis, LayerNormalization from its axis.
_ROW_LOCALITY: dict[str, RowLocality] = {
    **dict.fromkeys("MatMul Gemm".split(), RowLocality.MATRIX_ROWS),
    **dict.fromkeys(("ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceSumSquare ReduceL1 "
                     "ReduceL2 ReduceLogSum ReduceLogSumExp").split(), RowLocality.REDUCED_AXES),
    **dict.fromkeys("Softmax LogSoftmax".split(), RowLocality.LAST_AXIS),
    "LayerNormalization": RowLocality.FROM_AXIS,
}

# Never evaluated at compile time: random generators and control flow.
_NOT_FOLDABLE = frozenset((
    "RandomNormal RandomUniform RandomNormalLike RandomUniformLike Multinomial Bernoulli "
    "If Loop Scan").split())

# Ops whose value follows from static shapes and attributes alone: the frontend always folds them.
_STATIC_VALUE = frozenset("Constant Shape Size".split())

# Ops whose output holds (some of) the values of their inputs, unchanged.
_VALUE_FLOW: dict[str, ValueFlow] = {
    **dict.fromkeys(("Cast Reshape Unsqueeze Squeeze Flatten Identity Expand Transpose Slice Tile "
                     "Split Gather GatherElements Pad").split(), ValueFlow.FIRST_INPUT),
    "Concat": ValueFlow.EVERY_INPUT,
}

# Ops whose second input indexes their first (the extent indexed bounds valid random indices).
_GATHER_INDICES: dict[str, int] = dict.fromkeys("Gather GatherElements GatherND".split(), 1)

# Binary ops whose two operands may be swapped.
_SYMMETRIC = frozenset((
    "Add Mul Max Min Sum Mean And Or Xor BitwiseAnd BitwiseOr BitwiseXor Equal").split())

# The values ONNX defines for each string attribute, over every opset.
_AUTO_PAD = frozenset({"NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"})
_RNN_ATTRS = {
    "direction": frozenset({"forward", "reverse", "bidirectional"}),
    "activations": frozenset({"Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu",
                              "ScaledTanh", "HardSigmoid", "Elu", "Softsign", "Softplus"}),
}
_LOSS_REDUCTION = {"reduction": frozenset({"none", "sum", "mean"})}
_SCATTER_REDUCTION = {"reduction": frozenset({"none", "add", "mul", "max", "min"})}
_ROUND_MODE = frozenset({"up", "down", "nearest"})
_PIXEL_ORDER = {"mode": frozenset({"DCR", "CRD"})}
_STRING_ATTRS: dict[str, dict[str, frozenset[str] | None]] = {
    **dict.fromkeys(
        "Conv ConvInteger ConvTranspose QLinearConv AveragePool MaxPool LpPool".split(),
        {"auto_pad": _AUTO_PAD}),
    **dict.fromkeys(_RECURRENT, _RNN_ATTRS),
    **dict.fromkeys("NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss".split(), _LOSS_REDUCTION),
    **dict.fromkeys("ScatterElements ScatterND".split(), _SCATTER_REDUCTION),
    **dict.fromkeys("DepthToSpace SpaceToDepth".split(), _PIXEL_ORDER),
    # opset 1 named the target type as a string
    "Cast": {"to": frozenset(_ONNX_TYPE_NAMES), "round_mode": _ROUND_MODE},
    "CastLike": {"round_mode": _ROUND_MODE},
    "BitShift": {"direction": frozenset({"LEFT", "RIGHT"})},
    "Gelu": {"approximate": frozenset({"none", "tanh"})},
    "Einsum": {"equation": ANY_TEXT},
    "Pad": {"mode": frozenset({"constant", "reflect", "edge", "wrap"})},
    "Resize": {
        "mode": frozenset({"nearest", "linear", "cubic"}),
        "coordinate_transformation_mode": frozenset({
            "half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
            "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize"}),
        "nearest_mode": frozenset({"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"}),
        "keep_aspect_ratio_policy": frozenset({"stretch", "not_larger", "not_smaller"}),
    },
    "Upsample": {"mode": frozenset({"nearest", "linear", "bilinear"})},
    "GridSample": {
        "mode": frozenset({"bilinear", "nearest", "bicubic", "linear", "cubic"}),
        "padding_mode": frozenset({"zeros", "border", "reflection"}),
    },
    "RoiAlign": {"mode": frozenset({"avg", "max"}),
                 "coordinate_transformation_mode": frozenset({"half_pixel", "output_half_pixel"})},
    "CausalConvWithState": {"activation": frozenset({"silu", "swish", "none"})},
    "LinearAttention": {"update_rule": frozenset({"linear", "gated", "delta", "gated_delta"})},
    "TensorScatter": {"mode": frozenset({"linear", "circular"})},
    "ImageDecoder": {"pixel_format": frozenset({"RGB", "BGR", "Grayscale"})},
    "StringNormalizer": {"case_change_action": frozenset({"LOWER", "UPPER", "NONE"}),
                         "locale": ANY_TEXT, "stopwords": ANY_TEXT},
    "TfIdfVectorizer": {"mode": frozenset({"TF", "IDF", "TFIDF"}), "pool_strings": ANY_TEXT},
    "Constant": {"value_string": ANY_TEXT, "value_strings": ANY_TEXT},
    "RegexFullMatch": {"pattern": ANY_TEXT},
    "StringSplit": {"delimiter": ANY_TEXT},
}

# How the rewriter infers the output of an op it creates; every other op: ONNX's inference.
_SHAPE_RULES: dict[str, ShapeRule] = {
    **dict.fromkeys((
        "Abs Neg Relu Sqrt Reciprocal Exp Log Sigmoid Tanh Erf Ceil Floor Round Sign Softplus "
        "Softsign Atan Asinh Sinh Cos Sin Tan Asin Acos Acosh Atanh Cosh Identity Gelu LeakyRelu Elu "
        "Selu Celu HardSigmoid HardSwish Mish Softmax LogSoftmax Not BitwiseNot Clip "
        "LayerNormalization BatchNormalization Dropout Hardmax CumSum").split(),
        ShapeRule.SAME_AS_FIRST),
    **dict.fromkeys(("Add Sub Mul Div Pow Max Min Mod BitShift And Or Xor BitwiseAnd BitwiseOr "
                     "BitwiseXor PRelu Sum Mean").split(), ShapeRule.BROADCAST),
    **dict.fromkeys("Equal Greater GreaterOrEqual Less LessOrEqual".split(), ShapeRule.COMPARE),
    **dict.fromkeys(("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 "
                     "ReduceLogSum ReduceLogSumExp ReduceSumSquare").split(), ShapeRule.REDUCE),
    **dict.fromkeys("ArgMax ArgMin".split(), ShapeRule.ARG_REDUCE),
    "Where": ShapeRule.SELECT, "Cast": ShapeRule.CAST, "Transpose": ShapeRule.TRANSPOSE,
    "Reshape": ShapeRule.RESHAPE, "Expand": ShapeRule.EXPAND, "MatMul": ShapeRule.MATMUL,
    "Gemm": ShapeRule.GEMM,
}


# Parameters that older opsets took as attributes and the latest opsets take as inputs.
_AXES_TO_INPUT_12 = (("axes", 1, "int64", 12),)
_ATTRIBUTES_NOW_INPUTS: dict[str, tuple[tuple[str, int, str, int], ...]] = {
    "Squeeze": _AXES_TO_INPUT_12,
    "Unsqueeze": _AXES_TO_INPUT_12,
    "ReduceSum": _AXES_TO_INPUT_12,
    **dict.fromkeys(("ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
                     "ReduceLogSumExp ReduceSumSquare").split(), (("axes", 1, "int64", 17),)),
    "Split": (("split", 1, "int64", 12),),
    "Slice": (("starts", 1, "int64", 9), ("ends", 2, "int64", 9), ("axes", 3, "int64", 9)),
    "Pad": (("pads", 1, "int64", 10), ("value", 2, "float32", 10)),
    "Clip": (("min", 1, "float32", 10), ("max", 2, "float32", 10)),
    "TopK": (("k", 1, "int64", 9),),
}


def _pattern(name: str, mapping: MappingRule) -> Pattern:
    """TVM's pattern kind, from the other facts of the record. An elementwise op that may
    broadcast is BROADCAST (TVM's kBroadcast), whether or not a given instance does."""
    if name in _OPAQUE:
        return Pattern.OPAQUE
    if name in _COMPUTE_INTENSIVE:
        return Pattern.ANCHOR
    if name in _INJECTIVE:
        return Pattern.INJECTIVE
    if mapping == M2M:
        return Pattern.REDUCE
    return Pattern.ELEMWISE if mapping in (O2O, REO, SHU) else Pattern.BROADCAST


def _record(name: str, mapping: MappingRule, flops: FlopRule) -> OpInfo:
    return OpInfo(
        op_type=name,
        mapping=mapping,
        flops=flops,
        pattern=_pattern(name, mapping),
        compute_intensive=name in _COMPUTE_INTENSIVE,
        row_locality=_ROW_LOCALITY.get(name, RowLocality.NONE),
        recurrent=name in _RECURRENT,
        foldable=name not in _NOT_FOLDABLE,
        static_value=name in _STATIC_VALUE,
        value_flow=_VALUE_FLOW.get(name, ValueFlow.NONE),
        gather_indices=_GATHER_INDICES.get(name),
        symmetric=name in _SYMMETRIC,
        properties=_PROPERTIES.get(name, frozenset()),
        string_attrs=MappingProxyType(_STRING_ATTRS.get(name, {})),
        shape_rule=_SHAPE_RULES.get(name, ShapeRule.ONNX),
        attributes_now_inputs=_ATTRIBUTES_NOW_INPUTS.get(name, ()),
        in_paper=name in _IN_PAPER,
        opaque=name in _OPAQUE,
    )


def _register_all() -> None:
    for names, mapping, flops in _TABLE:
        for name in names.split():
            register(_record(name, mapping, flops))


_register_all()
