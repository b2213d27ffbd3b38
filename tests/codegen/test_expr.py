"""Index-expression simplification: exact on every value of the loop variables, and strong enough
to turn composed Reshape/Transpose maps back into affine offsets."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.codegen.expr import (
    add,
    clamp,
    delinearize,
    evaluate_index,
    floordiv,
    iconst,
    linearize,
    modulo,
    mul,
    substitute,
    var,
    walk,
)

VARS = [var("a", 3), var("b", 4), var("c", 6)]


@st.composite
def index_trees(draw, depth: int = 0):
    """(python evaluator, expression) pairs over three loop variables."""
    choice = draw(st.integers(0, 5 if depth < 3 else 1))
    if choice == 0:
        v = draw(st.sampled_from(VARS))
        return (lambda env, v=v: env[v]), v
    if choice == 1:
        k = draw(st.integers(-7, 12))
        return (lambda env, k=k: k), iconst(k)
    (f, x), (g, y) = draw(index_trees(depth + 1)), draw(index_trees(depth + 1))
    k = draw(st.integers(1, 12))
    if choice == 2:
        return (lambda env: f(env) + g(env)), add(x, y)
    if choice == 3:
        m = draw(st.integers(-3, 5))
        return (lambda env: f(env) * m), mul(x, m)
    if choice == 4:
        return (lambda env: f(env) // k), floordiv(x, k)
    return (lambda env: f(env) % k), modulo(x, k)


@settings(max_examples=300, deadline=None)
@given(index_trees())
def test_simplified_expressions_keep_their_values(tree):
    direct, expr = tree
    grid = np.meshgrid(*(np.arange(v.attr[2] + 1) for v in VARS), indexing="ij")
    env = dict(zip(VARS, grid))
    got = np.broadcast_to(evaluate_index(expr, env), grid[0].shape)
    for point in itertools.product(*(range(v.attr[2] + 1) for v in VARS)):
        want = direct(dict(zip(VARS, point)))
        assert got[point] == want, (expr, point)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_delinearize_then_linearize_is_the_identity(shape):
    v = var("i", int(np.prod(shape)))
    assert linearize(delinearize(v, tuple(shape)), tuple(shape)) is v


def test_reshape_then_transpose_composes_to_an_affine_offset():
    # (B, S, H*D) viewed as (B, S, H, D) and read transposed as (B, H, S, D).
    b, h, s, d = var("b", 2), var("h", 12), var("s", 128), var("d", 64)
    flat = linearize((b, s, h, d), (2, 128, 12, 64))
    source = delinearize(flat, (2, 128, 768))
    offset = linearize(source, (2, 128, 768))
    assert not any(n.op in ("fdiv", "fmod") for n in walk([offset]))
    assert offset is add(mul(b, 128 * 768), mul(s, 768), mul(h, 64), d)


def test_ranges_fold_divisions_and_clamps():
    j = var("j", 64)
    assert floordiv(add(mul(var("h", 12), 64), j), 64) is var("h", 12)
    assert modulo(add(mul(var("h", 12), 64), j), 64) is j
    assert clamp(j, 0, 63) is j


def test_substitution_resimplifies():
    j = var("j", 768)
    hi, lo = var("j1", 12), var("j0", 64)
    split = substitute(add(mul(floordiv(j, 64), 1000), modulo(j, 64)), {j: add(mul(hi, 64), lo)})
    assert split is add(mul(hi, 1000), lo)
