"""Signal processing: the Hann, Hamming and Blackman windows (an element's value is a formula of
its position; with a constant size the frontend usually folds them away), and DFT/STFT as direct
transforms — per output bin a vectorised sum over samples with compile-time twiddle tables,
including inverse, one-sided and inverse one-sided (Hermitian) transforms."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    FLOAT_TYPES,
    Expr,
    acc,
    add,
    binary,
    call,
    cast,
    clamp,
    const,
    iconst,
    imul,
    index_compare,
    load,
    logical_or,
    modulo,
    mul,
    select,
    sub,
    unary,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import InlineCtx, StageCtx
from kiln.codegen.ops.registry import inline, stage
from kiln.codegen.ops.common import needs_const_inputs
from kiln.ecg import Graph, Op

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


# --- DFT and STFT ---------------------------------------------------------------------------------
Sample = Callable[[list[Expr], Expr], tuple[Expr, Expr]]  # (output position, t) -> (re, im)


def _const_int(ctx: StageCtx, i: int, default: int | None) -> int | None:
    data = ctx.const(i) if ctx.has(i) else None
    return default if data is None else int(data.reshape(-1)[0])


def _dft_check(op: Op, graph: Graph) -> str | None:
    for i in (1, 2):
        if i < len(op.inputs) and op.inputs[i] is not None and not graph.is_constant(op.inputs[i]):
            return f"input {i} must be a constant"
    return None if graph.tensors[op.inputs[0]].dtype in FLOAT_TYPES else "floating-point input only"


def _twiddles(ctx: StageCtx, length: int, dtype: str) -> tuple[str, str]:
    angles = 2 * np.pi * np.arange(length) / length
    return ctx.derived(np.cos(angles).astype(dtype)), ctx.derived(np.sin(angles).astype(dtype))


def _transform(ctx: StageCtx, length: int, terms: int, sample: Sample, inverse: bool,
               scale: float, real_output: bool) -> None:
    """out[..., k, ..., (re, im)] = scale · Σ_{t < terms} sample(t) · e^{∓2πi·k·t/length}."""
    out = ctx.out()
    if out.numel == 0:
        return
    dtype = out.dtype
    cos_table, sin_table = _twiddles(ctx, length, dtype)
    positions = out.numel // out.shape[-1]
    p = var(ctx.name("p"), positions)
    where = list(Index(out.shape[:-1], flat=p).dims)
    k = where[_AXIS_SLOT[0]]
    t = var(ctx.name("t"), max(terms, 1))
    angle = modulo(imul(k, t), length)
    c, s = load(cos_table, dtype, angle), load(sin_table, dtype, angle)
    re, im = sample(where, t)
    sign = -1.0 if inverse else 1.0
    s = binary("mul", const(sign, dtype), s)
    acc_re, acc_im = acc(ctx.name("re"), dtype), acc(ctx.name("im"), dtype)
    updates = [ir.Assign(acc_re, binary("add", acc_re, binary("add", binary("mul", re, c),
                                                                binary("mul", im, s)))),
               ir.Assign(acc_im, binary("add", acc_im, binary("sub", binary("mul", im, c),
                                                                binary("mul", re, s))))]
    factor = const(scale, dtype)
    values = {0: binary("mul", acc_re, factor)}
    if not real_output:
        values[1] = binary("mul", acc_im, factor)
    stmts: list[ir.Stmt] = [ir.DeclAcc(acc_re, const(0, dtype)), ir.DeclAcc(acc_im, const(0, dtype)),
                            ir.Loop(t, iconst(0), iconst(terms), updates, simd=True,
                                    reductions=(("+", acc_re), ("+", acc_im)))]
    for part, value in values.items():
        stmts += ctx.results({0: (Index(out.shape, dims=[*where, iconst(part)]), value)})
    ctx.stage(f"{ctx.op.op_type} ({ctx.op.id})", [ir.Loop(p, iconst(0), iconst(positions), stmts,
                                                          parallel=1)], positions * terms)


_AXIS_SLOT = [0]  # the output dim that indexes frequencies, set per op before `_transform`


@stage("DFT", check=_dft_check)
def _dft(ctx: StageCtx) -> None:
    shape = ctx.shape(0)
    rank = len(shape)
    opset = ctx.graph.opset or 20
    axis_value = _const_int(ctx, 2, -2) if opset >= 20 else ctx.attr("axis", 1)
    axis = axis_value % rank
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    bins = shape[axis]
    length = _const_int(ctx, 1, None) or (2 * (bins - 1) if inverse and onesided else bins)
    is_complex = shape[-1] == 2
    dtype = ctx.tensor(0).dtype
    zero = const(0, dtype)

    def read(where: list[Expr], position: Expr, part: int) -> Expr:
        dims = list(where)
        dims[axis] = position
        return ctx.operand(0, Index(shape, dims=[*dims, iconst(part)]))

    def forward(where: list[Expr], t: Expr) -> tuple[Expr, Expr]:
        return read(where, t, 0), read(where, t, 1) if is_complex else zero

    def hermitian(where: list[Expr], t: Expr) -> tuple[Expr, Expr]:
        """Bin t of the full spectrum rebuilt from the one-sided one (imaginary parts of the
        zero and Nyquist bins ignored, as a real inverse transform does)."""
        mirrored = index_compare("gt", t, length // 2)
        source = clamp(select(mirrored, sub(iconst(length), t), t), 0, bins - 1)
        present = index_compare("lt", select(mirrored, sub(iconst(length), t), t), bins)
        re = select(present, read(where, source, 0), zero)
        im = select(present, read(where, source, 1), zero) if is_complex else zero
        edge = index_compare("eq", t, 0)
        if length % 2 == 0:
            edge = logical_or(edge, index_compare("eq", t, length // 2))
        im = select(edge, zero, select(mirrored, unary("neg", im), im))
        return re, im

    _AXIS_SLOT[0] = axis
    if inverse and onesided:
        _transform(ctx, length, length, hermitian, True, 1 / length, True)
    else:
        terms = min(length, bins)
        _transform(ctx, length, terms, forward, inverse, 1 / length if inverse else 1.0, False)


def _stft_check(op: Op, graph: Graph) -> str | None:
    reason = _dft_check(op, graph)
    if reason or len(op.inputs) < 4 and (len(op.inputs) < 3 or op.inputs[2] is None):
        return reason or "needs a window or a frame length"
    window = graph.tensors[op.inputs[2]].shape[0] if len(op.inputs) > 2 and op.inputs[2] else None
    frame = op.inputs[3] if len(op.inputs) > 3 else None
    length = int(graph.tensors[frame].data.reshape(-1)[0]) if frame else window
    bins = length // 2 + 1 if op.attrs.get("onesided", 1) else length
    if graph.tensors[op.outputs[0]].shape[2] != bins:
        return "output shape disagrees with the frame length"
    return None


@stage("STFT", check=_stft_check)
def _stft(ctx: StageCtx) -> None:
    shape = ctx.shape(0)
    dtype = ctx.tensor(0).dtype
    step = _const_int(ctx, 1, 1)
    window_size = ctx.shape(2)[0] if ctx.has(2) else None
    length = _const_int(ctx, 3, None) or window_size
    is_complex = shape[-1] == 2
    zero = const(0, dtype)

    def sample(where: list[Expr], t: Expr) -> tuple[Expr, Expr]:
        b, frame, _ = where
        position = add(mul(frame, step), t)
        inside = index_compare("lt", position, shape[1])
        at = clamp(position, 0, shape[1] - 1)
        re = select(inside, ctx.operand(0, Index(shape, dims=[b, at, iconst(0)])), zero)
        im = (select(inside, ctx.operand(0, Index(shape, dims=[b, at, iconst(1)])), zero)
              if is_complex else zero)
        if ctx.has(2):
            w = ctx.operand(2, Index(ctx.shape(2), dims=[t]))
            re, im = binary("mul", re, w), binary("mul", im, w)
        return re, im

    _AXIS_SLOT[0] = 2
    _transform(ctx, length, min(length, window_size or length), sample, False, 1.0, False)
