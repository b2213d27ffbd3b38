"""The op-facing lowering API: what an op's lowering (`kiln.codegen.ops`) sees of the block
being lowered.

* `InlineCtx` — an inline op: its inputs' values at any index;
* `StageCtx` — an anchor op: operands, fresh names, scratch, derived constants, its own loop nests
  (`stage`) and the fused epilogue (`results`);
* `RowCtx` with `RowView` and `Point` — a row op: reductions as phases over the rows of a view,
  results per row and per element.

The contexts know the block lowering (`kiln.codegen.lower`) only through `BlockServices`, the
part of it they use, so this module imports neither the lowering nor the op registry: op modules
import it, the lowering imports them, and no import circle closes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kiln.codegen import ir
from kiln.codegen.epilogue import Path, forward_index
from kiln.codegen.expr import Expr, add, array_load, iconst, load, local, mul, var, walk
from kiln.codegen.indexing import Index
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op, Tensor

MAX_KEPT_ROW = 4096  # a row's phase values kept on the stack: up to 16 KiB of float32


class NeedsBuffer(Exception):
    """A stage needs `tensor` from a buffer: the block must materialise it first."""

    def __init__(self, tensor: str):
        super().__init__(tensor)
        self.tensor = tensor


class NotFusable(Exception):
    """An expression reads a stage's result at another element than the one the stage holds."""


class Refused(Exception):
    """An epilogue that passed its trial failed in the real loop nest: lower again without it."""

    def __init__(self, op: str, tensor: str):
        super().__init__(f"{tensor} in the epilogue of {op}")
        self.pair = (op, tensor)


@dataclass
class Provided:
    """The element of `tensor` a stage holds: its row-major offset and value (or a thunk)."""

    flat: Expr
    value: Expr | Callable[[], Expr]

    def get(self) -> Expr:
        if callable(self.value):
            self.value = self.value()
        return self.value



class ValueBuilder(Protocol):
    """Element expressions of the block's tensors in one stage (`kiln.codegen.lower.Builder`)."""

    def value(self, tensor: str, index: Index) -> Expr: ...


class BlockServices(Protocol):
    """What the contexts use of the block lowering (`kiln.codegen.lower.BlockLowering`)."""

    graph: Graph
    schedule: Schedule
    names: Callable[[str], str]
    must_store: set[str]
    producer: dict[str, Op]
    ready: set[str]
    stage_info: list[dict]

    def builder(self, provided: dict[str, Provided] | None = None) -> ValueBuilder: ...

    def is_used(self, tensor: str) -> bool: ...

    def scratch(self, name: str, dtype: str, numel: int) -> str: ...

    def derived_constant(self, array: np.ndarray) -> str: ...

    def add_stage(self, comment: str, body: list[ir.Stmt], work: int) -> None: ...


class RowPhases(Protocol):
    """The row stage a row op joins (`kiln.codegen.lower.RowStage`)."""

    low: BlockServices
    o: Expr
    reduced: dict[str, Provided]
    rowvals: dict[str, Callable[[Point], Expr]]
    views: dict[str, RowView]

    def add_phase(self, kind: str, dtype: str, body: Callable[[Point], Expr],
                  select_last: bool, keep: str | None = None) -> Expr: ...


class OpAccess:
    """An op's inputs, outputs and attributes, as every lowering context offers them."""

    op: Op
    graph: Graph

    def has(self, i: int) -> bool:
        return i < len(self.op.inputs) and self.op.inputs[i] is not None

    def tensor(self, i: int) -> Tensor:
        return self.graph.tensors[self.op.inputs[i]]

    def shape(self, i: int) -> tuple[int, ...]:
        return self.tensor(i).shape

    def const(self, i: int) -> np.ndarray | None:
        return self.tensor(i).data if self.has(i) else None

    def attr(self, name: str, default=None):
        return self.op.attrs.get(name, default)


class InlineCtx(OpAccess):
    """What an inline op's lowering sees: its op, its inputs' values at any index."""

    def __init__(self, builder: ValueBuilder, low: BlockServices, op: Op, position: int):
        self.builder = builder
        self.low = low
        self.op = op
        self.position = position
        self.graph = low.graph

    def input(self, i: int, index: Index) -> Expr:
        return self.builder.value(self.op.inputs[i], index)

    def derived(self, array: np.ndarray) -> str:
        """A compile-time table the expression may load (a derived constant of the kernel)."""
        return self.low.derived_constant(array)

    @property
    def out(self) -> Tensor:
        return self.graph.tensors[self.op.outputs[self.position]]


