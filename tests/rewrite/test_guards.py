"""Guards refuse the cases where a rewrite would be wrong, and those cases really are wrong.

Each case builds a small graph the rule's pattern matches but its guard (or dtypes, or the
engine's shape check) must refuse. `apply_once(..., force=True)` then applies the replacement
anyway, skipping the guard and dtypes, to show the refusal matters: the forced result has other
values, another shape, or cannot be built at all.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from kiln.rewrite import all_rules, apply_once
from kiln.rewrite.dsl import Node
from tests.rewrite.harness import G, evaluate

RULES = {r.name: r for r in all_rules()}


def _differs(before, after, feeds) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = evaluate(before, feeds)
        try:
            got = evaluate(after, feeds)
        except Exception:
            return True
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return True
        if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-4, atol=1e-5,
                           equal_nan=True):
            return True
    return False


def refused_and_needed(rule, graph, feeds):
    assert apply_once(graph, rule) is None, f"{rule.name} applied where it must not"
    try:
        forced = apply_once(graph, rule, force=True)
    except Exception:
        return  # the replacement cannot even be built for this graph
    assert forced is None or _differs(graph, forced, feeds), \
        f"forcing {rule.name} gave the same values: the case does not show why it is refused"


def feeds_of(graph, *arrays):
    return dict(zip(graph.inputs, arrays))


def test_division_by_an_integer_constant_is_not_a_multiplication():
    g = G()
    x = g.input((4,), "int32")
    graph = g.graph(g.op("Div", x, g.const(2, "int32")))
    refused_and_needed(RULES["div_const_to_mul"], graph,
                       feeds_of(graph, np.array([7, -7, 3, 1], np.int32)))


def test_integer_division_is_not_reassociated():
    g = G()
    x = g.input((4,), "int32")
    graph = g.graph(g.op("Div", g.op("Mul", x, g.const(3, "int32")), g.const(2, "int32")))
    refused_and_needed(RULES["mul_div_const"], graph,
                       feeds_of(graph, np.array([1, 2, 3, 5], np.int32)))


def test_integer_quotients_are_not_factored():
    g = G()
    a, b = g.input((3,), "int32"), g.input((3,), "int32")
    c = g.const(2, "int32")
    graph = g.graph(g.op("Add", g.op("Div", a, c), g.op("Div", b, c)))
    refused_and_needed(RULES["factor_div_add"], graph,
                       feeds_of(graph, np.array([1, 3, 5], np.int32), np.ones(3, np.int32)))


@pytest.mark.parametrize("rule", ["mul_one", "add_zero", "sub_zero", "div_one"])
def test_identity_constant_that_broadcasts_the_operand_is_kept(rule):
    value = 0.0 if rule in ("add_zero", "sub_zero") else 1.0
    op_type = {"mul_one": "Mul", "add_zero": "Add", "sub_zero": "Sub", "div_one": "Div"}[rule]
    g = G()
    x = g.input((3,))
    graph = g.graph(g.op(op_type, x, g.const(np.full((2, 3), value))))
    refused_and_needed(RULES[rule], graph, feeds_of(graph, np.arange(3, dtype=np.float32)))


def test_identity_constants_apply_to_integers_exactly():
    g = G()
    x = g.input((3,), "int64")
    graph = g.graph(g.op("Relu", g.op("Add", x, g.const(0, "int64"))))
    after = apply_once(graph, RULES["add_zero"])
    assert after is not None and [op.op_type for op in after.ops] == ["Relu"]


def test_max_of_scaled_operands_needs_a_positive_scale():
    g = G()
    a, b = g.input((3,)), g.input((3,))
    c = g.const(-1.0)
    graph = g.graph(g.op("Max", g.op("Mul", a, c), g.op("Mul", b, c)))
    refused_and_needed(RULES["max_scale"], graph,
                       feeds_of(graph, np.arange(1, 4, dtype=np.float32),
                                np.arange(3, 0, -1, dtype=np.float32)))


def test_reduce_max_of_a_scale_needs_its_sign():
    g = G()
    x = g.input((2, 3))
    graph = g.graph(g.op("ReduceMax", g.op("Mul", x, g.const(-2.0)), g.const([1], "int64")))
    refused_and_needed(RULES["reducemax_scale_positive"], graph,
                       feeds_of(graph, np.arange(6, dtype=np.float32).reshape(2, 3)))


def test_powers_combine_only_for_integer_exponents():
    g = G()
    x = g.input((3,))
    half = g.const(0.5)
    graph = g.graph(g.op("Mul", g.op("Pow", x, half), g.op("Pow", x, half)))
    refused_and_needed(RULES["pow_product"], graph,
                       feeds_of(graph, np.array([-4.0, 1.0, 4.0], np.float32)))


def test_power_of_a_power_needs_integer_exponents():
    g = G()
    x = g.input((3,))
    graph = g.graph(g.op("Pow", g.op("Pow", x, g.const(2.0)), g.const(0.5)))
    refused_and_needed(RULES["pow_pow"], graph, feeds_of(graph, np.array([-3, 1, 2], np.float32)))


def test_scale_inside_a_reduction_must_be_constant_along_the_reduced_axis():
    g = G()
    x = g.input((2, 3))
    v = g.const(np.array([1.0, 2.0, 3.0]))
    graph = g.graph(g.op("ReduceSum", g.op("Mul", x, v), g.const([1], "int64"), keepdims=1))
    refused_and_needed(RULES["reducesum_scale"], graph,
                       feeds_of(graph, np.ones((2, 3), np.float32)))


def test_softmax_shift_must_be_constant_along_the_softmax_axis():
    g = G()
    x = g.input((2, 3))
    graph = g.graph(g.op("Softmax", g.op("Add", x, g.const([0.0, 1.0, 2.0])), axis=-1))
    refused_and_needed(RULES["softmax_shift"], graph, feeds_of(graph, np.zeros((2, 3), np.float32)))


def test_reducesum_commutes_with_left_shifts_only():
    rule = RULES["reducesum_bitshift"]
    g = G()
    a = g.input((2,), "uint32")
    graph = g.graph(g.op("ReduceSum", g.op("BitShift", a, g.const(1, "uint32"), direction="RIGHT"),
                         g.const([0], "int64"), keepdims=0))
    feeds = feeds_of(graph, np.array([1, 1], np.uint32))
    assert apply_once(graph, rule) is None  # the pattern asks for LEFT
    right = dataclasses.replace(rule, pattern=_with_attr(rule.pattern, "BitShift", "direction",
                                                          "RIGHT"), replacement=_with_attr(
        rule.replacement, "BitShift", "direction", "RIGHT"))
    forced = apply_once(graph, right, force=True)
    assert forced is not None and _differs(graph, forced, feeds)  # Σ(a >> 1) = 0, (Σa) >> 1 = 1


def test_reducesum_bitshift_refuses_signed_integers():
    g = G()
    a = g.input((2,), "int32")
    shifted = g.op("BitShift", a, g.const(1, "int32"), direction="LEFT")
    graph = g.graph(g.op("ReduceSum", shifted, g.const([0], "int64")))
    assert apply_once(graph, RULES["reducesum_bitshift"]) is None


def _with_attr(term, op_type, key, value):
    if isinstance(term, Node):
        args = tuple(_with_attr(a, op_type, key, value) for a in term.args)
        attrs = {**term.attrs, key: value} if op_type in term.ops else term.attrs
        return dataclasses.replace(term, args=args, attrs=attrs)
    return term


def test_column_scale_must_vary_along_the_columns():
    g = G()
    x = g.input((3, 3))
    w = g.const(np.arange(9, dtype=np.float32).reshape(3, 3))
    graph = g.graph(g.op("Mul", g.op("MatMul", x, w), g.const(np.array([[1.0], [2.0], [3.0]]))))
    refused_and_needed(RULES["matmul_scale_columns"], graph,
                       feeds_of(graph, np.eye(3, dtype=np.float32)))


def test_a_lossy_first_cast_is_kept():
    g = G()
    x = g.input((3,))
    graph = g.graph(g.op("Cast", g.op("Cast", x, to=6), to=1))  # float → int32 → float
    refused_and_needed(RULES["cast_cast"], graph,
                       feeds_of(graph, np.array([1.5, -2.5, 3], np.float32)))


def test_a_transpose_that_reorders_elements_is_not_a_reshape():
    g = G()
    x = g.input((2, 3))
    graph = g.graph(g.op("Reshape", g.op("Transpose", x, perm=[1, 0]), g.const([6], "int64")))
    refused_and_needed(RULES["movement_pair_to_reshape"], graph,
                       feeds_of(graph, np.arange(6, dtype=np.float32).reshape(2, 3)))


def test_transposes_with_different_perms_do_not_merge():
    g = G()
    a, b = g.input((2, 2)), g.input((2, 2))
    graph = g.graph(g.op("Add", g.op("Transpose", a, perm=[1, 0]),
                         g.op("Transpose", b, perm=[0, 1])))
    data = np.arange(4, dtype=np.float32).reshape(2, 2)
    refused_and_needed(RULES["transpose_add"], graph, feeds_of(graph, data, data))


def test_layernorm_needs_both_reductions_over_the_same_trailing_axes():
    g = G()
    x = g.input((2, 4))
    mean = g.op("ReduceMean", x, g.const([-1], "int64"))
    d = g.op("Sub", x, mean)
    var = g.op("ReduceMean", g.op("Mul", d, d), g.const([0], "int64"))
    norm = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(1e-5))))
    graph = g.graph(g.op("Add", g.op("Mul", norm, g.const(np.ones(4))), g.const(np.zeros(4))))
    refused_and_needed(RULES["layernorm"], graph,
                       feeds_of(graph, np.arange(8, dtype=np.float32).reshape(2, 4)))


def test_gelu_needs_its_constants():
    g = G()
    x = g.input((4,))
    erf = g.op("Erf", g.op("Div", x, g.const(1.0)))
    graph = g.graph(g.op("Mul", g.op("Mul", x, g.op("Add", erf, g.const(1.0))), g.const(0.5)))
    refused_and_needed(RULES["gelu_erf"], graph,
                       feeds_of(graph, np.linspace(-2, 2, 4, dtype=np.float32)))


def test_an_expand_that_sets_the_output_shape_is_kept():
    g = G()
    x, y = g.input((3,)), g.input((3,))
    expanded = g.op("Expand", x, g.const([2, 3], "int64"))
    graph = g.graph(g.op("Add", expanded, y))
    refused_and_needed(RULES["expand_into_broadcast"], graph,
                       feeds_of(graph, np.ones(3, np.float32), np.ones(3, np.float32)))


def test_conv_scale_must_be_per_channel():
    g = G()
    x = g.input((1, 1, 3, 3))
    conv = g.op("Conv", x, g.const(np.ones((2, 1, 1, 1))))
    graph = g.graph(g.op("Mul", conv, g.const(np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3))))
    refused_and_needed(RULES["conv_scale_fold"], graph,
                       feeds_of(graph, np.ones((1, 1, 3, 3), np.float32)))


def test_argmax_of_a_negation_needs_floats():
    g = G()
    a = g.input((2,), "int32")
    graph = g.graph(g.op("ArgMax", g.op("Neg", a), axis=0, keepdims=0))
    refused_and_needed(RULES["argmax_neg"], graph,
                       feeds_of(graph, np.array([np.iinfo(np.int32).min, 0], np.int32)))


def test_nested_clips_with_disjoint_ranges_are_kept():
    g = G()
    x = g.input((3,))
    inner = g.op("Clip", x, g.const(0.0), g.const(1.0))
    graph = g.graph(g.op("Clip", inner, g.const(2.0), g.const(3.0)))
    refused_and_needed(RULES["clip_clip"], graph,
                       feeds_of(graph, np.array([-1, 0.5, 5], np.float32)))


def test_reduce_max_commutes_with_nondecreasing_leaky_relu_only():
    g = G()
    x = g.input((2,))
    graph = g.graph(g.op("ReduceMax", g.op("LeakyRelu", x, alpha=-0.5), g.const([0], "int64")))
    refused_and_needed(RULES["reducemax_leakyrelu"], graph,
                       feeds_of(graph, np.array([-4, 1], np.float32)))


def test_batchnorm_in_training_mode_is_not_folded():
    g = G()
    x = g.input((1, 2, 2, 2))
    conv = g.op("Conv", x, g.const(np.ones((2, 2, 1, 1))))
    params = [g.const(np.ones(2)) for _ in range(4)]
    graph = g.graph(g.op("BatchNormalization", conv, *params, training_mode=1))
    assert apply_once(graph, RULES["batchnorm_into_conv"]) is None


def test_affine_fold_through_a_reshape_must_keep_the_last_axis():
    g = G()
    x = g.input((1, 2, 4))
    scaled = g.op("Mul", x, g.const(np.arange(4, dtype=np.float32)))
    affine = g.op("Add", scaled, g.const(np.ones(4)))
    flat = g.op("Reshape", affine, g.const([4, 2], "int64"))
    graph = g.graph(g.op("Gemm", flat, g.const(np.ones((2, 3)))))
    refused_and_needed(RULES["affine_into_gemm_through_reshape"], graph,
                       feeds_of(graph, np.ones((1, 2, 4), np.float32)))
