"""Per-op lowerings, registered next to their code (one module per op family).

Three kinds, following the mapping types:

* `inline` — One-to-One, Reorganize, Shuffle and One-to-Many ops: the value of one output element
  as an expression of input elements at mapped indices. These never get a loop of their own; the
  stage that needs their value evaluates them where it reads them.
* `row` — reductions and normalisations over some axes (Many-to-Many, one-relies-on-many): a list
  of reduction phases per row plus per-row and per-element results. Several row ops over the same
  rows share one multi-phase loop (Souffle's two-phase reduction, generalised).
* `stage` — every other Many-to-Many op (MatMul, Conv, pooling, scans, recurrences, ...): a
  function that writes its own loop nest and hands each result element to the block's epilogue.

A lowering may also declare `check(op, graph) -> reason | None` for variants it does not handle.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.ecg import Graph, Op

CheckFn = Callable[[Op, Graph], "str | None"]


@dataclass(frozen=True)
class OpLowering:
    op_type: str
    kind: str  # "inline", "row" or "stage"
    lower: Callable[..., Any]
    view: Callable[..., Any] | None = None  # row ops: (op, graph) -> RowView
    check: CheckFn | None = None


_REGISTRY: dict[str, OpLowering] = {}
_LOADED = False
_LOAD_LOCK = threading.RLock()


def _register(kind: str, op_types: tuple[str, ...], check: CheckFn | None,
              view: Callable[..., Any] | None = None):
    def wrap(fn):
        for op_type in op_types:
            if op_type in _REGISTRY:
                raise ValueError(f"lowering for {op_type} registered twice")
            _REGISTRY[op_type] = OpLowering(op_type, kind, fn, view, check)
        return fn
    return wrap


def inline(*op_types: str, check: CheckFn | None = None):
    return _register("inline", op_types, check)


def row(*op_types: str, view: Callable[..., Any], check: CheckFn | None = None):
    return _register("row", op_types, check, view)


def stage(*op_types: str, check: CheckFn | None = None):
    return _register("stage", op_types, check)


def lowering(op_type: str) -> OpLowering | None:
    _load()
    return _REGISTRY.get(op_type)


def registered() -> dict[str, OpLowering]:
    _load()
    return dict(_REGISTRY)


def _load() -> None:
    # A flag set once every module has been imported, not "the registry is non-empty": importing
    # one op module directly, or another thread half-way through, fills part of the registry.
    global _LOADED
    if _LOADED:
        return
    with _LOAD_LOCK:
        _import_all()
        _LOADED = True


def _import_all() -> None:
    from kiln.codegen.ops import (  # noqa: F401  (each module registers its ops)
        attention,
        contraction,
        conv,
        elementwise,
        losses,
        movement,
        quantized,
        recurrent,
        resize,
        rotary,
        rows,
        scan,
        scatter,
        signal,
    )
