"""Quantization: QuantizeLinear/DequantizeLinear (per tensor, per axis, blocked),
DynamicQuantizeLinear, and the integer contractions MatMulInteger, ConvInteger, QLinearMatMul,
QLinearConv (int32 accumulation of zero-point-shifted operands, requantised in float64 with
round-half-to-even and saturation, as the ONNX reference computes it).
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    Expr,
    add,
    binary,
    call,
    cast,
    const,
    floordiv,
    iconst,
    make,
    mul,
    select,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import InlineCtx, OpAccess, Point, RowCtx, RowView, StageCtx
from kiln.codegen.ops.registry import inline, row, stage
from kiln.codegen.gemm.contraction import contraction
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.ops.conv import ConvOperands, conv_stage
from kiln.codegen.ops.common import axis_of
from kiln.ecg import Graph, Op

INT_QUANT = ("int8", "uint8", "int16", "uint16")


def _param(ctx: OpAccess, i: int, index: Index, axis: int, block: int, read) -> Expr:
    """A scale or zero point for element `index`: per tensor, per axis, or per block."""
    shape = ctx.shape(i)
    if int(np.prod(shape)) == 1:
        return read(i, Index(shape, flat=iconst(0)))
    dims = index.dims
    if block:
        return read(i, Index(shape, dims=[floordiv(d, block) if a == axis else d
                                          for a, d in enumerate(dims)]))
    return read(i, Index(shape, dims=[dims[axis]]))


def _saturate(value: Expr, dtype: str) -> Expr:
    info = np.iinfo(np.dtype(dtype))
    lo, hi = const(float(info.min), value.dtype), const(float(info.max), value.dtype)
    value = select(make("lt", BOOL, (value, lo)), lo, value)
    return cast(select(make("gt", BOOL, (value, hi)), hi, value), dtype)


def _rint(v: Expr) -> Expr:
    return call("nearbyint", v.dtype, v)


def _quantize_check(op: Op, graph: Graph) -> str | None:
    out = graph.tensors[op.outputs[0]].dtype
    if out not in INT_QUANT:
        return f"{out} output"
    precision = op.attrs.get("precision")
    if precision and np.dtype(helper.tensor_dtype_to_np_dtype(precision)).name not in FLOAT_TYPES:
        return "precision"
    return None


@inline("QuantizeLinear", check=_quantize_check)
def _quantize(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.shape(0))
    axis, block = axis_of(ctx.attr("axis", 1), max(rank, 1)), ctx.attr("block_size", 0)
    precision = ctx.attr("precision")
    x = ctx.input(0, index)
    scale = _param(ctx, 1, index, axis, block, lambda i, at: ctx.input(i, at))
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(precision)).name if precision else x.dtype
    value = _rint(binary("div", cast(x, dtype), cast(scale, dtype)))
    compute = "float64" if dtype == "float64" else "float32"
    value = cast(value, compute)
    if ctx.has(2):
        zero = _param(ctx, 2, index, axis, block, lambda i, at: ctx.input(i, at))
        value = binary("add", value, cast(zero, compute))
    return _saturate(value, ctx.out.dtype)


@inline("DequantizeLinear")
def _dequantize(ctx: InlineCtx, index: Index) -> Expr:
    rank = len(ctx.shape(0))
    axis, block = axis_of(ctx.attr("axis", 1), max(rank, 1)), ctx.attr("block_size", 0)
    x = cast(ctx.input(0, index), "float32")
    if ctx.has(2):
        zero = _param(ctx, 2, index, axis, block, lambda i, at: ctx.input(i, at))
        x = binary("sub", x, cast(zero, "float32"))
    scale = _param(ctx, 1, index, axis, block, lambda i, at: ctx.input(i, at))
    product = binary("mul", cast(x, scale.dtype), scale)
    return cast(product, ctx.out.dtype)


def _whole(op: Op, graph: Graph) -> RowView:
    return RowView((1, graph.tensors[op.inputs[0]].numel), (1,))


@row("DynamicQuantizeLinear", view=_whole)
def _dynamic_quantize(rc: RowCtx) -> None:
    dtype = rc.tensor(0).dtype

    def x(p: Point) -> Expr:
        return rc.input(0, p)

    zero = const(0, dtype)
    high = rc.reduce("max", dtype, x)
    low = rc.reduce("min", dtype, x)
    high = select(make("gt", BOOL, (high, zero)), high, zero)
    low = select(make("lt", BOOL, (low, zero)), low, zero)
    span = select(make("eq", BOOL, (high, low)), const(1, dtype), binary("sub", high, low))
    scale = binary("div", span, const(255, dtype))
    start = binary("sub", zero, binary("div", low, scale))
    start = select(make("lt", BOOL, (start, zero)), zero, start)
    start = select(make("gt", BOOL, (start, const(255, dtype))), const(255, dtype), start)
    point = _rint(start)
    rc.row_output(0, lambda p: _saturate(binary("add", _rint(binary("div", x(p), scale)), point),
                                         "uint8"))
    rc.reduced_output(1, scale)
    rc.reduced_output(2, cast(point, "uint8"))


# --- integer contractions --------------------------------------------------------------------------
def _shifted(ctx: StageCtx, value_at: int, zero_at: int | None, index: Index, zero_dim: int | None) -> Expr:
    """int32(value) − int32(zero point): the zero point per tensor, or along one dim of `index`."""
    value = cast(ctx.operand(value_at, index), "int32")
    if zero_at is None or not ctx.has(zero_at):
        return value
    shape = ctx.shape(zero_at)
    if int(np.prod(shape)) == 1 or zero_dim is None:
        where = Index(shape, flat=iconst(0))
    else:
        where = Index(shape, dims=[index.dims[zero_dim]])
    return binary("sub", value, cast(ctx.operand(zero_at, where), "int32"))


def _matmul_geometry(ctx: StageCtx, a_at: int, b_at: int):
    a_shape, b_shape = ctx.shape(a_at), ctx.shape(b_at)
    a2 = (1, *a_shape) if len(a_shape) == 1 else a_shape
    b2 = (*b_shape, 1) if len(b_shape) == 1 else b_shape
    batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
    return a_shape, b_shape, a2, b2, batch


def _integer_matmul(ctx: StageCtx, a_at: int, a_zero: int, b_at: int, b_zero: int,
                    finish) -> None:
    a_shape, b_shape, a2, b2, batch = _matmul_geometry(ctx, a_at, b_at)
    m, k, n = a2[-2], a2[-1], b2[-1]
    out_shape = ctx.out().shape

    def a_value(bi: Index, i: Expr, kk: Expr) -> Expr:
        index = Index(a2, dims=[*bi.dims, i, kk]).reshaped(a_shape)
        return _shifted(ctx, a_at, a_zero, index, len(a_shape) - 2 if len(a_shape) > 1 else None)

    def b_value(bi: Index, kk: Expr, j: Expr) -> Expr:
        index = Index(b2, dims=[*bi.dims, kk, j]).reshaped(b_shape)
        return _shifted(ctx, b_at, b_zero, index, len(b_shape) - 1 if len(b_shape) > 1 else None)

    def out(b: Expr, i: Expr, j: Expr) -> Index:
        return Index(out_shape, flat=add(mul(add(mul(b, m), i), n), j))

    contraction(ctx, Contraction(batch, m, n, k, a2[:-2], b2[:-2], a_value, b_value, out,
                                 finish, "int32"))


@stage("MatMulInteger")
def _matmul_integer(ctx: StageCtx) -> None:
    _integer_matmul(ctx, 0, 2, 1, 3, lambda total, b, i, j: total)


def _requantize(total: Expr, multiplier: Expr, zero: Expr | None, dtype: str) -> Expr:
    value = binary("mul", cast(total, "float64"), cast(multiplier, "float64"))
    if zero is not None:
        value = binary("add", value, cast(zero, "float64"))
    return _saturate(_rint(value), dtype)


def _scalar_or_along(ctx: StageCtx, i: int, position: Expr) -> Expr:
    shape = ctx.shape(i)
    if int(np.prod(shape)) == 1:
        return ctx.operand(i, Index(shape, flat=iconst(0)))
    return ctx.operand(i, Index(shape, dims=[position]))


@stage("QLinearMatMul")
def _qlinear_matmul(ctx: StageCtx) -> None:
    dtype = ctx.out().dtype

    def finish(total: Expr, b: Expr, i: Expr, j: Expr) -> Expr:
        scale = binary("div", binary("mul", _scalar_or_along(ctx, 1, i), _scalar_or_along(ctx, 4, j)),
                       _scalar_or_along(ctx, 6, iconst(0)))
        return _requantize(total, scale, _scalar_or_along(ctx, 7, iconst(0)), dtype)

    _integer_matmul(ctx, 0, 2, 3, 5, finish)


def _integer_conv(ctx: StageCtx, weight: int, x_zero: int | None, w_zero: int | None, finish) -> None:
    def operands(x: str, _folded: bool) -> ConvOperands:
        def read_x(index: Index) -> Expr:
            value = cast(ctx.builder.value(x, index), "int32")
            if x_zero is None or not ctx.has(x_zero):
                return value
            return binary("sub", value, cast(_scalar_or_along(ctx, x_zero, iconst(0)), "int32"))

        def read_w(index: Index) -> Expr:
            return _shifted(ctx, weight, w_zero, index, 0)

        return ConvOperands(x, read_x, read_w, "int32", finish)

    conv_stage(ctx, weight, operands)


@stage("ConvInteger")
def _conv_integer(ctx: StageCtx) -> None:
    _integer_conv(ctx, 1, 2, 3, lambda total, m: total)


@stage("QLinearConv")
def _qlinear_conv(ctx: StageCtx) -> None:
    dtype = ctx.out().dtype

    def finish(total: Expr, m: Expr) -> Expr:
        if ctx.has(8):
            total = binary("add", total, ctx.operand(8, Index(ctx.shape(8), dims=[m])))
        scale = binary("div", binary("mul", _scalar_or_along(ctx, 1, iconst(0)),
                                     _scalar_or_along(ctx, 4, m)), _scalar_or_along(ctx, 6, iconst(0)))
        return _requantize(total, scale, _scalar_or_along(ctx, 7, iconst(0)), dtype)

    _integer_conv(ctx, 3, 2, 5, finish)
