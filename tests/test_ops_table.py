"""The operator table (kiln/ops/table.py): coverage of ONNX, DNNFusion's Table 2, the broadcast
rule, FLOP counts against brute-force counts, and the CIL/opaque/property sets."""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnx.defs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ecg import Graph, Op, Tensor
from kiln.mapping import MappingType
from kiln.ops import ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE, annotate, known_ops, op_info

O2O, REO, SHU, O2M, M2M = (
    MappingType.ONE_TO_ONE,
    MappingType.REORGANIZE,
    MappingType.SHUFFLE,
    MappingType.ONE_TO_MANY,
    MappingType.MANY_TO_MANY,
)

ONNX_OPS = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""}

# Table 2 of the paper, transcribed from its text ("Reduce (e.g. ReduceProd, ReduceMean)" means
# every Reduce* op of ONNX).
TABLE2: dict[MappingType, set[str]] = {
    O2O: set("Add Asin BatchNormalization Cast Ceil Clip Concat Cos Erf Exp Greater LeakyRelu Log "
             "Not PRelu Reciprocal Relu Round Sigmoid Sin Slice Split Sqrt Tanh Where".split()),
    O2M: {"Expand", "Gather", "Resize", "Upsample"},
    M2M: set("AveragePool Conv ConvTranspose CumSum Einsum Gemm InstanceNormalization MaxPool "
             "Softmax".split()) | {name for name in ONNX_OPS if name.startswith("Reduce")},
    REO: {"Flatten", "Reshape", "Squeeze", "Unsqueeze"},
    SHU: {"DepthToSpace", "SpaceToDepth", "Transpose"},
}

Spec = tuple[tuple[int, ...], bool]  # (shape, is constant)


def annotated(op_type: str, inputs: list[Spec | None], outputs: list[tuple[int, ...]],
              attrs: dict | None = None) -> Op:
    """Build a one-op graph and annotate its op from the table."""
    tensors: dict[str, Tensor] = {}
    input_ids: list[str | None] = []
    for i, spec in enumerate(inputs):
        if spec is None:
            input_ids.append(None)
            continue
        shape, constant = spec
        data = np.zeros(shape, np.float32) if constant else None
        tensors[f"in{i}"] = Tensor(f"in{i}", tuple(shape), "float32", data=data)
        input_ids.append(f"in{i}")
    output_ids = [f"out{i}" for i in range(len(outputs))]
    for tid, shape in zip(output_ids, outputs):
        tensors[tid] = Tensor(tid, tuple(shape), "float32")
    op = Op("op0", op_type, tuple(input_ids), tuple(output_ids), dict(attrs or {}))
    runtime = [t for t in input_ids if t is not None and not tensors[t].is_constant]
    return annotate(op, Graph(tensors, [op], runtime, output_ids))


def act(*shape: int) -> Spec:
    return tuple(shape), False


def const(*shape: int) -> Spec:
    return tuple(shape), True


def arity(op_type: str) -> int:
    return 3 if op_type == "Where" else 2


# --- (1) coverage ---------------------------------------------------------------------------------
def test_every_default_domain_op_is_registered_and_nothing_else() -> None:
    assert set(known_ops()) == ONNX_OPS
    for name, info in known_ops().items():
        assert info.op_type == name


def test_deprecated_ops_are_registered() -> None:
    deprecated = {s.name for s in onnx.defs.get_all_schemas_with_history()
                  if s.domain == "" and s.deprecated}
    assert deprecated and deprecated <= set(known_ops())


# --- (2) Table 2 ----------------------------------------------------------------------------------
def table2_mapping(op_type: str) -> MappingType:
    """The op's mapping type on an instance whose inputs all have the output's shape."""
    info = op_info(op_type)
    if isinstance(info.mapping, MappingType):
        return info.mapping
    return annotated(op_type, [act(2, 3)] * arity(op_type), [(2, 3)]).mapping


@pytest.mark.parametrize("expected,op_type",
                         [(m, name) for m, names in TABLE2.items() for name in sorted(names)])
def test_table2_mapping_types(expected: MappingType, op_type: str) -> None:
    assert table2_mapping(op_type) == expected
    assert op_info(op_type).in_paper


def test_in_paper_is_exactly_table2() -> None:
    in_paper = {name for name, info in known_ops().items() if info.in_paper}
    assert in_paper == set().union(*TABLE2.values())


