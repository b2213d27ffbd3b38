"""Partitioner `dnnfusion`: DNNFusion's seed-based fusion plan generation (§4.3, Listing 1).

Seeds are One-to-One ops, smallest intermediate result first. From a seed the block grows along
successors, then predecessors; each candidate passes Table 3's mapping check (red stops, green
fuses, yellow asks the ProfileStore whether latency(block+op) beats latency(block)+latency(op)),
a legality check (the block must not form a cycle with the rest of the graph) and the constraint
check below. When no One-to-One seed is left, the remaining ops seed blocks in order of increasing
mapping-type complexity, so that for example a MatMul still absorbs a following Reshape/Transpose.

Two red cells of Table 3 (Many-to-Many followed by Many-to-Many) are relaxed to yellow, so the
latency comparison decides them, in the cases where the paper's reason for red (the combined loop
nest thrashes registers and cache) does not hold:
  * row-local ops over the same rows: when every Many-to-Many op of the block is row-local over
    the same leading dims (a MatMul/Gemm whose B operand comes from outside the block, or a
    reduction/softmax/normalization over the trailing axes) and the other ops are elementwise on
    those rows, the kernel can run tile by tile over rows with each tile in cache: a decomposed
    LayerNorm's two ReduceMeans (Souffle's two-phase reduction), MatMul + Softmax, back-to-back
    feed-forward MatMuls (FusionStitching's stitching of row-local kernels). The B operands every
    row tile re-reads must fit `tile_operand_bytes` (the L2), or the re-reads cost more than the
    intermediate results they save;
  * stacked recurrent layers: an LSTM/GRU/RNN reading another one's output sequence (through
    views) runs in the same kernel, the sequence in scratch memory instead of a round trip; a
    block with a recurrent op holds only recurrent ops and views;
  * tiny intermediates: when every tensor passed between the block and the op fits in
    `tiny_bytes`, the kernel keeps it in a small scratch buffer (squeeze-and-excite chains:
    GlobalAveragePool → 1×1 Conv → 1×1 Conv on [1, C, 1, 1]).

Attention chains (`kiln.plan.chains`: QKᵀ → scale/bias/mask → Softmax → ·V) seed blocks before
everything else, each chain whole, then grow like any seed: the fused attention lowering runs a
chain with the scores of a row tile in L1, which no split of it can (the scores and the
probabilities would go through memory, and the second contraction would be absorbed by the block
that produces V, as a prologue). No other block may take an op of a chain.

Constraints, from the target's device limits (`kiln.target.DeviceLimits`; the figures are those
of CPU targets, 2-thread CPUs with AVX2's 16 vector registers and 1–2 MB of L2):
  * at most 16 values live at once while a block's data-flow tree is evaluated, so a vectorised
    fused loop keeps its temporaries in the 16 ymm registers instead of spilling (a GPU target:
    the registers a work-item has at full occupancy);
  * at most 16 tensors read from outside (pointer arguments and streams a loop can prefetch);
  * at most 48 ops, which bounds generated-code size and compile time;
  * tiny intermediates within half the L1 (a GPU target: half a work-group's local memory), row
    tiles' re-reads within the L2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType, Verdict, fuse_types
from kiln.ops import RowLocality, op_info
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.plan.chains import attention_chains
from kiln.profile import COST_MODEL, MEASURED, Estimate, ProfileStore
from kiln.target import Target


@dataclass(frozen=True)
class Constraints:
    max_ops: int = 48
    max_live_values: int = 16
    max_inputs: int = 16
    tiny_bytes: int = 16 * 1024  # half of a 32 KiB L1 data cache
    tile_operand_bytes: int = 1 << 20  # what every row tile re-reads must stay in a 1 MiB L2
    relax_red: bool = True
    prefer_epilogues: bool = True

    @classmethod
    def for_target(cls, target: Target) -> Constraints:
        limits = target.limits
        return cls(max_live_values=limits.registers, tiny_bytes=limits.fast_memory_bytes // 2,
                   tile_operand_bytes=limits.shared_cache_bytes)


@register_partitioner("dnnfusion")
class DNNFusion:
    name = "dnnfusion"

    def __init__(self, constraints: Constraints = Constraints()):
        self.constraints = constraints

    def for_target(self, target: Target) -> DNNFusion:
        """This partitioner with the constraints of `target`'s device."""
        return DNNFusion(Constraints.for_target(target))

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        return _Planning(graph, store, self.constraints).run(self.name)


