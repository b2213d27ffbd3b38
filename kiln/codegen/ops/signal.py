"""Signal-processing generators: the Hann, Hamming and Blackman windows (an element's value is a
formula of its position; with a constant size the frontend usually folds them away)."""
from __future__ import annotations

import math

from kiln.codegen.expr import Expr, binary, call, cast, const
from kiln.codegen.indexing import Index
from kiln.codegen.lower import InlineCtx
from kiln.codegen.ops import inline
from kiln.codegen.ops.movement import needs_const_inputs

# ω_n = Σ_k a_k · cos(2πk·n / N) per window (N = size, or size − 1 when not periodic).
COSINE_TERMS = {"HannWindow": (0.5, -0.5), "HammingWindow": (25 / 46, -21 / 46),
                "BlackmanWindow": (0.42, -0.5, 0.08)}


@inline(*COSINE_TERMS, check=needs_const_inputs(0))
def _window(ctx: InlineCtx, index: Index) -> Expr:
    size = int(ctx.const(0).reshape(-1)[0])
    period = size if ctx.attr("periodic", 1) else size - 1
    n = cast(index.flat, "float64")
    value: Expr = const(0, "float64")
    for k, a in enumerate(COSINE_TERMS[ctx.op.op_type]):
        angle = binary("mul", n, const(2 * math.pi * k / period, "float64")) if period else n
        term = const(a, "float64") if k == 0 else binary("mul", const(a, "float64"),
                                                          call("cos", "float64", angle))
        value = binary("add", value, term)
    return cast(value, ctx.out.dtype)