@pytest.mark.parametrize("op_type", ["Add", "Greater", "PRelu", "Where"])
def test_table2_elementwise_with_broadcast_is_one_to_many(op_type: str) -> None:
    inputs = [act(2, 3)] * (arity(op_type) - 1) + [act(1, 3)]
    assert annotated(op_type, inputs, [(2, 3)]).mapping == O2M


# --- (3) the elementwise broadcast rule -----------------------------------------------------------
BROADCAST_OPS = sorted(name for name, info in known_ops().items()
                       if not isinstance(info.mapping, MappingType))


def test_one_shared_broadcast_rule() -> None:
    assert len({op_info(name).mapping for name in BROADCAST_OPS}) == 1
    expected = set("Add Sub Mul Div Pow Where Min Max Sum Mean PRelu Equal Greater Less And Or "
                   "Xor".split())
    assert expected <= set(BROADCAST_OPS)


@pytest.mark.parametrize("op_type", BROADCAST_OPS)
def test_equal_shapes_are_one_to_one(op_type: str) -> None:
    assert annotated(op_type, [act(4, 3)] * arity(op_type), [(4, 3)]).mapping == O2O


@pytest.mark.parametrize("op_type", BROADCAST_OPS)
def test_broadcast_activation_is_one_to_many(op_type: str) -> None:
    inputs = [act(4, 3)] * (arity(op_type) - 1) + [act(4, 1)]
    assert annotated(op_type, inputs, [(4, 3)]).mapping == O2M


@pytest.mark.parametrize("op_type", BROADCAST_OPS)
def test_constant_broadcast_bias_stays_one_to_one(op_type: str) -> None:
    inputs = [act(4, 3)] * (arity(op_type) - 1) + [const(3)]
    assert annotated(op_type, inputs, [(4, 3)]).mapping == O2O


def test_broadcast_rule_cases() -> None:
    # A scalar constant (Mul by 0.5) and a per-channel constant bias.
    assert annotated("Mul", [act(1, 8, 4, 4), const()], [(1, 8, 4, 4)]).mapping == O2O
    assert annotated("Add", [act(1, 8, 4, 4), const(8, 1, 1)], [(1, 8, 4, 4)]).mapping == O2O
    # Both activations broadcast against each other: the output is bigger than either.
    assert annotated("Add", [act(4, 1), act(1, 3)], [(4, 3)]).mapping == O2M
    # The broadcast input may come first; a constant condition does not matter for Where.
    assert annotated("Sub", [act(3), act(2, 3)], [(2, 3)]).mapping == O2M
    assert annotated("Where", [const(3), act(2, 3), act(2, 3)], [(2, 3)]).mapping == O2O
    # Variadic ops with one broadcast input among several.
    assert annotated("Sum", [act(2, 3), act(2, 3), act(3)], [(2, 3)]).mapping == O2M
    # Padding a shape with leading 1s keeps the element mapping one-to-one.
    assert annotated("Add", [act(3), act(1, 3)], [(1, 3)]).mapping == O2O


def test_all_constant_inputs_use_the_rule_over_all_inputs() -> None:
    assert annotated("Add", [const(2, 3), const(2, 3)], [(2, 3)]).mapping == O2O
    assert annotated("Add", [const(2, 3), const(3)], [(2, 3)]).mapping == O2M


