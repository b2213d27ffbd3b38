"""Example families: how to draw a valid (or, in wild mode, an adversarial) instance of a rule.

A rule names its family in `Rule.example["family"]` (default: elementwise). A family returns a
`Plan` (leaf shapes, dtypes, fixed values, attributes, parameters) that the `Builder` follows.
Variable names follow the rule modules' conventions (X/A/B operands, c/v/g/b constants, W
weights, ax/s parameters).
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from kiln.rewrite.dsl import Fill, Node, Rule, Var, variables
from tests.rewrite.harness import (Builder, Instance, Plan, Skip, base_shape, dtype_for,
                                   random_factorization, sub_shape)


def leaves(rule: Rule) -> dict[str, Var]:
    found: dict[str, Var] = {}
    for v in variables(rule.pattern):
        found.setdefault(v.name, v)
    return found


def fills(term, out=None):
    out = [] if out is None else out
    if isinstance(term, Fill):
        out.append(term.value)
    elif isinstance(term, Node):
        for a in term.args:
            fills(a, out)
    return out


def draw_instance(draw, rule: Rule, wild: bool = False) -> Instance:
    family = rule.example.get("family", "elementwise")
    dtype = dtype_for(draw, rule, wild)
    plan = FAMILIES[family](draw, rule, wild)
    if wild:  # constants the guards inspect: any value, zero included
        for name, var in leaves(rule).items():
            if var.kind == "const" and name not in plan.data and draw(st.booleans()):
                plan.domains[name] = "wild"
    return Builder(draw, rule, plan, dtype, wild).instance()


# --- elementwise ------------------------------------------------------------------------------

def elementwise(draw, rule: Rule, wild: bool, min_rank: int = 0) -> Plan:
    base = base_shape(draw, min_rank, 3)
    plan = Plan()
    for name, var in leaves(rule).items():
        if var.kind != "param":
            plan.shapes[name] = sub_shape(draw, base, wild and var.kind == "const")
    if not any(plan.shapes[n] == base for n, v in leaves(rule).items() if v.kind == "any"):
        operands = [n for n, v in leaves(rule).items() if v.kind == "any"]
        if operands:
            plan.shapes[draw(st.sampled_from(operands))] = base
    if wild:
        for value in fills(rule.pattern):
            if draw(st.integers(0, 3)) == 0:
                plan.shapes[f"fill{value:g}"] = sub_shape(draw, base, True)
    return plan


def reduce_broadcast(draw, rule, wild):
    plan = elementwise(draw, rule, wild, min_rank=1)
    plan.shapes["B"] = max(plan.shapes.values(), key=len)
    plan.keepdims = 1
    return plan


def pow_family(draw, rule, wild):
    plan = elementwise(draw, rule, wild)
    plan.domains["X"] = "pos"
    for name in ("c", "c1", "c2"):
        if name in leaves(rule):
            exponent = draw(st.integers(-3, 3)) if not wild or draw(st.booleans()) else \
                draw(st.sampled_from([0.5, -1.5, 2.5]))
            plan.data[name] = np.asarray(exponent, np.float32)
    return plan


# --- reductions ---------------------------------------------------------------------------------

def reduce(draw, rule, wild):
    base = base_shape(draw, 1, 3)
    rank = len(base)
    axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    plan = Plan(reduce_axes=axes, keepdims=draw(st.sampled_from([0, 1])))
    constant_shape = tuple(1 if i in axes else d for i, d in enumerate(base))
    for name, var in leaves(rule).items():
        if var.kind == "param":
            continue
        if var.kind == "const":
            shape = constant_shape if not (wild and draw(st.booleans())) else sub_shape(draw, base)
            while shape and shape[0] == 1 and draw(st.booleans()):
                shape = shape[1:]
            plan.shapes[name] = shape
        else:
            plan.shapes[name] = base
    if rule.name.endswith("_positive"):
        plan.domains["v"] = "pos"
    elif rule.name.endswith("_negative"):
        plan.domains["v"] = "neg"
    if rule.name == "reducesum_bitshift":
        plan.domains["c"] = "shift"
    return plan


def reduce_cast(draw, rule, wild):
    plan = reduce(draw, rule, wild)
    plan.dtypes["A"] = draw(st.sampled_from(["float32", "int32", "int64", "float64"]))
    targets = ["float32", "float64"] + (["int32", "int64"] if wild else [])
    from tests.rewrite.harness import _onnx_type
    plan.attrs["f"] = {"to": _onnx_type(draw(st.sampled_from(targets)))}
    return plan


def argmax(draw, rule, wild):
    plan = Plan(shapes={"A": base_shape(draw, 1, 3)})
    if wild:
        plan.dtypes["A"] = draw(st.sampled_from(["float32", "int32", "int64"]))
    return plan


def softmax(draw, rule, wild):
    base = base_shape(draw, 1, 3)
    rank = len(base)
    axis = draw(st.integers(-rank, rank - 1))
    shape = list(base)
    if not (wild and draw(st.booleans())):
        shape[axis] = 1
    else:
        shape = list(sub_shape(draw, base, True))
    return Plan(shapes={"X": base, "v": tuple(shape)}, attrs={"sm": {"axis": axis}})


def reduce_transpose(draw, rule, wild):
    return Plan(shapes={"A": base_shape(draw, 1, 4)})


# --- data movement --------------------------------------------------------------------------------

def expand(draw, rule, wild):
    base = base_shape(draw, 1, 3)
    plan = Plan(shapes={"X": sub_shape(draw, base), "c": () if not wild else sub_shape(draw, base)},
                params={"expand_to": base, "s": np.asarray(base, np.int64)})
    from tests.rewrite.harness import _onnx_type
    plan.attrs["f"] = {"to": _onnx_type(draw(st.sampled_from(["float64", "int32", "float16"])))}
    return plan


def expand_same(draw, rule, wild):
    base = base_shape(draw, 1, 3)
    target = sub_shape(draw, base, wild)
    return Plan(shapes={"X": base}, params={"s": np.asarray(target, np.int64)})


def expand_broadcast(draw, rule, wild):
    base = base_shape(draw, 1, 3)
    return Plan(shapes={"X": sub_shape(draw, base), "Y": draw(st.sampled_from([base, sub_shape(
        draw, base)]))}, params={"s": np.asarray(base, np.int64)})


def gather(draw, rule, wild):
    rows, width = draw(st.integers(2, 6)), draw(st.integers(1, 4))
    index_shape = base_shape(draw, 1, 2)
    plan = Plan(shapes={"T": (rows, width)}, dtypes={"I": "int64"})
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    plan.data["I"] = rng.integers(0, rows, size=index_shape).astype(np.int64)
    out = (*index_shape, width)
    plan.shapes["c"] = draw(st.sampled_from([(), (width,), (1,) * len(index_shape) + (width,)]))
    if wild and draw(st.booleans()):
        plan.shapes["c"] = sub_shape(draw, out)
    return plan


def transpose_pair(draw, rule, wild):
    base = base_shape(draw, 1, 4)
    perm = list(draw(st.permutations(list(range(len(base))))))
    other = list(draw(st.permutations(list(range(len(base)))))) if wild else perm
    return Plan(shapes={"A": base, "B": base}, attrs={"t1": {"perm": perm}, "t2": {"perm": other}})


def move_scale(draw, rule, wild):
    base = base_shape(draw, 1, 4)
    return Plan(shapes={"X": base, "c": () if not wild else sub_shape(draw, base, True)})


def transpose_chain(draw, rule, wild):
    base = base_shape(draw, 1, 4)
    plan = Plan(shapes={"X": base})
    if rule.name == "transpose_identity" and not (wild and draw(st.booleans())):
        plan.attrs["t"] = {"perm": list(range(len(base)))}
    return plan


def _order_keeping_perm(draw, shape):
    """A perm that moves only size-1 axes (so the element order stays), or any perm."""
    rank = len(shape)
    if draw(st.integers(0, 4)) == 0:
        return list(draw(st.permutations(list(range(rank)))))
    big = [i for i, d in enumerate(shape) if d != 1]
    ones = [i for i, d in enumerate(shape) if d == 1]
    slots = sorted(draw(st.permutations(list(range(rank))))[:len(big)])
    perm = [None] * rank
    for slot, axis in zip(slots, big):
        perm[slot] = axis
    rest = iter(draw(st.permutations(ones)))
    return [p if p is not None else next(rest) for p in perm]


def movement(draw, rule, wild):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from([1, 1, 2, 3])) for _ in range(rank))
    return Plan(shapes={"X": shape}, perm=_order_keeping_perm)


def reorganize(draw, rule, wild):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(rank))
    plan = Plan(shapes={"X": shape})
    if rule.name == "reshape_identity" and not wild:
        plan.picks["root"] = "Reshape"
        plan.params["s"] = np.asarray(shape, np.int64)
    return plan


def cast(draw, rule, wild):
    from tests.rewrite.harness import _onnx_type
    types = ["float32", "float64", "int32", "int64", "float16", "bool"]
    plan = Plan(shapes={"X": base_shape(draw, 0, 3)})
    plan.dtypes["X"] = draw(st.sampled_from(["float32", "int32", "float16", "bool"]))
    if rule.name == "cast_identity":
        plan.attrs["k"] = {"to": _onnx_type(plan.dtypes["X"] if not wild or draw(st.booleans())
                                             else draw(st.sampled_from(types)))}
    else:
        plan.attrs["k1"] = {"to": _onnx_type(draw(st.sampled_from(types)))}
        plan.attrs["k2"] = {"to": _onnx_type(draw(st.sampled_from(types)))}
    plan.domains["X"] = "any"
    return plan


def where(draw, rule, wild):
    base = base_shape(draw, 0, 3)
    return Plan(shapes={"cond": sub_shape(draw, base, wild), "X": base}, dtypes={"cond": "bool"})


def clip(draw, rule, wild):
    base = base_shape(draw, 0, 3)
    plan = Plan(shapes={"X": base})
    for lo, hi in (("lo", "hi"), ("lo2", "hi2")):
        a, b = sorted(draw(st.lists(st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]),
                                    min_size=2, max_size=2)))
        if wild and draw(st.booleans()):
            a, b = b, a
        plan.data[lo], plan.data[hi] = np.float32(a), np.float32(b)
    plan.domains["X"] = "any"
    return plan


# --- contractions ---------------------------------------------------------------------------------

def _random_vector(length: int):
    """A parameter input: `length` values in [-1, 1) of the instance's dtype."""
    return lambda builder, shape: builder.rng.uniform(-1, 1, length).astype(builder.dtype)


