"""One reduction phase of a row stage: an accumulator, a loop over the row, a finished value.

Kinds: sum, prod, max, min (floats propagate NaN, as numpy and onnxruntime's Max do, while the
loop stays vectorisable: a NaN flag is reduced alongside the maximum), argmax and argmin (first
element as the start, strict comparison, so ties and NaNs resolve as in onnxruntime).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    FLOAT_TYPES,
    INDEX,
    Expr,
    acc,
    binary,
    cast,
    const,
    iconst,
    local,
    make,
    select,
    var,
)

COMBINE = {"sum": ("add", "+"), "prod": ("mul", "*")}


def reduction_phase(names: Callable[[str], str], extent: int, point_at: Callable[[Expr], Any],
                    kind: str, dtype: str, body: Callable[[Any], Expr],
                    select_last: bool, keep: str | None = None) -> tuple[list[ir.Stmt], Expr]:
    """Statements of the phase and its finished value; `keep` names a local array that also
    receives every element value."""
    if kind in ("argmax", "argmin"):
        return _arg_phase(names, extent, point_at, kind, dtype, body, select_last)
    r = var(names("r"), extent)
    x = body(point_at(r))
    assert x.dtype == dtype, (x.dtype, dtype)
    a = acc(names("acc"), dtype)
    result = local(names("s"), dtype)
    kept = [ir.ArrayStore(keep, r, x)] if keep is not None else []
    if kind in COMBINE:
        op, clause = COMBINE[kind]
        init = const(0 if kind == "sum" else 1, dtype)
        update = kept + [ir.Assign(a, binary(op, a, x))]
        return [ir.DeclAcc(a, init),
                ir.Loop(r, iconst(0), iconst(extent), update, simd=True, reductions=((clause, a),)),
                ir.Let(result, a)], result
    assert kind in ("max", "min"), kind
    better = "gt" if kind == "max" else "lt"
    update = kept + [ir.Assign(a, select(make(better, BOOL, (x, a)), x, a))]
    stmts: list[ir.Stmt] = [ir.DeclAcc(a, const(_identity(kind, dtype), dtype))]
    reductions: tuple[tuple[str, Expr], ...] = ((kind, a),)
    finished: Expr = a
    if dtype in FLOAT_TYPES:
        nan = acc(names("nan"), "int32")
        stmts.append(ir.DeclAcc(nan, const(0, "int32")))
        update.append(ir.Assign(nan, binary("bitor", nan, cast(make("ne", BOOL, (x, x)), "int32"))))
        reductions += (("|", nan),)
        finished = select(make("ne", BOOL, (nan, const(0, "int32"))), const(math.nan, dtype), a)
    stmts += [ir.Loop(r, iconst(0), iconst(extent), update, simd=True, reductions=reductions),
              ir.Let(result, finished)]
    return stmts, result


def _identity(kind: str, dtype: str):
    if dtype in FLOAT_TYPES:
        return -math.inf if kind == "max" else math.inf
    info = np.iinfo(np.dtype(dtype)) if dtype != BOOL else None
    if info is None:
        return 0 if kind == "max" else 1
    return info.min if kind == "max" else info.max


def _arg_phase(names, extent, point_at, kind, dtype, body, select_last):
    best = acc(names("best"), dtype)
    where = acc(names("arg"), INDEX)
    first = body(point_at(iconst(0)))
    r = var(names("r"), max(extent - 1, 1), lo=1)
    x = body(point_at(r))
    op = ("ge" if select_last else "gt") if kind == "argmax" else ("le" if select_last else "lt")
    better = local(names("c"), BOOL)
    update = [ir.Let(better, make(op, BOOL, (x, best))),
              ir.Assign(where, select(better, r, where)),
              ir.Assign(best, select(better, x, best))]
    result = local(names("s"), INDEX)
    return [ir.DeclAcc(best, first), ir.DeclAcc(where, iconst(0)),
            ir.Loop(r, iconst(1), iconst(extent), update),
            ir.Let(result, where)], result
