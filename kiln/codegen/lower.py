"""Block → loop-nest IR: DNNFusion's data-flow-tree code generation (§4.4.1).

Every tensor of a block is either *materialised* (written to a buffer: the block's outputs, and
intermediates a later stage must read) or *inlined*: its element is an expression of its producer's
inputs at mapped indices, built on demand by walking the data-flow tree from the element a stage
needs (`Builder.value`). Data-movement ops inside a block are therefore index remaps, never copies
(§4.4.2), and a shared sub-tree is built once (interned expressions).

A kernel is a sequence of stages:

* an *anchor stage* per Many-to-Many op (MatMul, Conv, pooling, ...): its operands are read
  through the inlined prologue, and every materialised tensor that depends on the anchor's result
  element by element — through elementwise ops, broadcasts of other inputs, Reshape or Transpose —
  is computed from the result before it is stored (the epilogue);
* a *row stage* per group of reductions/normalisations over the same rows: one parallel loop over
  rows running each reduction as a phase, then the elementwise epilogue over the row — the
  two-phase reduction of Souffle, and the multi-phase "row blocks" of decomposed LayerNorm/Softmax;
* *elementwise stages* for materialised tensors no anchor or row stage can produce, one loop nest
  per output shape.

Whether a tensor can be produced inside a stage is decided by trying: the builder raises
`NotFusable` when an expression would read a stage's result at a different element than the one the
stage holds, and `NeedsBuffer` when it would need a Many-to-Many result that no earlier stage
stored. The block lowering then materialises that tensor and starts over; correctness never rests
on a pattern match.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    Expr,
    add,
    array_load,
    const,
    iconst,
    load,
    local,
    mul,
    var,
    walk,
)
from kiln.codegen.indexing import Index
from kiln.codegen.ops import lowering
from kiln.codegen.passes import finish_stage
from kiln.codegen.reduction import reduction_phase
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op, Tensor
from kiln.plan import Block

SCRATCH_ALIGN = 64
MAX_ATTEMPTS = 256
RENAMED_PREFIXES = {"t": "tt", "v": "vv"}  # t12 is a tensor id, v3 an emitter temporary
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


class Names:
    """Fresh C identifiers for one kernel: v, o, r, acc, ... with counters. Tensor ids (t12) and
    temporaries (v3) have their own prefixes, so generated names never take "t" or "v"."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        prefix = RENAMED_PREFIXES.get(prefix, prefix)
        n = self.counts.get(prefix, 0)
        self.counts[prefix] = n + 1
        return f"{prefix}{n}"


# ---------------------------------------------------------------------------------------------
# The data-flow-tree walk

class Builder:
    """Element expressions of a block's tensors inside one stage."""

    def __init__(self, low: BlockLowering, provided: dict[str, Provided] | None = None):
        self.low = low
        self.provided = provided or {}
        self.memo: dict[tuple[str, Expr], Expr] = {}

    def value(self, tensor: str, index: Index) -> Expr:
        t = self.low.graph.tensors[tensor]
        assert index.shape == t.shape, (tensor, index.shape, t.shape)
        key = (tensor, index.flat)
        found = self.memo.get(key)
        if found is None:
            found = self._value(t, index)
            self.memo[key] = found
        return found

    def _value(self, t: Tensor, index: Index) -> Expr:
        held = self.provided.get(t.id)
        if held is not None:
            if index.flat is not held.flat:
                raise NotFusable(t.id)
            return held.get()
        if t.is_constant:
            return self.low.constant_value(t, index)
        if t.id in self.low.ready:
            return load(t.id, t.dtype, index.flat)
        op = self.low.producer.get(t.id)
        if op is None:
            raise AssertionError(f"tensor {t.id} has no producer in the block and no buffer")
        lw = lowering(op.op_type)
        if lw.kind == "inline":
            return lw.lower(InlineCtx(self, op, op.outputs.index(t.id)), index)
        raise NeedsBuffer(t.id)


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

    def __init__(self, builder: Builder, op: Op, position: int):
        self.builder = builder
        self.op = op
        self.position = position
        self.graph = builder.low.graph

    def input(self, i: int, index: Index) -> Expr:
        return self.builder.value(self.op.inputs[i], index)

    def derived(self, array: np.ndarray) -> str:
        """A compile-time table the expression may load (a derived constant of the kernel)."""
        return self.builder.low.derived_constant(array)

    @property
    def out(self) -> Tensor:
        return self.graph.tensors[self.op.outputs[self.position]]


# ---------------------------------------------------------------------------------------------
# Stage contexts

