"""Element positions in tensors and the index maps that relate them.

An `Index` names one element of a tensor either by its multi-index or by its row-major offset,
computing the other form only when asked. Ops that keep the element order (Reshape, Flatten,
Squeeze, Unsqueeze, elementwise ops on equal shapes) pass the offset through untouched, so a chain
of them costs no index arithmetic at all; ops that move elements (Transpose, Slice, broadcast, ...)
work on the multi-index, and the simplifier in `kiln.codegen.expr` folds the composition back to
an affine offset wherever it is one.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.codegen.expr import Expr, delinearize, iconst, linearize


class Index:
    __slots__ = ("_dims", "_flat", "shape")

    def __init__(self, shape: Sequence[int], dims: Sequence[Expr] | None = None,
                 flat: Expr | None = None):
        self.shape = tuple(shape)
        assert dims is not None or flat is not None
        self._dims = tuple(dims) if dims is not None else None
        self._flat = flat
        if self._dims is not None:
            assert len(self._dims) == len(self.shape), (self._dims, self.shape)

    @property
    def dims(self) -> tuple[Expr, ...]:
        if self._dims is None:
            self._dims = delinearize(self._flat, self.shape)
        return self._dims

    @property
    def flat(self) -> Expr:
        if self._flat is None:
            self._flat = linearize(self._dims, self.shape)
        return self._flat

    @property
    def key(self) -> tuple:
        return (self.shape, self.flat)

    def reshaped(self, shape: Sequence[int]) -> Index:
        """The same element of the same buffer seen with another shape (Reshape and friends)."""
        shape = tuple(shape)
        if shape == self.shape:
            return self
        assert math.prod(shape) == math.prod(self.shape), (shape, self.shape)
        return Index(shape, flat=self.flat)

    def __repr__(self) -> str:
        return f"Index({self.shape}, {self._dims if self._dims is not None else self._flat})"


def broadcast(index: Index, shape: Sequence[int]) -> Index:
    """The element of an input of `shape` that numpy broadcasting reads for output `index`."""
    shape = tuple(shape)
    if shape == index.shape:
        return index
    if math.prod(shape) == 1:
        return Index(shape, flat=iconst(0))
    out_dims = index.dims
    lead = len(out_dims) - len(shape)
    dims = [iconst(0) if n == 1 else out_dims[lead + i] for i, n in enumerate(shape)]
    return Index(shape, dims=dims)


def permuted(index: Index, perm: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Transpose: output dim i is input dim perm[i]."""
    dims: list[Expr] = [iconst(0)] * len(perm)
    for i, p in enumerate(perm):
        dims[p] = index.dims[i]
    return Index(in_shape, dims=dims)


def with_dims(shape: Sequence[int], dims: Sequence[Expr]) -> Index:
    return Index(shape, dims=list(dims))