class _Planning:
    def __init__(self, graph: Graph, store: ProfileStore, constraints: Constraints):
        self.graph = graph
        self.store = store
        self.constraints = constraints
        self.assigned: set[str] = set()
        self.groups: list[set[str]] = []
        self.group_of: dict[str, int] = {}
        self.decisions: list[Decision] = []
        self.yellow_lookups = 0
        self.yellow_basis: str | None = None  # what the last yellow comparison rested on
        self.block: set[str] = set()
        self.mapping = MappingType.ONE_TO_ONE
        self._latency: dict[tuple[frozenset[str], bool], Estimate] = {}
        self.chains = attention_chains(graph)
        self.chain_ops = {op_id for chain in self.chains for op_id in chain.op_ids}

    def run(self, name: str) -> FusionPlan:
        for chain in self.chains:
            self.seed_chain(chain.op_ids)
        while (seed := self.next_seed()) is not None:
            self.block, self.mapping = {seed.id}, seed.mapping
            if not _is_opaque(seed) or _is_recurrent(seed):
                self.grow(seed)
            self.commit()
        if self.constraints.prefer_epilogues:
            self.prefer_epilogues()
        groups = [g for g in self.groups if g]
        return build_plan(self.graph, groups, name, self.decisions, self.yellow_lookups)

    def seed_chain(self, op_ids: tuple[str, ...]) -> None:
        """An attention chain as one seed block, grown from each of its ops."""
        ops = [self.graph.op_by_id[i] for i in op_ids]
        self.block, self.mapping = {op_ids[0]}, MappingType.MANY_TO_MANY
        for op in ops[1:]:
            self.decisions.append(Decision(self.block_label(), op.id, True, "attention chain"))
            self.block.add(op.id)
        for op in ops:
            self.grow(op)
        self.commit()

    def grow(self, seed: Op) -> None:
        for successor in self.graph.successors(seed):
            self.fuse_successor(successor)
        for predecessor in self.graph.predecessors(seed):
            self.fuse_predecessor(predecessor)

    def commit(self) -> None:
        self.assigned |= self.block
        self.group_of.update((op_id, len(self.groups)) for op_id in self.block)
        self.groups.append(self.block)

    # Step 1 ------------------------------------------------------------------------------
    def next_seed(self) -> Op | None:
        unfused = [op for op in self.graph.ops if op.id not in self.assigned]
        if not unfused:
            return None
        one_to_one = [op for op in unfused
                      if op.mapping == MappingType.ONE_TO_ONE and not _is_opaque(op)]
        if one_to_one:
            return min(one_to_one, key=lambda op: (self.irs_bytes(op), self.graph.order[op.id]))
        return min(unfused, key=lambda op: (_is_opaque(op), op.mapping, self.irs_bytes(op),
                                            self.graph.order[op.id]))

    def irs_bytes(self, op: Op) -> int:
        return sum(self.graph.tensors[t].nbytes for t in op.outputs)

    # Steps 2 and 3 -----------------------------------------------------------------------
    def fuse_successor(self, successor: Op) -> None:
        crossing = [t for t in successor.present_inputs() if self.produced_in_block(t)]
        if not self.try_add(successor, fused=fuse_types(self.mapping, successor.mapping),
                            creates_cycle=self.path_outside(self.block, {successor.id}),
                            crossing=crossing):
            return
        for nxt in self.graph.successors(successor):
            self.fuse_successor(nxt)

    def fuse_predecessor(self, predecessor: Op) -> None:
        crossing = [t for t in predecessor.outputs
                    if any(c.id in self.block for c in self.graph.consumers(t))]
        if not self.try_add(predecessor, fused=fuse_types(predecessor.mapping, self.mapping),
                            creates_cycle=self.path_outside({predecessor.id}, self.block),
                            crossing=crossing):
            return
        for nxt in self.graph.predecessors(predecessor):
            self.fuse_predecessor(nxt)

    def produced_in_block(self, tensor: str) -> bool:
        producer = self.graph.producer(tensor)
        return producer is not None and producer.id in self.block

    def try_add(self, op: Op, fused: tuple[MappingType, Verdict], creates_cycle: bool,
                crossing: list[str]) -> bool:
        if op.id in self.block or op.id in self.assigned:
            return False
        if op.id in self.chain_ops:
            self.decisions.append(Decision(self.block_label(), op.id, False,
                                           "constraint: part of an attention chain"))
            return False
        mapping, verdict = fused
        relaxed = self.relaxation(op, crossing) if verdict is Verdict.RED else None
        if relaxed:
            verdict = Verdict.YELLOW
        self.yellow_basis = None
        reason = self.refusal(op, verdict, creates_cycle)
        accepted = relaxed or verdict.value
        if self.yellow_basis is not None and reason is None:
            accepted += f" ({self.yellow_basis})"
        self.decisions.append(Decision(self.block_label(), op.id, reason is None,
                                       reason or accepted))
        if reason is not None:
            return False
        self.block.add(op.id)
        self.mapping = mapping
        return True

    def relaxation(self, op: Op, crossing: list[str]) -> str | None:
        """Why a red pair may still fuse (see the module docstring), or None."""
        if not self.constraints.relax_red or (_is_opaque(op) and not _is_recurrent(op)):
            return None
        members = self.block | {op.id}
        heavy = [self.graph.op_by_id[i] for i in members
                 if self.graph.op_by_id[i].mapping == MappingType.MANY_TO_MANY]
        if all(_is_recurrent(o) for o in heavy) and self.recurrent_stack(op):
            return "yellow: stacked recurrent layers"
        spaces = {row_space(self.graph, o, members) for o in heavy}
        if (len(spaces) == 1 and None not in spaces and self.fits_rows(op, spaces.pop())
                and _tile_operand_bytes(self.graph, heavy) <= self.constraints.tile_operand_bytes):
            return "yellow: row-local ops over the same rows"
        if crossing and sum(self.graph.tensors[t].nbytes for t in crossing) <= self.constraints.tiny_bytes:
            return "yellow: tiny intermediate"
        return None

    def fits_rows(self, op: Op, rows: tuple[int, ...]) -> bool:
        """Can `op` run inside a loop over row tiles of `rows` (the leading dims of its tensors)?"""
        if op.mapping == MappingType.MANY_TO_MANY:
            return True  # row_space() already placed it
        if op.mapping not in (MappingType.ONE_TO_ONE, MappingType.ONE_TO_MANY) or op.flops == 0:
            return False
        shapes = [self.graph.tensors[t].shape for t in (*self.graph.activation_inputs(op), *op.outputs)]
        return all(shape[:len(rows)] == rows for shape in shapes)

    def recurrent_stack(self, op: Op) -> bool:
        """Would the block plus `op` be recurrent ops and views only, with a recurrent op?"""
        ops = [self.graph.op_by_id[i] for i in self.block] + [op]
        return (any(_is_recurrent(o) for o in ops)
                and all(_is_recurrent(o) or o.mapping == MappingType.REORGANIZE for o in ops))

    def refusal(self, op: Op, verdict: Verdict, creates_cycle: bool) -> str | None:
        block_recurrent = any(_is_recurrent(self.graph.op_by_id[i]) for i in self.block)
        stackable = self.constraints.relax_red and self.recurrent_stack(op)
        if (_is_opaque(op) or block_recurrent) and not stackable:
            return f"red: {op.op_type} is opaque" if _is_opaque(op) else "red: recurrent block"
        if verdict is Verdict.RED:
            return f"red: {self.mapping.label} + {op.mapping.label}"
        if creates_cycle:
            return "illegal: would create a cycle"
        violated = self.violated_constraint(self.block | {op.id})
        if violated:
            return f"constraint: {violated}"
        if verdict is Verdict.YELLOW:
            faster, self.yellow_basis = self.faster_fused(op)
            if not faster:
                return f"yellow: slower fused ({self.yellow_basis})"
        return None

    def block_label(self) -> str:
        return "+".join(sorted(self.block, key=self.graph.order.__getitem__))

    # Step 2.2: constraints ---------------------------------------------------------------
    def violated_constraint(self, members: set[str]) -> str | None:
        c = self.constraints
        if len(members) > c.max_ops:
            return f"more than {c.max_ops} ops"
        ops = sorted((self.graph.op_by_id[i] for i in members), key=lambda o: self.graph.order[o.id])
        produced = {t for op in ops for t in op.outputs}
        external = {t for op in ops for t in op.present_inputs() if t not in produced}
        if len(external) > c.max_inputs:
            return f"more than {c.max_inputs} inputs"
        if _max_live_values(self.graph, ops, members) > c.max_live_values:
            return f"more than {c.max_live_values} live values"
        return None

    # Step 2.3: yellow cases --------------------------------------------------------------
    def faster_fused(self, op: Op) -> tuple[bool, str]:
        """Is the block with `op` faster than the block and `op` apart, and on what basis.

        Estimates of one kind are compared: when the three answers do not all come from the same
        source (the tuner measured the final blocks of an earlier plan, not the fused candidate),
        all three come from the store's fallback model, so that measuring a plan's blocks does
        not by itself change the next plan of the same model. Measurements decide only when they
        are told apart by more than their spread: the fused kernel's p90 under the sum of the
        parts' p10s (faster), or its p10 over the sum of their p90s (slower). Microsecond kernels
        measured on a busy machine often overlap; a verdict drawn from their medians is noise, so
        the fallback model answers those, as it does for `kiln compile` without measurements."""
        self.yellow_lookups += 1
        parts = [self.latency(self.block | {op.id}), self.latency(self.block),
                 self.latency({op.id})]
        sources = {e.source for e in parts}
        fallback = self.store.fallback
        if fallback is None:
            return _cheaper(*parts), parts[0].source
        if len(sources) > 1:
            return _cheaper(*self.fallback_parts(op)), f"{COST_MODEL}: sources differ"
        together, block, alone = parts
        if together.source == MEASURED:
            if together.high <= block.low + alone.low:
                return True, MEASURED
            if together.low >= block.high + alone.high:
                return False, MEASURED
            return _cheaper(*self.fallback_parts(op)), f"{COST_MODEL}: measurements within noise"
        return _cheaper(*parts), together.source

    def fallback_parts(self, op: Op) -> list[Estimate]:
        fallback = self.store.fallback
        return [self.latency(self.block | {op.id}, fallback), self.latency(self.block, fallback),
                self.latency({op.id}, fallback)]

    def latency(self, members: Iterable[str], store: ProfileStore | None = None) -> Estimate:
        key = (frozenset(members), store is not None)
        if key not in self._latency:
            ordered = sorted(key[0], key=self.graph.order.__getitem__)
            self._latency[key] = (store or self.store).latency(self.graph, ordered)
        return self._latency[key]

    # Step 4: epilogues rather than prologues ----------------------------------------------
    def prefer_epilogues(self) -> None:
        """Moves elementwise ops that a block applies to a contraction's result as it reads them
        (a prologue) into the contraction's block (an epilogue). Seeds grow successors first, so
        a Clip between two convolutions ends up in front of the second; there it is evaluated
        once per use (a 3×3 convolution uses each input nine times, and a 1×1 convolution must
        copy an input it would otherwise read in place), at the end of the first once per
        element, in registers. Any mapping type followed by One-to-One is green in Table 3.
        Reorganize ops (Reshape, Flatten, Squeeze, Unsqueeze) between the contraction and the
        activation move with it: they keep the elements' order, so at either end they are an
        index remap (§4.4), and left in front they keep the activation a prologue (GPT-2's
        Gemm → Reshape → GELU → Reshape → Gemm packed the second Gemm's A with GELU per call)."""
        moved = True
        while moved:
            moved = any(self.move_prologue(group, target, ops)
                        for group in range(len(self.groups))
                        for target, ops in self.prologues(group).items())

    def prologues(self, group: int) -> dict[int, list[Op]]:
        """By target block: the One-to-One and Reorganize ops of `group` that read only results
        of other blocks (or of each other, and constants), at least one of them a contraction's
        block, which becomes the target (the latest such, for a residual Add of two convolutions'
        results); views only where they carry an activation (`carried`). The other blocks read
        must not depend on the target."""
        graph, found = self.graph, {}
        target_of: dict[str, int] = {}
        members = sorted(self.groups[group], key=graph.order.__getitem__)
        for op in (graph.op_by_id[i] for i in members):
            if op.mapping not in _MOVABLE or _is_opaque(op):
                continue
            producers = [p for p in map(graph.producer, graph.activation_inputs(op)) if p is not None]
            sources = {target_of.get(p.id, self.group_of[p.id]) for p in producers}
            chained = {target_of[p.id] for p in producers if p.id in target_of}
            if group in sources or len(chained) > 1:
                continue
            if chained:
                target = chained.pop()
            else:
                heavy = [p for p in producers if self.is_contraction_block(self.group_of[p.id])]
                if not heavy:
                    continue
                target = self.group_of[max(heavy, key=lambda p: graph.order[p.id]).id]
            if self.reaches(target, sources - {target}):
                continue
            target_of[op.id] = target
            found.setdefault(target, []).append(op)
        carried = {target: self.carried(ops) for target, ops in found.items()}
        return {target: ops for target, ops in carried.items() if ops}

    def carried(self, ops: list[Op]) -> list[Op]:
        """`ops` (in graph order) less the Reorganize ops no One-to-One op of them reads, directly
        or through other views: a view left after the activation stays with its reader."""
        kept: list[Op] = []
        read: set[str] = set()
        for op in reversed(ops):
            if op.mapping == MappingType.ONE_TO_ONE or any(t in read for t in op.outputs):
                kept.append(op)
                read.update(self.graph.activation_inputs(op))
        return kept[::-1]

    def reaches(self, group: int, others: set[int]) -> bool:
        """Does any op of `others` depend on an op of `group`?"""
        if not others:
            return False
        graph, seen = self.graph, set(self.groups[group])
        stack = list(seen)
        while stack:
            for nxt in graph.successors(graph.op_by_id[stack.pop()]):
                if nxt.id not in seen:
                    if self.group_of[nxt.id] in others:
                        return True
                    seen.add(nxt.id)
                    stack.append(nxt.id)
        return False

    def is_contraction_block(self, group: int) -> bool:
        ops = [self.graph.op_by_id[i] for i in self.groups[group]]
        heavy = [op for op in ops if op.mapping == MappingType.MANY_TO_MANY]
        return (len(heavy) == 1 and heavy[0].compute_intensive
                and not any(_is_opaque(op) for op in ops))

    def move_prologue(self, group: int, into: int, ops: list[Op]) -> bool:
        """Moves `ops` from `group` to block `into` if the tensors they read from it are read by
        nothing else and the grown block keeps within the constraints."""
        graph, moving = self.graph, {op.id for op in ops}
        target = self.groups[into]
        read = {t for op in ops for t in graph.activation_inputs(op)
                if (p := graph.producer(t)) is not None and p.id in target}
        if any(t in graph.outputs or any(c.id not in target | moving for c in graph.consumers(t))
               for t in read):
            return False
        if self.violated_constraint(target | moving) or self.blocks_cyclic_with(moving, into):
            return False
        label = "+".join(sorted(target, key=graph.order.__getitem__))
        self.decisions += [Decision(label, op.id, True, "green: epilogue rather than prologue")
                           for op in ops]
        self.groups[group] -= moving
        target |= moving
        self.group_of.update((op_id, into) for op_id in moving)
        return True

    # Legality ----------------------------------------------------------------------------
    def blocks_cyclic_with(self, moving: set[str], into: int) -> bool:
        """Would the blocks depend on each other in a cycle with `moving` in block `into`? A block
        runs as one kernel, so it waits for every block any of its ops reads from: a path between
        two blocks may run through ops of a third that the ops on it never touch (`reaches`
        follows ops, not blocks)."""
        group_of = self.group_of | dict.fromkeys(moving, into)
        after: dict[int, set[int]] = {group: set() for group in group_of.values()}
        for op in self.graph.ops:
            for nxt in self.graph.successors(op):
                if group_of[op.id] != group_of[nxt.id]:
                    after[group_of[op.id]].add(group_of[nxt.id])
        waits = dict.fromkeys(after, 0)
        for targets in after.values():
            for group in targets:
                waits[group] += 1
        ready = [group for group, count in waits.items() if count == 0]
        ran = 0
        while ready:  # Kahn's order: every block runs unless some wait on each other
            ran += 1
            for nxt in after[ready.pop()]:
                waits[nxt] -= 1
                if waits[nxt] == 0:
                    ready.append(nxt)
        return ran < len(after)

    def path_outside(self, sources: set[str], targets: set[str]) -> bool:
        """Is there a path from `sources` to `targets` through ops in neither?

        Committed blocks count as single nodes: entering one at any op leaves it from all of its
        ops, since the block runs as one kernel.
        """
        graph = self.graph
        inside = sources | targets
        stack = [s.id for op_id in sources for s in graph.successors(graph.op_by_id[op_id])
                 if s.id not in inside]
        seen: set[str] = set()
        while stack:
            op_id = stack.pop()
            if op_id in seen:
                continue
            group = self.group_of.get(op_id)
            members = self.groups[group] if group is not None else (op_id,)
            seen.update(members)
            for member in members:
                for nxt in graph.successors(graph.op_by_id[member]):
                    if nxt.id in targets:
                        return True
                    if nxt.id not in inside and nxt.id not in seen:
                        stack.append(nxt.id)
        return False


