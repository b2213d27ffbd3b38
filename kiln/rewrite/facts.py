"""Guards and computed constants shared by the rule modules.

Guards are functions of a `Match` returning bool; the builders below make the common ones and
`all_of` combines them. Constant helpers (`reduced`, `column`, ...) reshape a bound constant for
the place the replacement puts it.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from kiln.rewrite.dsl import Match

Guard = Callable[[Match], bool]


def all_of(*guards: Guard) -> Guard:
    return lambda m: all(g(m) for g in guards)


def scalar(*names: str) -> Guard:
    """Each named constant has exactly one element."""
    return lambda m: all(m.scalar(n) is not None for n in names)


def finite_nonzero(*names: str) -> Guard:
    def check(m: Match) -> bool:
        for n in names:
            data = m.value(n)
            if data is None or data.size == 0 or not np.all(np.isfinite(data)) or np.any(data == 0):
                return False
        return True
    return check


def positive(*names: str) -> Guard:
    return lambda m: all(_all(m, n, lambda d: np.all(d > 0) and np.all(np.isfinite(d)))
                         for n in names)


def negative(*names: str) -> Guard:
    return lambda m: all(_all(m, n, lambda d: np.all(d < 0) and np.all(np.isfinite(d)))
                         for n in names)


def finite(*names: str) -> Guard:
    return lambda m: all(_all(m, n, lambda d: np.all(np.isfinite(d))) for n in names)


def integer_scalar(*names: str) -> Guard:
    """Each named constant is one finite integer value (of any dtype), |v| <= 64."""
    def check(m: Match) -> bool:
        for n in names:
            value = m.scalar(n)
            if value is None or not math.isfinite(value) or value != round(value) \
                    or abs(value) > 64:
                return False
        return True
    return check


def same_shape(*names: str) -> Guard:
    return lambda m: len({m.shape(n) for n in names}) == 1


def same_attrs(*node_names: str) -> Guard:
    def check(m: Match) -> bool:
        first = m.op(node_names[0]).attrs
        return all(_attrs_equal(first, m.op(n).attrs) for n in node_names[1:])
    return check


def _attrs_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _all(m: Match, name: str, test) -> bool:
    data = m.value(name)
    return data is not None and data.size > 0 and bool(test(data))


# --- constants along axes ----------------------------------------------------------------------

def constant_on(name: str, axes_of: Callable[[Match], tuple[int, ...] | None],
                rank_of: str) -> Guard:
    """`name` has extent 1 on the given axes of `rank_of`'s rank (it is constant along them) and
    no more dims than `rank_of`."""
    def check(m: Match) -> bool:
        rank = m.rank(rank_of)
        axes = axes_of(m)
        if axes is None or m.rank(name) > rank:
            return False
        shape = m.aligned(name, rank)
        return all(shape[a] == 1 for a in axes)
    return check


def reduced_axes(node: str) -> Callable[[Match], tuple[int, ...] | None]:
    return lambda m: m.axes(node)


def along_last(name: str, of: str) -> Guard:
    """`name` varies only along the last axis of `of` (a scalar, or (..., 1, N) with N = that
    axis's extent)."""
    def check(m: Match) -> bool:
        rank = m.rank(of)
        if rank == 0 or m.rank(name) > rank:
            return False
        shape = m.aligned(name, rank)
        return all(d == 1 for d in shape[:-1]) and shape[-1] in (1, m.shape(of)[-1])
    return check


def reduced(name: str, node: str, rank_of: str) -> Callable[[Match], np.ndarray]:
    """The constant `name` (constant along `node`'s reduced axes) as it broadcasts against
    `node`'s output: aligned to `rank_of`'s rank, its reduced axes dropped unless keepdims."""
    def make(m: Match) -> np.ndarray:
        rank = m.rank(rank_of)
        data = np.asarray(m.value(name)).reshape(m.aligned(name, rank))
        axes = m.axes(node) or ()
        if not m.attr(node, "keepdims"):
            data = data.reshape([d for i, d in enumerate(data.shape) if i not in axes])
        return data
    return make


def reduced_count(node: str) -> Callable[[Match], int]:
    """Elements per output element of a matched reduction."""
    def count(m: Match) -> int:
        shape = m.work.tensors[m.op(node).inputs[0]].shape
        return math.prod(shape[a] for a in (m.axes(node) or ()))
    return count


def last_vector(name: str) -> Callable[[Match], np.ndarray]:
    """A constant varying only along its last axis, as a vector (or a scalar)."""
    def make(m: Match) -> np.ndarray:
        data = np.asarray(m.value(name))
        return data.reshape(-1) if data.size > 1 else data.reshape(())
    return make


def column(name: str) -> Callable[[Match], np.ndarray]:
    """A constant varying only along its last axis, as a column (K, 1) to scale a weight's rows."""
    def make(m: Match) -> np.ndarray:
        data = np.asarray(m.value(name))
        return data.reshape(-1, 1) if data.size > 1 else data.reshape(())
    return make


def channel(name: str, rank: int) -> Callable[[Match], np.ndarray]:
    """A per-channel constant (shape (C, 1, ..., 1) against NCHW) as (C, 1, ..., 1) of `rank`
    dims, to scale a Conv weight's output channels (or a scalar)."""
    def make(m: Match) -> np.ndarray:
        data = np.asarray(m.value(name))
        return data.reshape((-1,) + (1,) * (rank - 1)) if data.size > 1 else data.reshape(())
    return make


def per_channel(name: str, out: str) -> Guard:
    """`name` varies at most along axis 1 of `out` (a Conv's output channels)."""
    def check(m: Match) -> bool:
        rank = m.rank(out)
        if rank < 2 or m.rank(name) > rank:
            return False
        shape = m.aligned(name, rank)
        channels = m.shape(out)[1]
        return all(d == 1 for i, d in enumerate(shape) if i != 1) and shape[1] in (1, channels)
    return check
