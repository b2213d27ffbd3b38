"""A convolution's sliding-window geometry and how it reads its operands: what every form of
convolution kernel shares (`conv.py`'s loop nests and implicit GEMM, `conv_direct.py`,
`conv_winograd.py`, AGO's intensive fusion and GraphTurbo's tiled stages)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import Expr, add, floordiv, iconst, imax, imin, mul, sub
from kiln.codegen.gemm.spec import constant_values
from kiln.codegen.indexing import Index
from kiln.ecg import Op


@dataclass(frozen=True)
class Window:
    """Sliding-window geometry per spatial dim: output o reads input o·stride + k·dilation − pad."""

    in_size: tuple[int, ...]
    out_size: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pad_begin: tuple[int, ...]
    pad_end: tuple[int, ...]


def window(op: Op, in_size: tuple[int, ...], out_size: tuple[int, ...],
           kernel: tuple[int, ...]) -> Window:
    k = len(in_size)
    strides = tuple(op.attrs.get("strides") or [1] * k)
    dilations = tuple(op.attrs.get("dilations") or [1] * k)
    auto_pad = op.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [max(0, (o - 1) * s + (kk - 1) * d + 1 - i)
                 for i, o, kk, s, d in zip(in_size, out_size, kernel, strides, dilations)]
        small = [t // 2 for t in total]
        large = [t - t // 2 for t in total]
        begin, end = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        begin, end = [0] * k, [0] * k
    else:
        pads = op.attrs.get("pads") or [0] * (2 * k)
        begin, end = pads[:k], pads[k:]
    return Window(in_size, out_size, kernel, strides, dilations, tuple(begin), tuple(end))


def ceildiv(a: Expr, b: int) -> Expr:
    return mul(floordiv(mul(a, -1), b), -1)


def valid_taps(w: Window, d: int, o: Expr) -> tuple[Expr, Expr]:
    """The kernel taps [lo, hi) of dim d whose input position lies inside the input."""
    base = sub(mul(o, w.strides[d]), w.pad_begin[d])
    lo = imax(ceildiv(mul(base, -1), w.dilations[d]), 0)
    hi = imin(ceildiv(sub(iconst(w.in_size[d]), base), w.dilations[d]), w.kernel[d])
    return lo, hi


def tap_position(w: Window, d: int, o: Expr, tap: Expr) -> Expr:
    return add(mul(o, w.strides[d]), mul(tap, w.dilations[d]), -w.pad_begin[d])


Reader = Callable[[Index], Expr]
Finish = Callable[[Expr, Expr], Expr]  # (sum over the window, output channel) -> result


@dataclass(frozen=True)
class ConvOperands:
    """How a convolution reads its operands and finishes its sums: plain Conv reads x and w as
    they are and adds the bias; ConvInteger/QLinearConv subtract zero points in int32 and
    requantize."""

    x: str  # the tensor read as input (a folded Pad's input, when a Pad was folded)
    read_x: Reader
    read_w: Reader
    acc_dtype: str
    finish: Finish
    # reads for a loop that reads each input element once (a padded copy): the input's fused
    # prologue evaluated there, never packed into scratch first; None: `read_x`
    read_x_once: Reader | None = None

    @property
    def once(self) -> Reader:
        return self.read_x_once or self.read_x


def constant_weights(ctx: StageCtx, ops: ConvOperands, w_shape: tuple[int, ...]
                     ) -> np.ndarray | None:
    """The weights' values, flat in their own order, gathered at compile time; None if they are
    not constants."""
    numel = math.prod(w_shape)
    flat = ctx.var("w", numel)
    return constant_values(ctx, ops.read_w(Index(w_shape, flat=flat)), (flat,),
                           [np.arange(numel)])