class StageCtx(OpAccess):
    """What an anchor's lowering sees: operands, fresh names, scratch, and the epilogue."""

    def __init__(self, low: BlockLowering, op: Op, fused: dict[str, list[tuple[str, Path]]]):
        self.low = low
        self.op = op
        self.fused = fused
        self.graph = low.graph
        self.schedule = low.schedule
        self.builder = Builder(low)
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
                            omp_schedule="chunked")], t.numel)
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
        builder = Builder(self.low, provided)
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
# Forward index maps along a path of ops (for epilogues)

Path = list[tuple[Op, str]]  # (op, the output followed)


def find_path(graph: Graph, members: set[str], source: str, target: str) -> Path | None:
    """Ops of the block leading from tensor `source` to tensor `target` (breadth-first)."""
    frontier: list[tuple[str, Path]] = [(source, [])]
    seen = {source}
    while frontier:
        nxt = []
        for tensor, path in frontier:
            for op in graph.consumers(tensor):
                if op.id not in members:
                    continue
                for out in op.outputs:
                    if out in seen:
                        continue
                    seen.add(out)
                    if out == target:
                        return path + [(op, out)]
                    nxt.append((out, path + [(op, out)]))
        frontier = nxt
    return None


def forward_index(graph: Graph, path: Path, index: Index) -> Index | None:
    """The element of the path's last tensor that element `index` of its first tensor becomes.

    Exact for element-order-preserving ops (flat offset kept), Transpose (permutation) and ops
    whose output has the shape of the followed input; None past an op that changes the element
    count (a broadcast: one result element feeds many). The builder verifies the result.
    """
    current = index
    for op, out in path:
        out_shape = graph.tensors[out].shape
        if op.op_type == "Transpose":
            perm = op.attrs.get("perm") or list(reversed(range(len(current.shape))))
            current = Index(out_shape, dims=[current.dims[p] for p in perm])
        elif math.prod(out_shape) == math.prod(current.shape):
            current = current.reshaped(out_shape)
        else:
            return None
    return current


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

    def __init__(self, stage: RowStage, r: Expr):
        self.stage = stage
        self.o = stage.o
        self.r = r
        provided = dict(stage.reduced)
        for tensor, fn in stage.rowvals.items():
            t = stage.low.graph.tensors[tensor]
            provided[tensor] = Provided(self.view_index(stage.views[tensor]).reshaped(t.shape).flat,
                                        (lambda f=fn: f(self)))
        self.builder = Builder(stage.low, provided)

    def view_index(self, view: RowView) -> Index:
        return view.index(self.o, self.r)


class RowCtx(OpAccess):
    """What a row op's lowering sees: its view, reductions as phases, results per row/element."""

    def __init__(self, stage: RowStage, op: Op, view: RowView):
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


class RowStage:
    def __init__(self, low: BlockLowering, op: Op):
        self.low = low
        self.view: RowView = lowering(op.op_type).view(op, low.graph)
        self.o = var(low.names("o"), self.view.outer)
        self.body: list[ir.Stmt] = []
        self.reduced: dict[str, Provided] = {}
        self.rowvals: dict[str, Callable[[Point], Expr]] = {}
        self.views: dict[str, RowView] = {}
        self.ops: list[Op] = []
        self.phases = 0
        self._lower(op, self.view)

    def _lower(self, op: Op, view: RowView) -> None:
        lowering(op.op_type).lower(RowCtx(self, op, view))
        self.ops.append(op)

    def try_merge(self, op: Op) -> bool:
        view = lowering(op.op_type).view(op, self.low.graph)
        if (view.outer, view.reduced) != (self.view.outer, self.view.reduced):
            return False
        saved = (list(self.body), dict(self.reduced), dict(self.rowvals), dict(self.views),
                 self.phases)
        try:
            self._lower(op, view)
        except (NotFusable, NeedsBuffer):
            self.body, self.reduced, self.rowvals, self.views, self.phases = saved
            return False
        return True

    def add_phase(self, kind: str, dtype: str, body: Callable[[Point], Expr],
                  select_last: bool, keep: str | None = None) -> Expr:
        if keep is not None:
            self.body.append(ir.DeclArray(keep, dtype, self.view.reduced))
        stmts, result = reduction_phase(self.low.names, self.view.reduced,
                                        lambda r: Point(self, r), kind, dtype, body, select_last,
                                        keep)
        self.body.extend(stmts)
        self.phases += 1
        return result

    def close(self) -> None:
        low = self.low
        r = var(low.names("r"), self.view.reduced)
        point = Point(self, r)
        row_stores: list[ir.Stmt] = []
        row_stmts: list[ir.Stmt] = []
        for tensor in self.rowvals:
            if tensor in low.must_store:
                t = low.graph.tensors[tensor]
                index = point.view_index(self.views[tensor]).reshaped(t.shape)
                row_stores.append(ir.Store(tensor, index.flat, point.builder.value(tensor, index)))
                low.assigned.add(tensor)
        for tensor, held in self.reduced.items():
            if tensor in low.must_store:
                row_stmts.append(ir.Store(tensor, self.o, held.get()))
                low.assigned.add(tensor)
        for tensor in low.candidates():
            t = low.graph.tensors[tensor]
            if t.numel == self.view.outer * self.view.reduced:
                index, builder, target = point.view_index(self.view).reshaped(t.shape), point.builder, row_stores
            elif t.numel == self.view.outer:
                index, builder, target = Index(t.shape, flat=self.o), Point(self, iconst(0)).builder, row_stmts
            else:
                continue
            stmt = _try_store(builder, tensor, index)
            if stmt is not None:
                target.append(stmt)
                low.assigned.add(tensor)
        body = self.body + row_stmts
        if row_stores:
            body.append(ir.Loop(r, iconst(0), iconst(self.view.reduced), row_stores, simd=True))
        loop = ir.Loop(self.o, iconst(0), iconst(self.view.outer), body, parallel=1,
                       omp_schedule="chunked")
        kinds = "+".join(dict.fromkeys(op.op_type for op in self.ops))
        work = self.view.outer * self.view.reduced * (self.phases + 1)
        low.add_stage(f"row stage: {kinds} ({', '.join(op.id for op in self.ops)})", [loop], work)


