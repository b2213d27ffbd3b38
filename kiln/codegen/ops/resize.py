"""Resize, Upsample and GridSample: interpolation as index maps.

Resize/Upsample are separable, with compile-time tap tables: scales and sizes are constants (otherwise the output shape would depend on run-time values), so
every resized axis's source coordinates are known when compiling: for each output position along
the axis, a few taps (input index, weight) are computed here in float64, following the ONNX
definition (coordinate transformation modes, nearest rounding modes, linear and cubic kernels,
exclude_outside, antialiasing, tf_crop_and_resize extrapolation). An output element is then
Σ over tap combinations of Π weights · x[taps] — nearest mode is a pure gather with no arithmetic.
GridSample reads its sampling positions from the grid at run time and computes taps and weights
in the expression (nearest, linear, cubic; zeros, border and reflection padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    INDEX,
    Expr,
    add,
    binary,
    call,
    cast,
    clamp,
    const,
    index_compare,
    load,
    logical_and,
    logical_or,
    make,
    mul,
    select,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import InlineCtx
from kiln.codegen.ops.registry import inline
from kiln.codegen.ops.common import axis_of
from kiln.ecg import Graph, Op

MAX_TAP_PRODUCT = 4096


@dataclass(frozen=True)
class AxisTaps:
    indices: np.ndarray  # (out, taps) int64
    weights: np.ndarray  # (out, taps) float64
    extrapolated: np.ndarray | None  # (out,) bool, tf_crop_and_resize only


@dataclass(frozen=True)
class ResizeSpec:
    mode: str
    coordinates: str
    nearest: str
    cubic_a: float
    exclude_outside: bool
    antialias: bool
    extrapolation: float
    scales: tuple[float, ...]
    roi: tuple[float, ...] | None


def _const(op: Op, graph: Graph, position: int) -> np.ndarray | None:
    if position >= len(op.inputs) or op.inputs[position] is None:
        return None
    t = graph.tensors[op.inputs[position]]
    return None if t.data is None else t.data


def resize_spec(op: Op, graph: Graph) -> ResizeSpec:
    in_shape = graph.tensors[op.inputs[0]].shape
    out_shape = graph.tensors[op.outputs[0]].shape
    rank = len(in_shape)
    legacy = op.op_type == "Upsample" or (graph.opset and graph.opset < 11)
    scales_at, roi_at, sizes_at = (1, None, None) if legacy else (2, 1, 3)
    axes = [axis_of(a, rank) for a in (op.attrs.get("axes") or range(rank))]
    given_scales = _const(op, graph, scales_at)
    if given_scales is None and "scales" in op.attrs:  # Upsample-7 takes them as an attribute
        given_scales = np.asarray(op.attrs["scales"], dtype=np.float32)
    sizes = _const(op, graph, sizes_at) if sizes_at else None
    scales = [1.0] * rank
    if given_scales is not None and given_scales.size:
        for a, s in zip(axes, given_scales.reshape(-1)):
            scales[a] = float(s)
    else:
        ratios = [float(n) / in_shape[a] for a, n in zip(axes, sizes.reshape(-1))]
        policy = op.attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            common = min(ratios) if policy == "not_larger" else max(ratios)
            ratios = [common] * len(axes)
        for a, r in zip(axes, ratios):
            scales[a] = r
    roi = None
    roi_data = _const(op, graph, roi_at) if roi_at else None
    if roi_data is not None and roi_data.size:
        full = [0.0] * rank + [1.0] * rank
        values = [float(v) for v in roi_data.reshape(-1)]
        k = len(values) // 2
        for i, a in enumerate(axes if k == len(axes) else range(rank)):
            full[a], full[rank + a] = values[i], values[k + i]
        roi = tuple(full)
    mode = op.attrs.get("mode", "nearest")
    if legacy:
        upsampling = all(o >= i for o, i in zip(out_shape, in_shape))
        return ResizeSpec(mode, "asymmetric", "floor" if upsampling else "ceil", -0.75, False,
                          False, 0.0, tuple(scales), None)
    return ResizeSpec(mode, op.attrs.get("coordinate_transformation_mode", "half_pixel"),
                      op.attrs.get("nearest_mode", "round_prefer_floor"),
                      float(op.attrs.get("cubic_coeff_a", -0.75)),
                      bool(op.attrs.get("exclude_outside", 0)), bool(op.attrs.get("antialias", 0)),
                      float(op.attrs.get("extrapolation_value", 0.0)), tuple(scales), roi)


# --- one axis --------------------------------------------------------------------------------------
def _coefficients(spec: ResizeSpec, ratio: float, scale: float) -> np.ndarray:
    if spec.mode == "nearest":
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        choose_upper = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                        "floor": False, "ceil": True}[spec.nearest]
        return np.array([0.0, 1.0]) if choose_upper else np.array([1.0, 0.0])
    if spec.mode == "linear":
        if not spec.antialias:
            return np.array([1 - ratio, ratio])
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        args = (np.arange(start, 2 - start) - ratio) * s
        coeffs = np.clip(1 - np.abs(args), 0, 1)
        return coeffs / coeffs.sum()
    a = spec.cubic_a
    if not spec.antialias:
        r = ratio
        return np.array([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                         ((a + 2) * r - (a + 3)) * r * r + 1,
                         ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                         ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a])
    s = min(scale, 1.0)
    start = int(np.floor(-2 / s) + 1)
    x = np.abs(np.array([s * (i - ratio) for i in range(start, 2 - start)]))
    coeffs = np.where(x <= 1, (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1,
                      np.where(x < 2, a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a, 0.0))
    return coeffs / coeffs.sum()


def _source_coordinates(spec: ResizeSpec, axis: int, rank: int, scale: float, in_len: int,
                        out_len: int) -> tuple[np.ndarray, np.ndarray | None]:
    y = np.arange(out_len, dtype=np.float64)
    out_width = scale * in_len
    mode = spec.coordinates
    if mode == "align_corners":
        return (np.zeros(out_len) if out_width == 1 else y * (in_len - 1) / (out_width - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_crop_and_resize":
        roi = spec.roi or tuple([0.0] * rank + [1.0] * rank)
        start, end = roi[axis], roi[rank + axis]
        if out_width == 1:
            x = np.full(out_len, (end - start) * (in_len - 1) / 2)
        else:
            x = y * (end - start) * (in_len - 1) / (out_width - 1)
        x = x + start * (in_len - 1)
        return x, (x < 0) | (x > in_len - 1)
    if mode == "pytorch_half_pixel":
        return (np.full(out_len, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        return offset + (y + 0.5) / scale - 0.5, None
    raise ValueError(f"coordinate_transformation_mode {mode!r}")


def axis_taps(spec: ResizeSpec, axis: int, rank: int, in_len: int, out_len: int) -> AxisTaps:
    scale = spec.scales[axis]
    x, extrapolated = _source_coordinates(spec, axis, rank, scale, in_len, out_len)
    whole = np.floor(x)
    ratios = np.where(x == whole, 1.0, x - whole)
    coeffs = np.stack([_coefficients(spec, float(r), scale) for r in ratios])
    n = coeffs.shape[1]
    pad = math.ceil(n / 2)
    padded = x + pad
    p = np.floor(padded).astype(np.int64)
    frac = padded - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        offset = np.where(frac <= 0.5, base, base + 1)
    neighbours = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if spec.exclude_outside:
        coeffs = np.where((neighbours < 0) | (neighbours >= in_len), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    return _compact(np.clip(neighbours, 0, in_len - 1), coeffs, extrapolated)


def _compact(indices: np.ndarray, weights: np.ndarray, extrapolated) -> AxisTaps:
    """Merge taps reading the same input element and drop zero-weight taps."""
    rows = []
    for idx, w in zip(indices, weights):
        merged: dict[int, float] = {}
        for i, c in zip(idx.tolist(), w.tolist()):
            merged[i] = merged.get(i, 0.0) + c
        rows.append([(i, c) for i, c in merged.items() if c != 0.0] or [(0, 0.0)])
    taps = max(len(r) for r in rows)
    out_idx = np.zeros((len(rows), taps), dtype=np.int64)
    out_w = np.zeros((len(rows), taps), dtype=np.float64)
    for k, r in enumerate(rows):
        for t, (i, c) in enumerate(r):
            out_idx[k, t], out_w[k, t] = i, c
    return AxisTaps(out_idx, out_w, extrapolated)


def _is_identity(spec: ResizeSpec, axis: int, rank: int, in_len: int, out_len: int) -> bool:
    roi = spec.roi
    trivial_roi = roi is None or (math.isclose(roi[axis], 0.0) and math.isclose(roi[rank + axis], 1.0))
    return math.isclose(spec.scales[axis], 1.0) and in_len == out_len and trivial_roi


def all_taps(op: Op, graph: Graph) -> tuple[ResizeSpec, dict[int, AxisTaps]]:
    spec = resize_spec(op, graph)
    in_shape = graph.tensors[op.inputs[0]].shape
    out_shape = graph.tensors[op.outputs[0]].shape
    rank = len(in_shape)
    taps = {a: axis_taps(spec, a, rank, in_shape[a], out_shape[a]) for a in range(rank)
            if out_shape[a] and not _is_identity(spec, a, rank, in_shape[a], out_shape[a])}
    return spec, taps


def _check(op: Op, graph: Graph) -> str | None:
    legacy_inputs = op.op_type == "Upsample" or (graph.opset and graph.opset < 11)
    for position in ((1,) if legacy_inputs else (1, 2, 3)):
        if position < len(op.inputs) and op.inputs[position] is not None \
                and not graph.is_constant(op.inputs[position]):
            return f"input {position} must be a constant"
    if op.attrs.get("mode", "nearest") not in ("nearest", "linear", "cubic"):
        return "unknown mode"
    _, taps = all_taps(op, graph)
    if math.prod(t.indices.shape[1] for t in taps.values()) > MAX_TAP_PRODUCT:
        return "too many interpolation taps"
    return None


@inline("Resize", "Upsample", check=_check)
def _resize(ctx: InlineCtx, index: Index) -> Expr:
    spec, taps = all_taps(ctx.op, ctx.graph)
    in_shape, dtype = ctx.shape(0), ctx.out.dtype
    exact = all(t.indices.shape[1] == 1 and np.all(t.weights == 1.0) for t in taps.values())
    compute = dtype if dtype in FLOAT_TYPES else "float64"
    tables = {a: (ctx.derived(t.indices), ctx.derived(t.weights.astype(compute)), t.indices.shape[1])
              for a, t in taps.items()}
    total: Expr | None = None
    for combo in np.ndindex(*(n for _, _, n in tables.values())):
        dims, weight = list(index.dims), None
        for (a, (idx_table, w_table, n)), t in zip(tables.items(), combo):
            slot = _table_slot(index.dims[a], n, t)
            dims[a] = load(idx_table, INDEX, slot)
            if not exact:
                w = load(w_table, compute, slot)
                weight = w if weight is None else binary("mul", weight, w)
        value = ctx.input(0, Index(in_shape, dims=dims))
        if not exact:
            value = binary("mul", weight, cast(value, compute))
        total = value if total is None else binary("add", total, value)
    if not exact and dtype not in FLOAT_TYPES:
        total = _saturate(call("nearbyint", compute, total), dtype)
    flagged = [t for t in taps.values() if t.extrapolated is not None and t.extrapolated.any()]
    if flagged:
        outside = const(False, BOOL)
        for a, t in taps.items():
            if t.extrapolated is not None and t.extrapolated.any():
                mask = ctx.derived(t.extrapolated.astype(np.uint8))
                outside = logical_or(outside, make("ne", BOOL, (load(mask, "uint8", index.dims[a]),
                                                                const(0, "uint8"))))
        total = select(outside, const(spec.extrapolation, total.dtype), total)
    return total


def _table_slot(position: Expr, taps: int, t: int) -> Expr:
    return add(mul(position, taps), t)


def _saturate(value: Expr, dtype: str) -> Expr:
    info = np.iinfo(np.dtype(dtype))
    lo, hi = const(float(info.min), value.dtype), const(float(info.max), value.dtype)
    value = select(make("lt", BOOL, (value, lo)), lo, value)
    value = select(make("gt", BOOL, (value, hi)), hi, value)
    return cast(value, dtype)


# --- GridSample --------------------------------------------------------------------------------------
GRID_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic",
              "cubic": "cubic"}
CUBIC_ALPHA = -0.75


def _grid_check(op: Op, graph: Graph) -> str | None:
    if op.attrs.get("mode", "linear") not in GRID_MODES:
        return "unknown mode"
    if graph.tensors[op.inputs[0]].dtype not in FLOAT_TYPES:
        return "floating-point input only"
    return None


def _fconst(v: float, like: Expr) -> Expr:
    return const(v, like.dtype)


def _reflect(x: Expr, lo: float, hi: float) -> Expr:
    """Reflect by the nearer border until inside [lo, hi] (the ONNX reference's rule)."""
    span = hi - lo

    def folded(distance: Expr, near: float, far: float) -> Expr:
        turns = cast(binary("div", distance, _fconst(span, x)), "int32")
        rest = binary("sub", distance, binary("mul", cast(turns, x.dtype), _fconst(span, x)))
        even = make("eq", BOOL, (binary("mod_c", turns, const(2, "int32")), const(0, "int32")))
        sign = 1.0 if near < far else -1.0
        toward = binary("add", _fconst(near, x), binary("mul", _fconst(sign, x), rest))
        back = binary("sub", _fconst(far, x), binary("mul", _fconst(sign, x), rest))
        return select(even, toward, back)

    below = folded(binary("sub", _fconst(lo, x), x), lo, hi)
    above = folded(binary("sub", x, _fconst(hi, x)), hi, lo)
    return select(make("lt", BOOL, (x, _fconst(lo, x))), below,
                  select(make("gt", BOOL, (x, _fconst(hi, x))), above, x))


def _cubic_weights(t: Expr) -> list[Expr]:
    a = CUBIC_ALPHA

    def c(v: float) -> Expr:
        return _fconst(v, t)

    def near(u: Expr) -> Expr:  # |u| <= 1
        return binary("add", binary("mul", binary("mul", binary(
            "sub", binary("mul", c(a + 2), u), c(a + 3)), u), u), c(1))

    def far(u: Expr) -> Expr:  # 1 < |u| < 2
        inner = binary("add", binary("mul", binary("sub", binary("mul", c(a), u), c(5 * a)), u),
                       c(8 * a))
        return binary("sub", binary("mul", inner, u), c(4 * a))

    one_minus = binary("sub", c(1), t)
    return [far(binary("add", t, c(1))), near(t), near(one_minus),
            far(binary("add", one_minus, c(1)))]


@inline("GridSample", check=_grid_check)
def _grid_sample(ctx: InlineCtx, index: Index) -> Expr:
    x_shape, grid_shape = ctx.shape(0), ctx.shape(1)
    spatial = x_shape[2:]
    rank = len(spatial)
    mode = GRID_MODES[ctx.attr("mode", "linear")]
    padding = ctx.attr("padding_mode", "zeros")
    align = bool(ctx.attr("align_corners", 0))
    n, ch, *o = index.dims
    dtype = ctx.out.dtype
    coords, borders = [], []
    for i, size in enumerate(spatial):
        g = cast(ctx.input(1, Index(grid_shape, dims=[n, *o, const(rank - 1 - i, "int64")])), dtype)
        one = _fconst(1, g)
        if align:
            x = binary("mul", binary("div", binary("add", g, one), _fconst(2, g)), _fconst(size - 1, g))
            lo, hi = 0.0, size - 1.0
        else:
            x = binary("div", binary("sub", binary("mul", binary("add", g, one), _fconst(size, g)), one),
                       _fconst(2, g))
            lo, hi = -0.5, size - 0.5
        if mode == "nearest":
            x = call("nearbyint", dtype, x)
        outside = logical_or(make("lt", BOOL, (x, _fconst(lo, x))), make("gt", BOOL, (x, _fconst(hi, x))))
        if padding == "border":
            clamped = select(make("lt", BOOL, (x, _fconst(0, x))), _fconst(0, x),
                             select(make("gt", BOOL, (x, _fconst(size - 1, x))), _fconst(size - 1, x), x))
            x = select(outside, clamped, x)
        elif padding == "reflection":
            x = select(outside, _reflect(x, lo, hi), x)
        coords.append(x)
        borders.append((lo, hi))

    def pixel(taps: list[Expr]) -> Expr:
        inside, dims = const(True, BOOL), []
        for tap, size, (lo, hi) in zip(taps, spatial, borders):
            if padding == "zeros":
                inside = logical_and(inside, logical_and(index_compare("ge", tap, 0),
                                                         index_compare("lt", tap, size)))
            elif padding == "reflection":
                tap = cast(_reflect(cast(tap, dtype), lo, hi), "int64")
            dims.append(clamp(tap, 0, size - 1))
        value = ctx.input(0, Index(x_shape, dims=[n, ch, *dims]))
        return select(inside, value, const(0, dtype)) if padding == "zeros" else value

    if mode == "nearest":
        return pixel([cast(cast(x, "int32"), "int64") for x in coords])
    offsets = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
    bases, weights = [], []
    for x in coords:
        base = call("floor", dtype, x)
        t = binary("sub", x, base)
        bases.append(cast(cast(base, "int32"), "int64"))
        weights.append([binary("sub", _fconst(1, t), t), t] if mode == "linear" else _cubic_weights(t))
    total: Expr | None = None
    for combo in np.ndindex(*([len(offsets)] * rank)):
        weight: Expr | None = None
        for w_list, k in zip(weights, combo):
            weight = w_list[k] if weight is None else binary("mul", weight, w_list[k])
        taps = [add(base, offsets[k]) for base, k in zip(bases, combo)]
        term = binary("mul", weight, pixel(taps))
        total = term if total is None else binary("add", total, term)
    return total


def _affine_check(op: Op, graph: Graph) -> str | None:
    if not graph.is_constant(op.inputs[1]):
        return "size must be a constant"
    return None if graph.tensors[op.inputs[0]].dtype in FLOAT_TYPES else "floating-point theta only"


@inline("AffineGrid", check=_affine_check)
def _affine_grid(ctx: InlineCtx, index: Index) -> Expr:
    """grid[n, *position, k] = Σ_j θ[n, k, j] · (x, y[, z], 1)_j over the normalised base grid."""
    n, *position, k = index.dims
    spatial = ctx.out.shape[1:-1]
    align = ctx.attr("align_corners", 0)
    dtype = ctx.out.dtype
    theta_shape = ctx.shape(0)
    coordinates = []
    for p, size in zip(reversed(position), reversed(spatial)):  # x (width) first
        i = cast(p, "float64")
        if align:
            step = 2.0 / (size - 1) if size > 1 else 0.0
            value = binary("add", const(-1.0, "float64"), binary("mul", i, const(step, "float64")))
        else:
            value = binary("sub", binary("div", binary("add", binary("mul", i, const(2.0, "float64")),
                                                       const(1.0, "float64")),
                                         const(float(size), "float64")), const(1.0, "float64"))
        coordinates.append(cast(value, dtype))
    coordinates.append(const(1, dtype))
    total: Expr | None = None
    for j, coordinate in enumerate(coordinates):
        theta = ctx.input(0, Index(theta_shape, dims=[n, k, const(j, "int64")]))
        term = binary("mul", theta, coordinate)
        total = term if total is None else binary("add", total, term)
    return total
