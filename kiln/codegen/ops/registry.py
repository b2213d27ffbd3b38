"""The registry of op lowerings: `inline`, `row` and `stage` register a lowering next to its code;
`lowering` and `registered` look them up once `kiln.codegen.ops` has imported every family."""
from __future__ import annotations

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
    return _REGISTRY.get(op_type)


def registered() -> dict[str, OpLowering]:
    return dict(_REGISTRY)