# --- (4) FLOPs ------------------------------------------------------------------------------------
def brute_matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Every output element of ones @ ones equals its number of multiply-adds."""
    return 2 * int(np.matmul(np.ones(a), np.ones(b)).sum())


@st.composite
def matmul_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m, n, k = (draw(st.integers(1, 4)) for _ in range(3))
    batch = tuple(draw(st.lists(st.integers(2, 3), max_size=3)))

    def operand_batch() -> tuple[int, ...]:
        kept = batch[draw(st.integers(0, len(batch))):]
        return tuple(1 if draw(st.booleans()) else d for d in kept)

    a = (*operand_batch(), m, k) if draw(st.integers(0, 4)) else (k,)
    b = (*operand_batch(), k, n) if draw(st.integers(0, 4)) else (k,)
    return a, b


@given(matmul_shapes())
@settings(max_examples=100, deadline=None)
def test_matmul_flops(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    a, b = shapes
    out = np.matmul(np.ones(a), np.ones(b)).shape
    op = annotated("MatMul", [act(*a), const(*b)], [out])
    assert op.flops == brute_matmul_flops(a, b)


def test_matmul_flops_examples() -> None:
    assert annotated("MatMul", [act(2, 3), act(3, 5)], [(2, 5)]).flops == 2 * 2 * 3 * 5
    assert annotated("MatMul", [act(7, 1, 2, 3), act(4, 3, 5)], [(7, 4, 2, 5)]).flops == \
        2 * 28 * 2 * 3 * 5
    assert annotated("MatMul", [act(3), act(3)], [()]).flops == 6


@given(m=st.integers(1, 5), n=st.integers(1, 5), k=st.integers(1, 5), trans_a=st.booleans(),
       trans_b=st.booleans(), bias=st.sampled_from([None, "scalar", "row", "full"]))
@settings(max_examples=60, deadline=None)
def test_gemm_flops(m: int, n: int, k: int, trans_a: bool, trans_b: bool, bias: str | None) -> None:
    a = (k, m) if trans_a else (m, k)
    b = (n, k) if trans_b else (k, n)
    c = {None: None, "scalar": const(), "row": const(n), "full": const(m, n)}[bias]
    op = annotated("Gemm", [act(*a), const(*b), c], [(m, n)],
                   {"transA": int(trans_a), "transB": int(trans_b)})
    expected = brute_matmul_flops((m, k), (k, n)) + (m * n if bias else 0)
    assert op.flops == expected


def brute_conv(x: tuple[int, ...], cout: int, kernel: tuple[int, ...], group: int,
               strides: tuple[int, ...], dilations: tuple[int, ...],
               pads: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Slide the window over the padded input and count every multiply-add (padding included).

    Returns the output shape and the FLOP count (2 per multiply-add)."""
    n, cin, *spatial = x
    rank = len(spatial)
    positions = []
    for axis in range(rank):
        padded = spatial[axis] + pads[axis] + pads[axis + rank]
        span = dilations[axis] * (kernel[axis] - 1) + 1
        positions.append(list(range(0, padded - span + 1, strides[axis])))
    cin_per_group, cout_per_group = cin // group, cout // group
    macs = 0
    for _batch, co in itertools.product(range(n), range(cout)):
        g = co // cout_per_group
        for _pos in itertools.product(*positions):
            for _ci in range(g * cin_per_group, (g + 1) * cin_per_group):
                for _tap in itertools.product(*(range(kk) for kk in kernel)):
                    macs += 1
    return (n, cout, *(len(p) for p in positions)), 2 * macs


@st.composite
def conv_cases(draw: st.DrawFn) -> dict:
    rank = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    case = {
        "x": (draw(st.integers(1, 2)), group * draw(st.integers(1, 2)),
              *(draw(st.integers(3, 7)) for _ in range(rank))),
        "cout": group * draw(st.integers(1, 2)),
        "kernel": tuple(draw(st.integers(1, 3)) for _ in range(rank)),
        "group": group,
        "strides": tuple(draw(st.integers(1, 3)) for _ in range(rank)),
        "dilations": tuple(draw(st.integers(1, 2)) for _ in range(rank)),
        "pads": tuple(draw(st.integers(0, 2)) for _ in range(2 * rank)),
        "bias": draw(st.booleans()),
    }
    span = [d * (k - 1) + 1 for d, k in zip(case["dilations"], case["kernel"])]
    padded = [s + case["pads"][i] + case["pads"][i + rank] for i, s in enumerate(case["x"][2:])]
    if any(sp > p for sp, p in zip(span, padded)):
        case["pads"] = tuple(p + max(span) for p in case["pads"])
    return case