def _batch(draw) -> tuple[int, ...]:
    return draw(st.sampled_from([(), (2,), (1, 2)]))


def matmul_chain(draw, rule, wild):
    m, k, n1, n2 = (draw(st.integers(1, 4)) for _ in range(4))
    return Plan(shapes={"X": (*_batch(draw), m, k), "W1": (k, n1), "W2": (n1, n2)})


def matmul_scale(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = _batch(draw)
    width = n if rule.name == "matmul_scale_columns" else k
    choices = [(), (width,), (1, width)]
    if wild:
        choices += [(m, 1), (m, width), (2, 1, 1)]
    return Plan(shapes={"X": (*batch, m, k), "W": (k, n), "c": draw(st.sampled_from(choices))})


def matmul_pair(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = _batch(draw)
    return Plan(shapes={"A": (*batch, m, k), "B": (*batch, k, n),
                        "c": () if not wild else draw(st.sampled_from([(), (n,), (m, 1)]))})


def matmul_factor(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = _batch(draw)
    if "right" in rule.name:
        shapes = {"B": (*batch, m, k), "C": (*batch, m, k), "A": (k, n)}
        if wild and draw(st.booleans()):
            shapes["C"] = (m, k)
    else:
        shapes = {"A": (*batch, m, k), "B": (k, n), "C": (k, n)}
        if wild and draw(st.booleans()):
            shapes["C"] = (*batch, k, n) if batch else (2, k, n)
    return Plan(shapes=shapes)


def matmul_bias(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = () if rule.name == "matmul_bias_to_gemm" and not wild else _batch(draw)
    plan = Plan(shapes={"X": (*batch, m, k), "W": (k, n), "W1": (k, n)})
    plan.shapes["b"] = draw(st.sampled_from([(n,), (m, n), ()]))
    plan.shapes["c"] = draw(st.sampled_from([(n,), ()] + ([(m, 1), (m, n)] if wild else [])))
    if rule.name == "matmul_bias_to_gemm":
        plan.shapes["c"] = draw(st.sampled_from([(n,), (m, n), (1, n)] +
                                                ([(2, m, n)] if wild else [])))
    return plan


def gemm(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    trans_a, trans_b = draw(st.booleans()), draw(st.booleans())
    plan = Plan(shapes={"A": (k, m) if trans_a else (m, k), "B": (n, k) if trans_b else (k, n),
                        "W": (n, k) if trans_b else (k, n)})
    plan.shapes["C"] = draw(st.sampled_from([(n,), (m, n), (1, n)]))
    plan.attrs["g"] = {"transA": int(trans_a), "transB": int(trans_b),
                       "alpha": draw(st.sampled_from([1.0, 0.5, 2.0])),
                       "beta": draw(st.sampled_from([1.0, 0.5]))}
    if rule.name == "gemm_scale_in_alpha":
        plan.attrs["g"]["transA"] = 0
        plan.shapes["A"] = (m, k)
        plan.shapes["c"] = () if not wild else draw(st.sampled_from([(), (k,), (m, 1)]))
    elif rule.name in ("gemm_scale_fold", "gemm_add_bias"):
        extra = [(m, 1), (m, n)] if wild or rule.name == "gemm_add_bias" else []
        plan.shapes["c"] = draw(st.sampled_from([(), (n,), (1, n)] + extra))
    else:
        plan.shapes["c"] = () if not wild else draw(st.sampled_from([(), (n,), (m, n)]))
    if draw(st.booleans()):
        plan.const.add("C")
    return plan


def _conv_common(draw, wild):
    n_in, n_out = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    side, kernel = draw(st.integers(3, 5)), draw(st.integers(1, 3))
    attrs = {"pads": [draw(st.integers(0, 1))] * 4, "strides": [draw(st.integers(1, 2))] * 2}
    return n_in, n_out, side, kernel, attrs


def conv(draw, rule, wild):
    n_in, n_out, side, kernel, attrs = _conv_common(draw, wild)
    plan = Plan(shapes={"X": (1, n_in, side, side), "W": (n_out, n_in, kernel, kernel)},
                attrs={"Conv": attrs})
    has_bias = draw(st.booleans())
    plan.params["b"] = _random_vector(n_out) if has_bias else None
    channel = [(), (n_out, 1, 1), (1, n_out, 1, 1)]
    if wild:
        channel += [(1, 1, side), (n_out, side, side)]
    plan.shapes["c"] = draw(st.sampled_from(channel))
    if rule.name == "conv_scale_input":
        plan.shapes["c"] = () if not wild else draw(st.sampled_from([(), (n_in, 1, 1)]))
    return plan


def conv_pair(draw, rule, wild):
    n_in, n_out, side, kernel, attrs = _conv_common(draw, wild)
    shapes = {"X": (1, n_in, side, side), "X1": (1, n_in, side, side),
              "X2": (1, n_in, side, side), "W1": (n_out, n_in, kernel, kernel),
              "W2": (n_out, n_in, kernel, kernel), "b1": (n_out,), "b2": (n_out,)}
    plan = Plan(shapes=shapes, attrs={"Conv": attrs})
    plan.const |= {"W1", "W2"}
    if wild and draw(st.booleans()):
        plan.attrs["k2"] = {"pads": [1 - attrs["pads"][0]] * 4}
    return plan


def pad_conv(draw, rule, wild):
    """A zero Pad of the spatial axes; in wild mode perhaps with one flaw: a non-zero value, a
    padded batch axis, a negative (cropping) pad, or a reflecting mode."""
    plan = conv(draw, rule, wild)
    if draw(st.booleans()):  # EfficientNet's export: Pad, then Conv(auto_pad=VALID)
        plan.attrs["Conv"] = {"auto_pad": "VALID", "strides": plan.attrs["Conv"]["strides"]}
    begin = [0, 0] + [draw(st.integers(0, 2)) for _ in range(2)]
    end = [0, 0] + [draw(st.integers(0, 2)) for _ in range(2)]
    value = draw(st.sampled_from([None, np.zeros((), np.float32)]))
    flaw = draw(st.sampled_from([None, "value", "axis", "negative", "mode"])) if wild else None
    if flaw == "value":
        value = np.full((), 0.5, np.float32)
    elif flaw == "axis":
        begin[0] = 1
    elif flaw == "negative":
        end[draw(st.integers(2, 3))] = -1
    elif flaw == "mode":
        plan.attrs["pad"] = {"mode": draw(st.sampled_from(["reflect", "edge"]))}
        begin[2] = end[2] = 1
    plan.params["p"] = np.asarray(begin + end, np.int64)
    plan.params["v"] = value
    plan.params["pax"] = None
    return plan


def _bn_params(plan: Plan, draw, channels: int):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    plan.data["bs"] = rng.uniform(0.5, 2, channels).astype(np.float32)
    plan.data["bb"] = rng.uniform(-1, 1, channels).astype(np.float32)
    plan.data["bm"] = rng.uniform(-1, 1, channels).astype(np.float32)
    plan.data["bv"] = rng.uniform(0.5, 2, channels).astype(np.float32)
    plan.attrs["bn"] = {"epsilon": 1e-5}


def batchnorm_conv(draw, rule, wild):
    plan = conv(draw, rule, wild)
    _bn_params(plan, draw, plan.shapes["W"][0])
    return plan


def batchnorm_gemm(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    trans_b = draw(st.booleans())
    plan = Plan(shapes={"A": (m, k), "W": (n, k) if trans_b else (k, n)})
    plan.attrs["g"] = {"transB": int(trans_b), "alpha": draw(st.sampled_from([1.0, 0.5])),
                       "beta": draw(st.sampled_from([1.0, 2.0]))}
    plan.params["C"] = _random_vector(n) if draw(st.booleans()) else None
    _bn_params(plan, draw, n)
    return plan


def batchnorm(draw, rule, wild):
    channels = draw(st.integers(1, 4))
    shape = (draw(st.integers(1, 2)), channels, *base_shape(draw, 0, 2))
    plan = Plan(shapes={"Y": shape})
    _bn_params(plan, draw, channels)
    return plan


def affine_gemm(draw, rule, wild, reshape: bool = False):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    vector = [(k,), (), (1, k)] + ([(m, k), (m, 1)] if wild else [])
    plan = Plan(shapes={"X": (m, k), "W": (k, n), "g": draw(st.sampled_from(vector)),
                        "b": draw(st.sampled_from(vector))})
    plan.params["C"] = _random_vector(n) if draw(st.booleans()) else None
    if reshape:
        batch = draw(st.integers(1, 3))
        plan.shapes["X"] = (batch, m, k)
        plan.params["s"] = np.asarray([-1, k] if not (wild and draw(st.booleans())) else [-1, 1],
                                      np.int64)
        if plan.shapes["g"] == (m, k):
            plan.shapes["g"] = (batch, m, k)
    return plan


def affine_gemm_reshape(draw, rule, wild):
    return affine_gemm(draw, rule, wild, reshape=True)


def matmul_transposes(draw, rule, wild):
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = _batch(draw)
    rank = len(batch) + 2
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    plan = Plan(shapes={"A": (*batch, k, m), "B": (*batch, n, k)},
                attrs={"t1": {"perm": swap}, "t2": {"perm": swap}})
    if wild and batch == (1, 2) and draw(st.booleans()):
        plan.shapes["A"] = (2, 1, k, m)
        plan.attrs["t1"] = {"perm": [1, 0, 3, 2]}
    return plan


# --- decomposed ops -------------------------------------------------------------------------------

def layernorm(draw, rule, wild):
    shape = base_shape(draw, 1, 3, 5)
    rank = len(shape)
    first = draw(st.integers(0, rank - 1))
    axes = np.asarray(list(range(first, rank)), np.int64)
    if draw(st.booleans()):
        axes = axes - rank
    second = axes
    if wild and draw(st.booleans()):
        second = np.asarray([draw(st.integers(0, rank - 1))], np.int64)
    plan = Plan(shapes={"X": shape}, params={"ax1": axes, "ax2": second}, keepdims=1)
    normalized = shape[first:]
    plan.shapes["g"] = draw(st.sampled_from([normalized, normalized[-1:], ()]))
    plan.shapes["b"] = draw(st.sampled_from([normalized, normalized[-1:], ()]))
    plan.data["e"] = np.float32(draw(st.sampled_from([1e-5, 1e-12, 1e-3])))
    plan.alt = draw(st.integers(0, 1))
    return plan


def gelu(draw, rule, wild):
    plan = Plan(shapes={"X": base_shape(draw, 0, 3)}, alt=draw(st.integers(0, 1)))
    value = math.sqrt(2) if plan.alt == 0 else 1 / math.sqrt(2)
    if wild and draw(st.booleans()):
        value = 1.0
    plan.data["k"] = np.float32(value)
    return plan


def gelu_tanh(draw, rule, wild):
    plan = Plan(shapes={"X": base_shape(draw, 0, 3)}, alt=draw(st.integers(0, 1)))
    plan.data["k1"] = np.float32(0.044715 if not (wild and draw(st.booleans())) else 0.05)
    plan.data["k2"] = np.float32(math.sqrt(2 / math.pi))
    return plan


FAMILIES = {
    "elementwise": elementwise, "reduce_broadcast": reduce_broadcast, "pow": pow_family,
    "reduce": reduce, "reduce_cast": reduce_cast, "argmax": argmax, "softmax": softmax,
    "reduce_transpose": reduce_transpose, "expand": expand, "expand_same": expand_same,
    "expand_broadcast": expand_broadcast, "gather": gather, "transpose_pair": transpose_pair,
    "transpose_chain": transpose_chain, "move_scale": move_scale, "movement": movement,
    "reorganize": reorganize,
    "cast": cast, "where": where, "clip": clip, "matmul_chain": matmul_chain,
    "matmul_scale": matmul_scale, "matmul_pair": matmul_pair, "matmul_factor": matmul_factor,
    "matmul_bias": matmul_bias, "gemm": gemm, "conv": conv, "conv_pair": conv_pair,
    "batchnorm_conv": batchnorm_conv, "batchnorm_gemm": batchnorm_gemm, "batchnorm": batchnorm,
    "pad_conv": pad_conv,
    "affine_gemm": affine_gemm, "affine_gemm_reshape": affine_gemm_reshape,
    "matmul_transposes": matmul_transposes, "layernorm": layernorm, "gelu": gelu,
    "gelu_tanh": gelu_tanh,
}

__all__ = ["FAMILIES", "Skip", "draw_instance", "random_factorization"]
