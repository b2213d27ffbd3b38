"""RotaryEmbedding: each element of the rotated part of a head reads itself and its partner
(interleaved pairs or the two halves) and the cos/sin cache at its position — an inline formula."""
from __future__ import annotations

from kiln.codegen.expr import (
    FLOAT_TYPES,
    Expr,
    add,
    as_index,
    binary,
    clamp,
    floordiv,
    index_compare,
    modulo,
    mul,
    select,
    sub,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import InlineCtx
from kiln.codegen.ops.registry import inline
from kiln.ecg import Graph, Op


def _float_data(op: Op, graph: Graph) -> str | None:
    dtypes = {graph.tensors[t].dtype for t in op.inputs[:3]}
    return None if dtypes <= FLOAT_TYPES else "floating-point data only"


@inline("RotaryEmbedding", check=_float_data)
def _rotary(ctx: InlineCtx, index: Index) -> Expr:
    shape = ctx.shape(0)
    if len(shape) == 4:
        b, h, s, d = index.dims
        head_size = shape[3]

        def element(dd: Expr) -> Index:
            return Index(shape, dims=[b, h, s, dd])
    else:
        heads = ctx.attr("num_heads")
        head_size = shape[2] // heads
        b, s, j = index.dims
        h, d = floordiv(j, head_size), modulo(j, head_size)

        def element(dd: Expr) -> Index:
            return Index(shape, dims=[b, s, add(mul(h, head_size), dd)])
    rotated = ctx.attr("rotary_embedding_dim", 0) or head_size
    half = rotated // 2
    inside = clamp(d, 0, rotated - 1)
    if ctx.attr("interleaved", 0):
        pair, imaginary = floordiv(inside, 2), index_compare("eq", modulo(inside, 2), 1)
        first, second = mul(pair, 2), add(mul(pair, 2), 1)
    else:
        imaginary = index_compare("ge", inside, half)
        pair = select(imaginary, sub(inside, half), inside)
        first, second = pair, add(pair, half)
    position = s if not ctx.has(3) else as_index(ctx.input(3, Index(ctx.shape(3), dims=[b, s])))
    cache = ctx.shape(1)
    if len(cache) == 3:
        at = Index(cache, dims=[b, s, pair])
    else:
        at = Index(cache, dims=[clamp(position, 0, cache[0] - 1), pair])
    cos, sin = ctx.input(1, at), ctx.input(2, at)
    x1, x2 = ctx.input(0, element(first)), ctx.input(0, element(second))
    real = binary("sub", binary("mul", cos, x1), binary("mul", sin, x2))
    imag = binary("add", binary("mul", sin, x1), binary("mul", cos, x2))
    value = select(imaginary, imag, real)
    return select(index_compare("lt", d, rotated), value, ctx.input(0, index))