# ---------------------------------------------------------------------------------------------
# Stage contexts

class StageCtx(OpAccess):
    """What an anchor's lowering sees: operands, fresh names, scratch, and the epilogue."""

    def __init__(self, low: BlockServices, op: Op, fused: dict[str, list[tuple[str, Path]]]):
        self.low = low
        self.op = op
        self.fused = fused
        self.graph = low.graph
        self.schedule = low.schedule
        self.builder = low.builder()
        self.info: dict[str, object] = {}  # schedule details recorded in Kernel.schedule

    # operands
    def operand(self, i: int, index: Index) -> Expr:
        return self.builder.value(self.op.inputs[i], index)

    def out(self, i: int = 0) -> Tensor:
        return self.graph.tensors[self.op.outputs[i]]

    def output_used(self, i: int) -> bool:
        return i < len(self.op.outputs) and self.low.is_used(self.op.outputs[i])

    def reader(self, tensor: str) -> Callable[[Index], Expr]:
        """Element reads of a block tensor for a loop that reads each element many times: through
        the prologue when that is a plain load (a pure index remap), else from a copy packed into
        scratch by a loop nest that evaluates the prologue once per element."""
        t = self.graph.tensors[tensor]
        probe = self.builder.value(tensor, Index(t.shape, flat=var(self.name("probe"), max(t.numel, 1))))
        if probe.op == "load":
            return lambda index: self.builder.value(tensor, index)
        name = self.scratch(t.dtype, t.numel)
        q = self.var("q", t.numel)
        store = ir.Store(name, q, self.builder.value(tensor, Index(t.shape, flat=q)))
        self.stage(f"pack {tensor} for {self.op.id}",
                   [ir.Loop(q, iconst(0), iconst(t.numel), [store], parallel=1, simd=True,
                            grain="chunks")], t.numel)
        return lambda index: load(name, t.dtype, index.flat)

    # names and memory
    def var(self, prefix: str, extent: int, lo: int = 0) -> Expr:
        return var(self.low.names(prefix), extent, lo)

    def name(self, prefix: str) -> str:
        return self.low.names(prefix)

    def scratch(self, dtype: str, numel: int) -> str:
        return self.low.scratch(self.low.names("s"), dtype, numel)

    def derived(self, array: np.ndarray) -> str:
        return self.low.derived_constant(array)

    def stage(self, comment: str, body: list[ir.Stmt], work: int) -> None:
        self.low.add_stage(comment, body, work)

    def attach_info(self) -> None:
        """Attach the schedule details recorded so far to the last stage added (the lowering
        adds its anchor's details to its last stage; one that adds stages after a contraction
        calls this first, so the GEMM's details stay with the GEMM's stage)."""
        if self.info:
            self.low.stage_info[-1].update(self.info)
            self.info.clear()

    # results
    def results(self, values: dict[int, tuple[Index, Expr]]) -> list[ir.Stmt]:
        """Statements that take the op's result elements (output position → index, value): store
        the materialised ones and compute the fused epilogue tensors from them."""
        stmts: list[ir.Stmt] = []
        provided: dict[str, Provided] = {}
        for pos, (index, value) in values.items():
            t = self.graph.tensors[self.op.outputs[pos]]
            held = local(self.low.names("x"), t.dtype)
            stmts.append(ir.Let(held, value))
            provided[t.id] = Provided(index.flat, held)
            if t.id in self.low.must_store:
                stmts.append(ir.Store(t.id, index.flat, held))
        builder = self.low.builder(provided)
        for pos, (index, _) in values.items():
            for target, path in self.fused.get(self.op.outputs[pos], []):
                target_index = forward_index(self.graph, path, index)
                try:
                    value = builder.value(target, target_index)
                except (NotFusable, NeedsBuffer):
                    raise Refused(self.op.id, target) from None
                stmts.append(ir.Store(target, target_index.flat, value))
        return stmts


# ---------------------------------------------------------------------------------------------
# Row stages (reductions and normalisations sharing rows)

