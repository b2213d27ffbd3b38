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

What an op's lowering sees of all this is the API in `kiln.codegen.contexts`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import (
    InlineCtx,
    NeedsBuffer,
    NotFusable,
    Point,
    Provided,
    Refused,
    RowCtx,
    RowView,
    StageCtx,
)
from kiln.codegen.epilogue import Path, find_path, forward_index
from kiln.codegen.expr import Expr, const, iconst, load, local, var, walk
from kiln.codegen import intensive
from kiln.codegen.columns import (
    column_chunks,
    column_elementwise,
    column_row_stage,
    rows_across_lanes,
)
from kiln.codegen.indexing import Index
from kiln.codegen.ops import fused_attention as attention
from kiln.codegen.ops import lowering
from kiln.codegen.passes import finish_stage
from kiln.codegen.reduction import reduction_phase
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op, Tensor
from kiln.placement import place
from kiln.plan import Block
from kiln.plan.chains import AttentionChain, chain_from

SCRATCH_ALIGN = 64
MAX_ATTEMPTS = 256
RENAMED_PREFIXES = {"t": "tt", "v": "vv"}  # t12 is a tensor id, v3 an emitter temporary


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
            return lw.lower(InlineCtx(self, self.low, op, op.outputs.index(t.id)), index)
        raise NeedsBuffer(t.id)



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
        chunks = column_chunks(low.schedule)
        loop = column_row_stage(low.names, chunks, self.view, self.o, body) if chunks else None
        if loop is None and not chunks and low.schedule.gemm_work_group == 0:  # (a CPU's)
            loop = rows_across_lanes(low.names, self.view.outer, self.o, body)
        if loop is None:
            loop = ir.Loop(self.o, iconst(0), iconst(self.view.outer), body, parallel=1,
                           grain="chunks")
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
        pairs = self._intensive_pairs()
        chains = self._attention_chains()
        skipped = ({pair.up.id for pair in pairs.values()}  # computed tile by tile in its pair
                   | {op_id for chain in chains.values() for op_id in chain.op_ids[:-1]})
        for op in self.ops:
            if op.id in skipped:
                continue
            kind = lowering(op.op_type).kind
            if op.id in chains:
                self._close(open_row, pending)
                open_row, pending = None, []
                chain = chains[op.id]
                self._anchor(op, lambda ctx: attention.fused_attention(ctx, chain))
                continue
            if kind == "inline":
                pending += [t for t in op.outputs if t in self.must_store]
                continue
            if kind == "row" and open_row is not None and open_row.try_merge(op):
                continue
            self._close(open_row, pending)
            open_row, pending = None, []
            if kind == "row":
                open_row = RowStage(self, op)
            elif op.id in pairs:
                self._intensive(pairs[op.id])
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

    def _attention_chains(self) -> dict[str, AttentionChain]:
        """The block's attention chains that run as one fused stage, by their last op: whole in
        the block, their intermediate results needed by nothing else, and not refused before."""
        chains: dict[str, AttentionChain] = {}
        taken: set[str] = set()
        for op in self.ops:
            chain = chain_from(self.graph, op)
            if (chain is None or not set(chain.op_ids) <= self.members - taken
                    or (chain.weighted, attention.REFUSAL) in self.refused
                    or any(t in self.must_store for i in chain.op_ids[:-1]
                           for t in self.graph.op_by_id[i].outputs)
                    or attention.check(self.graph, chain, self.schedule) is not None):
                continue
            chains[chain.weighted] = chain
            taken |= set(chain.op_ids)
        return chains

    def _anchor(self, op: Op, lower: Callable[[StageCtx], None] | None = None) -> None:
        fused = self._epilogue_candidates(op)
        ctx = StageCtx(self, op, fused)
        (lower or lowering(op.op_type).lower)(ctx)
        ctx.attach_info()
        self.assigned |= {t for t in op.outputs if t in self.must_store}
        self._mark_ready()

    def _intensive_pairs(self) -> dict[str, intensive.Pair]:
        """AGO's intensive-fusion pairs of the block whose tiles fit the schedule's budget (a
        tensor a later attempt must store ends its pair: `find_pairs` skips kept tensors)."""
        if not self.schedule.intensive_fusion:
            return {}
        uk = intensive.tile_shape(self.schedule)
        found = intensive.find_pairs(self.graph, self.ops, self.must_store,
                                     set(self.graph.outputs))
        return {down: pair for down, pair in found.items()
                if (down, pair.up.outputs[0]) not in self.refused
                and intensive.fits(pair, self.graph, self.schedule.intensive_tile_bytes, *uk)}

    def _intensive(self, pair: intensive.Pair) -> None:
        """The pair's fused stage; if the ops between cannot be computed from the tile at the
        element it holds (`NotFusable`), the pair is refused and the block lowered again with two
        stages."""
        ctx = StageCtx(self, pair.down, self._epilogue_candidates(pair.down))
        try:
            intensive.lower_pair(ctx, StageCtx(self, pair.up, {}), pair)
        except NotFusable:
            raise Refused(pair.down.id, pair.up.outputs[0]) from None
        ctx.attach_info()
        self.assigned |= {t for t in pair.down.outputs if t in self.must_store}
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
        builder = Builder(self)

        def stores_at(i: Expr) -> list[ir.Stmt]:
            return [ir.Store(t, i, builder.value(t, Index(shape, flat=i))) for t in tensors]

        chunks = column_chunks(self.schedule)
        loop = column_elementwise(self.names, chunks, numel, stores_at) if chunks else None
        if loop is None:
            i = var(self.names("i"), numel)
            loop = ir.Loop(i, iconst(0), iconst(numel), stores_at(i), parallel=1, simd=True,
                           grain="chunks")
        self.add_stage(f"elementwise: {', '.join(tensors)}", [loop], numel)
        self._mark_ready()

    # --- services for stages -------------------------------------------------------------------
    def add_stage(self, comment: str, body: list[ir.Stmt], work: int) -> None:
        finish_stage(body, work, self.schedule, self.names)
        self.stages.append(ir.Stage(comment, body))
        self.stage_info.append({"stage": comment.split(":")[0]})

    def builder(self, provided: dict[str, Provided] | None = None) -> Builder:
        return Builder(self, provided)

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
    def _place_intermediates(self) -> None:
        """Scratch space for the block's materialised intermediates, reused by liveness
        (FusionStitching §5.1.3): each lives from the first stage that touches it to the last, and
        one whose life has ended gives its bytes to a later one, so a stitched kernel's scratch
        stays as small, and as likely to stay in cache, as its widest point in time."""
        tensors = sorted(self.must_store - set(self.block.outputs), key=_tensor_order)
        if not tensors:
            return
        stages = _stages_touching(self.stages, set(tensors))
        base = -(-self.scratch_top // SCRATCH_ALIGN) * SCRATCH_ALIGN
        placed = place((t, self.graph.tensors[t].nbytes, min(stages.get(t, [0])),
                        max(stages.get(t, [0]))) for t in tensors)
        offsets = {b.tensor: base + b.offset for b in placed}
        for t in tensors:
            self.scratch_buffers.append(ir.Buffer(t, self.graph.tensors[t].dtype, "scratch",
                                                  offsets[t]))
        self.scratch_top = max((b.offset + b.nbytes for b in placed), default=0) + base

    def _result(self) -> LoweredBlock:
        self._place_intermediates()
        loaded = {e.name for stage in self.stages for e in walk(ir.all_exprs(stage.body))
                  if e.op == "load"}
        loaded |= {name for stage in self.stages for s in ir.iter_stmts(stage.body)
                   if isinstance(s, (ir.MicroKernelCall, ir.Transpose)) for name in s.buffers}
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


def _stages_touching(stages: list[ir.Stage], names: set[str]) -> dict[str, list[int]]:
    """For each buffer of `names`, the indices of the stages that load, store or multiply it."""
    found: dict[str, list[int]] = {}
    for index, stage in enumerate(stages):
        seen = {e.name for e in walk(ir.all_exprs(stage.body)) if e.op == "load"}
        for stmt in ir.iter_stmts(stage.body):
            if isinstance(stmt, ir.Store):
                seen.add(stmt.buffer)
            elif isinstance(stmt, (ir.MicroKernelCall, ir.Transpose)):
                seen.update(stmt.buffers)
        for name in seen & names:
            found.setdefault(name, []).append(index)
    return found


def _tensor_order(tensor: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", tensor)
    return (int(digits) if digits else 0, tensor)