def row_space(graph: Graph, op: Op, members: set[str]) -> tuple[int, ...] | None:
    """The leading dims over which `op` is row-local, or None.

    Row-local: each row of the output (fixed leading indices) depends only on the same row of
    the op's first input and on tensors computed before the block (`members`) starts: a MatMul or
    Gemm whose B operand comes from outside the block, or a reduction/normalization over the
    trailing axes (the op's record says which, `RowLocality`).
    """
    locality = op_info(op.op_type).row_locality
    if locality is RowLocality.MATRIX_ROWS:
        return _matrix_rows(graph, op, members)
    if locality is RowLocality.NONE:
        return None
    shape = graph.tensors[op.inputs[0]].shape
    rank = len(shape)
    if locality is RowLocality.REDUCED_AXES:
        axes_input = op.inputs[1] if len(op.inputs) > 1 else None
        if axes_input is None or not graph.is_constant(axes_input):
            return None
        axes = sorted(int(a) % rank for a in graph.tensors[axes_input].data.reshape(-1))
        if not axes or axes != list(range(axes[0], rank)):
            return None
        return shape[:axes[0]]
    first = int(op.attrs.get("axis", -1)) % rank
    if locality is RowLocality.LAST_AXIS and first != rank - 1:
        return None
    return shape[:first]