@given(conv_cases())
@settings(max_examples=60, deadline=None)
def test_conv_flops(case: dict) -> None:
    x, cout, kernel, group = case["x"], case["cout"], case["kernel"], case["group"]
    out, expected = brute_conv(x, cout, kernel, group, case["strides"], case["dilations"],
                               case["pads"])
    weight = (cout, x[1] // group, *kernel)
    attrs = {"group": group, "strides": list(case["strides"]), "kernel_shape": list(kernel),
             "dilations": list(case["dilations"]), "pads": list(case["pads"])}
    bias = const(cout) if case["bias"] else None
    op = annotated("Conv", [act(*x), const(*weight), bias], [out], attrs)
    assert op.flops == expected + (math.prod(out) if case["bias"] else 0)
    assert op.compute_intensive and op.mapping == M2M


def test_conv_flops_example() -> None:
    # 1x4x5x5 input, 6 filters of 2 channels (group 2), 3x3 kernel, stride 2, pad 1 -> 1x6x3x3.
    op = annotated("Conv", [act(1, 4, 5, 5), const(6, 2, 3, 3), const(6)], [(1, 6, 3, 3)],
                   {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert op.flops == 2 * 54 * 2 * 9 + 54


def test_conv_transpose_flops() -> None:
    # Every input element is scattered through Cout/group * prod(kernel) weights.
    op = annotated("ConvTranspose", [act(2, 4, 3, 3), const(4, 3, 2, 2), const(6)],
                   [(2, 6, 6, 6)], {"group": 2, "strides": [2, 2]})
    assert op.flops == 2 * (2 * 4 * 9) * 3 * 4 + 2 * 6 * 36


def test_quantized_and_integer_contractions_count_like_float_ones() -> None:
    scale = const()
    qmm = annotated("QLinearMatMul", [act(2, 3), scale, scale, const(3, 5), scale, scale, scale,
                                      scale], [(2, 5)])
    assert qmm.flops == annotated("MatMulInteger", [act(2, 3), const(3, 5)], [(2, 5)]).flops == 60
    qconv = annotated("QLinearConv", [act(1, 2, 4, 4), scale, scale, const(3, 2, 3, 3), scale,
                                      scale, scale, scale, const(3)], [(1, 3, 2, 2)])
    assert qconv.flops == 2 * 12 * 18 + 12


@pytest.mark.parametrize("equation,shapes,out", [
    ("ij,jk->ik", [(2, 3), (3, 4)], (2, 4)),
    ("bij,bjk->bik", [(5, 2, 3), (5, 3, 4)], (5, 2, 4)),
    ("...ij,...jk->...ik", [(6, 1, 2, 3), (4, 3, 4)], (6, 4, 2, 4)),
    ("bhqd, bhkd -> bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)], (2, 3, 4, 6)),
])
def test_einsum_flops_match_matmul(equation: str, shapes: list[tuple[int, ...]],
                                   out: tuple[int, ...]) -> None:
    op = annotated("Einsum", [act(*s) for s in shapes], [out], {"equation": equation})
    operands = [np.ones(s) for s in shapes]
    assert op.flops == 2 * int(np.einsum(equation.replace(" ", ""), *operands).sum())


def test_lstm_flops_contain_the_gate_matmuls() -> None:
    seq, batch, inp, hidden, dirs = 5, 2, 3, 4, 2
    op = annotated("LSTM", [act(seq, batch, inp), const(dirs, 4 * hidden, inp),
                            const(dirs, 4 * hidden, hidden)],
                   [(seq, dirs, batch, hidden)], {"hidden_size": hidden})
    matmuls = 2 * seq * batch * 4 * hidden * (inp + hidden) * dirs
    assert matmuls < op.flops < matmuls + 100 * seq * batch * hidden * dirs
    assert op.compute_intensive


@pytest.mark.parametrize("op_type,inputs,out", [
    ("Reshape", [act(2, 6), const(2)], (3, 4)),
    ("Transpose", [act(2, 6)], (6, 2)),
    ("Gather", [act(10, 4), const(3)], (3, 4)),
    ("Slice", [act(10, 4), const(1), const(1)], (5, 4)),
    ("Concat", [act(2, 4), act(3, 4)], (5, 4)),
    ("Expand", [act(1, 4), const(2)], (3, 4)),
    ("Cast", [act(2, 4)], (2, 4)),
    ("Identity", [act(2, 4)], (2, 4)),
    ("Pad", [act(2, 4), const(4)], (4, 6)),
    ("Tile", [act(2, 4), const(2)], (4, 8)),
    ("Squeeze", [act(1, 4), const(1)], (4,)),
    ("Unsqueeze", [act(4), const(1)], (1, 4)),
    ("Flatten", [act(2, 3, 4)], (2, 12)),
    ("Shape", [act(2, 3, 4)], (3,)),
    ("DepthToSpace", [act(1, 8, 2, 2)], (1, 2, 4, 4)),
])
def test_data_movement_has_no_flops(op_type: str, inputs: list[Spec], out: tuple[int, ...]) -> None:
    assert annotated(op_type, inputs, [out]).flops == 0


def test_elementwise_reduction_and_normalization_flops() -> None:
    numel = 2 * 3 * 4
    add = annotated("Add", [act(2, 3, 4), act(2, 3, 4)], [(2, 3, 4)]).flops
    relu = annotated("Relu", [act(2, 3, 4)], [(2, 3, 4)]).flops
    exp = annotated("Exp", [act(2, 3, 4)], [(2, 3, 4)]).flops
    assert add == relu == numel
    assert exp > add and exp % numel == 0
    assert annotated("ReduceSum", [act(2, 3, 4), const(1)], [(2, 1, 4)]).flops == numel
    assert annotated("Softmax", [act(2, 3, 4)], [(2, 3, 4)]).flops == 5 * numel
    layer_norm = annotated("LayerNormalization", [act(2, 3, 4), const(4), const(4)], [(2, 3, 4)])
    assert layer_norm.flops > 0 and layer_norm.flops % numel == 0
    assert annotated("Sum", [act(2, 3)] * 3, [(2, 3)]).flops == 2 * 6


def test_pooling_flops() -> None:
    op = annotated("MaxPool", [act(1, 2, 6, 6)], [(1, 2, 3, 3)],
                   {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert op.flops == 18 * 4
    assert annotated("GlobalAveragePool", [act(1, 2, 6, 6)], [(1, 2, 1, 1)]).flops == 72


def test_annotation_fills_bytes() -> None:
    op = annotated("Add", [act(2, 3), const(3)], [(2, 3)])
    assert op.bytes == (6 + 3 + 6) * 4


# --- (5) CIL, opaque and properties ---------------------------------------------------------------
EXPECTED_CIL = set("MatMul Gemm Conv ConvTranspose ConvInteger MatMulInteger QLinearConv "
                   "QLinearMatMul Einsum LSTM GRU RNN DeformConv Attention LinearAttention "
                   "CausalConvWithState".split())

EXPECTED_OPAQUE = set(
    "If Loop Scan SequenceMap NonZero Unique NonMaxSuppression Compress ImageDecoder "
    "RandomNormal RandomUniform RandomNormalLike RandomUniformLike Multinomial Bernoulli "
    "StringNormalizer RegexFullMatch StringSplit StringConcat LSTM GRU RNN LinearAttention "
    "ConcatFromSequence SplitToSequence".split()
) | {name for name in ONNX_OPS if name.startswith(("Sequence", "Optional"))}


def test_compute_intensive_set() -> None:
    assert {name for name, info in known_ops().items() if info.compute_intensive} == EXPECTED_CIL


def test_opaque_set() -> None:
    assert {name for name, info in known_ops().items() if info.opaque} == EXPECTED_OPAQUE
    assert not op_info("TopK").opaque


@pytest.mark.parametrize("op_type,expected", [
    ("Mul", {ASSOCIATIVE, COMMUTATIVE, DISTRIBUTIVE}),
    ("Add", {ASSOCIATIVE, COMMUTATIVE}),
    ("Sum", {ASSOCIATIVE, COMMUTATIVE}),
    ("Max", {ASSOCIATIVE, COMMUTATIVE}),
    ("Min", {ASSOCIATIVE, COMMUTATIVE}),
    ("And", {ASSOCIATIVE, COMMUTATIVE}),
    ("Xor", {ASSOCIATIVE, COMMUTATIVE}),
    ("Sub", {DISTRIBUTIVE}),
    ("Div", {DISTRIBUTIVE}),
    ("Conv", {DISTRIBUTIVE}),
    ("MatMul", {ASSOCIATIVE, DISTRIBUTIVE}),
    ("Gemm", {ASSOCIATIVE, DISTRIBUTIVE}),
    ("ReduceSum", {COMMUTATIVE}),
    ("ReduceProd", {COMMUTATIVE}),
    ("ReduceMean", {COMMUTATIVE}),
    ("BitShift", {COMMUTATIVE}),
    ("Exp", {COMMUTATIVE}),
    ("Reciprocal", {COMMUTATIVE}),
    ("Sqrt", {COMMUTATIVE}),
    ("Abs", {COMMUTATIVE}),
    ("Pow", {COMMUTATIVE}),
    ("Reshape", set()),
    ("Transpose", set()),
    ("Softmax", set()),
    ("Gather", set()),
    ("Concat", set()),
    ("Cast", set()),
    ("Relu", set()),
])
def test_properties(op_type: str, expected: set[str]) -> None:
    assert op_info(op_type).properties == frozenset(expected)


def test_classification_of_ops_outside_table2() -> None:
    expected = {
        M2M: "MatMul LSTM LayerNormalization LogSoftmax ArgMax TopK",
        O2M: "Tile GatherElements GatherND Pad",
        O2O: "Identity Dropout Abs Neg IsNaN Gelu HardSwish Mish",
        SHU: "ReverseSequence",
    }
    for mapping, names in expected.items():
        for name in names.split():
            assert op_info(name).mapping == mapping, name
            assert not op_info(name).in_paper