def _try_store(builder: Builder, tensor: str, index: Index) -> ir.Stmt | None:
    """The store of `tensor` at `index` computed by `builder`, or None if it cannot be."""
    try:
        return ir.Store(tensor, index.flat, builder.value(tensor, index))
    except (NotFusable, NeedsBuffer):
        return None


# ---------------------------------------------------------------------------------------------
# The block

@dataclass
class LoweredBlock:
    kernel: ir.KernelIR
    inputs: list[str]
    outputs: list[str]
    derived: dict[str, np.ndarray]
    stage_info: list[dict]


class BlockLowering:
    def __init__(self, graph: Graph, block: Block, symbol: str, schedule: Schedule):
        self.graph = graph
        self.block = block
        self.symbol = symbol
        self.schedule = schedule
        self.ops = [graph.op_by_id[i] for i in block.op_ids]
        self.members = set(block.op_ids)
        self.producer = {t: op for op in self.ops for t in op.outputs}
        self.must_store: set[str] = set(block.outputs)
        self.refused: set[tuple[str, str]] = set()  # (anchor op, tensor) epilogues that failed

    def lower(self) -> LoweredBlock:
        for _ in range(MAX_ATTEMPTS):
            try:
                return self._attempt()
            except NeedsBuffer as need:
                if need.tensor in self.must_store:
                    raise AssertionError(f"{need.tensor} is stored yet still needed") from None
                self.must_store.add(need.tensor)
            except Refused as refused:
                self.refused.add(refused.pair)
        raise AssertionError(f"block {self.block.id}: lowering did not converge")

    # --- one attempt with a fixed set of materialised tensors ----------------------------------
    def _attempt(self) -> LoweredBlock:
        self.names = Names()
        self.ready: set[str] = {t for t in self.block.inputs
                                if not self.graph.tensors[t].is_constant}
        self.assigned: set[str] = set()
        self.stages: list[ir.Stage] = []
        self.stage_info: list[dict] = []
        self.scratch_buffers: list[ir.Buffer] = []
        self.scratch_top = 0
        self.derived: dict[str, np.ndarray] = {}
        open_row: RowStage | None = None
        pending: list[str] = []
        for op in self.ops:
            kind = lowering(op.op_type).kind
            if kind == "inline":
                pending += [t for t in op.outputs if t in self.must_store]
                continue
            if kind == "row" and open_row is not None and open_row.try_merge(op):
                continue
            self._close(open_row, pending)
            open_row, pending = None, []
            if kind == "row":
                open_row = RowStage(self, op)
            else:
                self._anchor(op)
        self._close(open_row, pending)
        return self._result()

    def _close(self, open_row: RowStage | None, pending: list[str]) -> None:
        if open_row is not None:
            open_row.close()
            self._mark_ready()
        remaining = [t for t in pending if t not in self.assigned]
        for shape in dict.fromkeys(self.graph.tensors[t].shape for t in remaining):
            self._elementwise([t for t in remaining if self.graph.tensors[t].shape == shape])

    def _mark_ready(self) -> None:
        self.ready |= self.assigned

    def _anchor(self, op: Op) -> None:
        fused = self._epilogue_candidates(op)
        ctx = StageCtx(self, op, fused)
        lowering(op.op_type).lower(ctx)
        ctx.attach_info()
        self.assigned |= {t for t in op.outputs if t in self.must_store}
        self._mark_ready()

    def _epilogue_candidates(self, op: Op) -> dict[str, list[tuple[str, Path]]]:
        fused: dict[str, list[tuple[str, Path]]] = {}
        for tensor in op.outputs:
            t = self.graph.tensors[tensor]
            held = local(self.names("trial"), t.dtype)
            index = Index(t.shape, flat=var(self.names("trial"), max(t.numel, 1)))
            for target in self.candidates():
                if (op.id, target) in self.refused:
                    continue
                path = find_path(self.graph, self.members, tensor, target)
                if path is None:
                    continue
                target_index = forward_index(self.graph, path, index)
                if target_index is None:
                    continue
                builder = Builder(self, {tensor: Provided(index.flat, held)})
                try:
                    builder.value(target, target_index)
                except (NotFusable, NeedsBuffer):
                    continue
                fused.setdefault(tensor, []).append((target, path))
                self.assigned.add(target)
        return fused

    def candidates(self) -> list[str]:
        """Materialised tensors of inline ops that no stage produces yet (block order)."""
        return [t for op in self.ops if lowering(op.op_type).kind == "inline"
                for t in op.outputs if t in self.must_store and t not in self.assigned]

    def _elementwise(self, tensors: list[str]) -> None:
        shape = self.graph.tensors[tensors[0]].shape
        numel = math.prod(shape)
        self.assigned.update(tensors)
        if numel == 0:
            self._mark_ready()
            return
        i = var(self.names("i"), numel)
        builder = Builder(self)
        stores = [ir.Store(t, i, builder.value(t, Index(shape, flat=i))) for t in tensors]
        loop = ir.Loop(i, iconst(0), iconst(numel), stores, parallel=1, simd=True,
                       omp_schedule="chunked")
        self.add_stage(f"elementwise: {', '.join(tensors)}", [loop], numel)
        self._mark_ready()

    # --- services for stages -------------------------------------------------------------------
    def add_stage(self, comment: str, body: list[ir.Stmt], work: int) -> None:
        finish_stage(body, work, self.schedule, self.names)
        self.stages.append(ir.Stage(comment, body))
        self.stage_info.append({"stage": comment.split(":")[0]})

    def is_used(self, tensor: str) -> bool:
        return tensor in self.must_store or any(
            c.id in self.members for c in self.graph.consumers(tensor))

    def constant_value(self, t: Tensor, index: Index) -> Expr:
        flat = t.data.reshape(-1)
        if flat.size == 1:
            return const(flat[0], t.dtype)
        if index.flat.is_const:
            return const(flat[index.flat.value], t.dtype)
        return load(t.id, t.dtype, index.flat)

    def scratch(self, name: str, dtype: str, numel: int) -> str:
        offset = -(-self.scratch_top // SCRATCH_ALIGN) * SCRATCH_ALIGN
        self.scratch_buffers.append(ir.Buffer(name, dtype, "scratch", offset))
        self.scratch_top = offset + numel * np.dtype(dtype).itemsize
        return name

    def derived_constant(self, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        for name, known in self.derived.items():
            if known.dtype == array.dtype and known.shape == array.shape and np.array_equal(
                    known, array):
                return name
        name = f"{self.symbol.split('_')[0]}_d{len(self.derived)}"
        self.derived[name] = array
        return name

    # --- assembling the kernel -----------------------------------------------------------------
    def _result(self) -> LoweredBlock:
        for tensor in sorted(self.must_store - set(self.block.outputs), key=_tensor_order):
            t = self.graph.tensors[tensor]
            self.scratch(tensor, t.dtype, t.numel)
        loaded = {e.name for stage in self.stages for e in walk(ir.all_exprs(stage.body))
                  if e.op == "load"}
        loaded |= {name for stage in self.stages for s in ir.iter_stmts(stage.body)
                   if isinstance(s, ir.MicroKernelCall) for name in (s.a, s.b)}
        inputs = [t for t in self.block.inputs if t in loaded]
        derived = [d for d in self.derived if d in loaded]
        outputs = list(self.block.outputs)
        buffers = ([ir.Buffer(t, self.graph.tensors[t].dtype, "input") for t in inputs]
                   + [ir.Buffer(d, self.derived[d].dtype.name, "input") for d in derived]
                   + [ir.Buffer(t, self.graph.tensors[t].dtype, "output") for t in outputs]
                   + self.scratch_buffers)
        scratch = -(-self.scratch_top // SCRATCH_ALIGN) * SCRATCH_ALIGN
        kernel = ir.KernelIR(self.symbol, buffers, self.stages, scratch)
        return LoweredBlock(kernel, inputs + derived, outputs,
                            {d: self.derived[d] for d in derived}, self.stage_info)


def _tensor_order(tensor: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", tensor)
    return (int(digits) if digits else 0, tensor)