def _matrix_rows(graph: Graph, op: Op, members: set[str]) -> tuple[int, ...] | None:
    """Rows of A, when B comes from outside the block and A is not transposed."""
    a, b = graph.tensors[op.inputs[0]], op.inputs[1]
    producer = graph.producer(b)
    if (producer is not None and producer.id in members) or len(a.shape) < 2:
        return None
    if op.attrs.get("transA", 0):
        return None
    rows = a.shape[:-1]
    return rows if graph.tensors[op.outputs[0]].shape[:-1] == rows else None


def _tile_operand_bytes(graph: Graph, heavy: list[Op]) -> int:
    """Bytes of MatMul/Gemm B operands one row tile reads (a batch dim shared with the rows
    splits B between tiles; weights without batch dims are read whole by every tile)."""
    total = 0
    for op in heavy:
        if op_info(op.op_type).row_locality is RowLocality.MATRIX_ROWS:
            b = graph.tensors[op.inputs[1]]
            total += b.nbytes // max(1, math.prod(b.shape[:-2]))
    return total


# What `prefer_epilogues` moves from a prologue to the contraction's epilogue.
_MOVABLE = (MappingType.ONE_TO_ONE, MappingType.REORGANIZE)


def _is_opaque(op: Op) -> bool:
    return op_info(op.op_type).opaque


def _is_recurrent(op: Op) -> bool:
    return op_info(op.op_type).recurrent


def _max_live_values(graph: Graph, ops: list[Op], members: set[str]) -> int:
    """Most block-internal values alive at once when the block is evaluated in order."""
    remaining = {t: sum(1 for c in graph.consumers(t) if c.id in members)
                 for op in ops for t in op.outputs}
    live: set[str] = set()
    peak = 0
    for op in ops:
        for t in dict.fromkeys(op.present_inputs()):
            if t in remaining:
                remaining[t] -= 1
                if remaining[t] == 0:
                    live.discard(t)
        live.update(t for t in op.outputs if remaining[t] > 0)
        peak = max(peak, len(live))
    return peak


def _cheaper(together: Estimate, block: Estimate, alone: Estimate) -> bool:
    return together.seconds <= block.seconds + alone.seconds