@dataclass(frozen=True)
class RowView:
    """A row op's input seen as `shape` (same element order as the tensor) with `axes` reduced."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]

    @property
    def outer_shape(self) -> tuple[int, ...]:
        return tuple(n for i, n in enumerate(self.shape) if i not in self.axes)

    @property
    def reduced_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[i] for i in self.axes)

    @property
    def outer(self) -> int:
        return math.prod(self.outer_shape)

    @property
    def reduced(self) -> int:
        return math.prod(self.reduced_shape)

    def index(self, o: Expr, r: Expr) -> Index:
        """The view element of row `o`, position `r` within the row."""
        n = len(self.shape)
        if self.axes == tuple(range(n - len(self.axes), n)):
            return Index(self.shape, flat=add(mul(o, self.reduced), r))
        outer = iter(Index(self.outer_shape, flat=o).dims)
        inner = iter(Index(self.reduced_shape, flat=r).dims)
        return Index(self.shape, dims=[next(inner) if i in self.axes else next(outer)
                                       for i in range(n)])


class Point:
    """A position (row o, element r) inside a row stage, with a builder that sees the row
    stage's results at that position."""

    def __init__(self, stage: RowPhases, r: Expr):
        self.stage = stage
        self.o = stage.o
        self.r = r
        provided = dict(stage.reduced)
        for tensor, fn in stage.rowvals.items():
            t = stage.low.graph.tensors[tensor]
            provided[tensor] = Provided(self.view_index(stage.views[tensor]).reshaped(t.shape).flat,
                                        (lambda f=fn: f(self)))
        self.builder = stage.low.builder(provided)

    def view_index(self, view: RowView) -> Index:
        return view.index(self.o, self.r)


class RowCtx(OpAccess):
    """What a row op's lowering sees: its view, reductions as phases, results per row/element."""

    def __init__(self, stage: RowPhases, op: Op, view: RowView):
        self.stage = stage
        self.op = op
        self.view = view
        self.graph = stage.low.graph

    def out(self, i: int = 0) -> Tensor:
        return self.graph.tensors[self.op.outputs[i]]

    def input(self, i: int, point: Point) -> Expr:
        """Input `i` (of the view's element count) at the point."""
        t = self.tensor(i)
        return point.builder.value(t.id, point.view_index(self.view).reshaped(t.shape))

    def value(self, i: int, point: Point, index: Index) -> Expr:
        return point.builder.value(self.op.inputs[i], index)

    def reduce(self, kind: str, dtype: str, body: Callable[[Point], Expr],
               select_last: bool = False) -> Expr:
        return self.stage.add_phase(kind, dtype, body, select_last)

    def reduce_kept(self, kind: str, dtype: str, body: Callable[[Point], Expr]
                    ) -> tuple[Expr, Callable[[Point], Expr]]:
        """A reduction whose element values later phases read again: kept in a stack array of
        the row (rows up to MAX_KEPT_ROW elements; longer rows recompute them)."""
        if self.view.reduced > MAX_KEPT_ROW:
            return self.reduce(kind, dtype, body), body
        row = self.stage.low.names("row")
        result = self.stage.add_phase(kind, dtype, body, False, keep=row)
        return result, lambda p: array_load(row, dtype, p.r)

    def keep_input(self, i: int) -> bool:
        """Is input i computed in the block by an expression worth keeping per row (a
        transcendental call) rather than recomputing in later phases?"""
        tensor = self.op.inputs[i]
        producer = self.stage.low.producer.get(tensor)
        if producer is None or tensor in self.stage.low.ready:
            return False
        probe = Point(self.stage, var(self.stage.low.names("probe"), max(self.view.reduced, 1)))
        try:
            value = self.input(i, probe)
        except (NotFusable, NeedsBuffer):
            return False
        return any(e.op == "call" for e in walk([value]))

    def share_row(self, i: int, values: Callable[[Point], Expr]) -> None:
        """Later phases and the epilogue read input i at their element from `values`."""
        tensor = self.op.inputs[i]
        self.stage.rowvals[tensor] = values
        self.stage.views[tensor] = self.view

    def row_output(self, pos: int, fn: Callable[[Point], Expr]) -> None:
        self.stage.rowvals[self.op.outputs[pos]] = fn
        self.stage.views[self.op.outputs[pos]] = self.view

    def reduced_output(self, pos: int, value: Expr) -> None:
        tensor = self.op.outputs[pos]
        self.stage.reduced[tensor] = Provided(self.stage.o, value)
