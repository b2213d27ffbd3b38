"""Partitioner `souffle`: Souffle's top-down, resource-aware TE program partitioning (ASPLOS'24
§5.4, Algorithm 1) with its horizontal (§6.1) and vertical (§6.2) TE transformations.

1. Horizontal transformation (`kiln.plan.horizontal`): sibling contractions reading one tensor
   (spatial reuse, §5.1) become one contraction over concatenated weights, e.g. BERT's Q/K/V.
2. TE lowering and analysis (`kiln.plan.te`): each op as TEs, one-relies-on-one with a
   quasi-affine map or one-relies-on-many with reduction axes, compute- or memory-intensive by
   the operations-per-element ratio (threshold 3).
3. Partitioning: the whole program starts as one subprogram; TEs join it in BFS order, memory-
   intensive TEs right after their producers (they take the schedule of the compute-intensive
   TE before them, §6.3). Only a compute-intensive TE may open a new subprogram, and it does
   when adding it would break the resource constraint.
4. Vertical transformation, per subprogram: chains of one-relies-on-one TEs are composed through
   their maps into one TE (Eq. 2) and one-relies-on-many TEs stay with their producers and
   consumers. The code generator realises both: a tensor computed by a one-relies-on-one TE
   inside a kernel is an index expression, never a buffer, and reductions over the same rows run
   as phases of one row loop (the two-phase reduction, `kiln.codegen.lower`). The composed maps
   go into the plan's decisions.

GPU → CPU. Souffle's constraint is that every thread block of a subprogram is resident at once
(`max_grid × max_occ < C`, registers and shared memory), because TEs are joined by global
synchronisation and their intermediates stay on chip. A Kiln kernel is a sequence of parallel
loop nests joined by the barrier at the end of each (the global sync); every core is always
resident, so the constraint that remains is the on-chip one: what a subprogram keeps between its
stages, plus the working set of the compute-intensive TE being added, must fit the cache —
  * resident bytes while the compute-intensive TE being added runs: the results of
    one-relies-on-many TEs of the subprogram that it or later TEs still read (they live in
    scratch between barriers, like Souffle's shared memory), plus its working set: its constant
    operands, which every row tile re-reads, and one row tile (`row_tile` rows) of its
    activations and result — like the occupancy of a block;
  * capacity: a 1 MiB L2 (`cache_bytes`), the per-core L2 of the 2-thread x86 machines Kiln
    targets; registers bound the code generator's own tiles, not the partition;
  * a subprogram holds at most `max_ops` ops, which bounds generated-code size and compile time
    (the analogue of Souffle's kernel size limits, from Kiln's compiler rather than the GPU).
Ops Souffle cannot express as TEs (control flow, recurrences, data-dependent shapes: the ops
whose record says opaque or recurrent) get a kernel of their own, as in the paper's §9.
The instruction-level pipelining of §6.5 (asynchronous copies to shared memory) has no CPU
counterpart in Kiln's code generator and is not done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.ecg import Graph, Op
from kiln.ops import op_info
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.plan.horizontal import horizontal_transform
from kiln.plan.te import Dependence, TEProgram, lower_program
from kiln.profile import ProfileStore


@dataclass(frozen=True)
class Resources:
    cache_bytes: int = 1 << 20  # per-core L2
    row_tile: int = 16  # rows of a compute-intensive TE's activations one tile holds
    max_ops: int = 64
    horizontal: bool = True  # §6.1 on or off (to measure what it brings)


@register_partitioner("souffle")
class Souffle:
    """Partitioner `souffle`: Souffle's resource-aware TE partitioning with horizontal and
    vertical TE transformations."""

    name = "souffle"

    def __init__(self, resources: Resources = Resources()):
        self.resources = resources

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        decisions: list[Decision] = []
        if self.resources.horizontal:
            graph, merges = horizontal_transform(graph)
            decisions += [Decision("+".join(b[0] for b in m.branches), m.merged[0], True,
                                   f"horizontal: {len(m.branches)} independent TEs sharing an "
                                   f"input merged into one") for m in merges]
        program = lower_program(graph)
        groups = _Partitioning(graph, program, self.resources, decisions).run()
        decisions += vertical_decisions(program, groups)
        return build_plan(graph, groups, self.name, decisions)


class _Partitioning:
    def __init__(self, graph: Graph, program: TEProgram, resources: Resources,
                 decisions: list[Decision]):
        self.graph, self.program, self.resources = graph, program, resources
        self.decisions = decisions
        self.groups: list[list[str]] = []
        self.current: list[str] = []

    def run(self) -> list[list[str]]:
        for op in bfs_order(self.graph, self.program):
            if _own_kernel(op):
                self.close()
                self.groups.append([op.id])
                continue
            if self.current:
                reason = self.split_reason(op)
                if reason:
                    self.decisions.append(Decision(self.label(), op.id, False, reason))
                    self.close()
                else:
                    self.decisions.append(Decision(self.label(), op.id, True, self.join_reason(op)))
            self.current.append(op.id)
        self.close()
        self.move_index_maps_to_consumers()
        return self.groups

    def move_index_maps_to_consumers(self) -> None:
        """A one-relies-on-one TE that only moves data (no arithmetic, a quasi-affine map) and
        whose results are all read by one later subprogram is composed into that subprogram's
        reads instead of being stored by its own (§6.2): e.g. the slices, reshapes and transposes
        of a horizontally merged Q/K/V projection become index maps of the attention kernel's
        operand reads, and the merged result is the only buffer. Moving a TE to a later
        subprogram that alone reads it keeps the plan acyclic: its inputs come from earlier ones."""
        graph, program = self.graph, self.program
        group_of = {op_id: gi for gi, g in enumerate(self.groups) for op_id in g}
        for gi in reversed(range(len(self.groups))):
            for op_id in reversed(list(self.groups[gi])):
                op = graph.op_by_id[op_id]
                if not _moves_data(program, op) or any(t in graph.outputs for t in op.outputs):
                    continue
                readers = {group_of[c.id] for t in op.outputs for c in graph.consumers(t)}
                if len(readers) != 1 or (target := readers.pop()) <= gi:
                    continue
                self.groups[gi].remove(op_id)
                self.groups[target].append(op_id)
                group_of[op_id] = target
                self.decisions.append(Decision(op_id, graph.consumers(op.outputs[0])[0].id, True,
                                               "vertical: index map read by its consumers"))
        self.groups = [g for g in self.groups if g]

    def close(self) -> None:
        if self.current:
            self.groups.append(self.current)
            self.current = []

    def label(self) -> str:
        return "+".join(self.current[:1] + self.current[-1:]) if len(self.current) > 1 else \
            self.current[0]

    def split_reason(self, op: Op) -> str | None:
        """Why `op` opens a new subprogram, or None. Only compute-intensive TEs are partition
        points (§5.4); past twice `max_ops` any TE is, so that no kernel grows without bound."""
        r = self.resources
        if len(self.current) >= 2 * r.max_ops:
            return f"size: more than {2 * r.max_ops} ops"
        if not self.program.compute_intensive(op):
            return None
        if len(self.current) >= r.max_ops:
            return f"size: more than {r.max_ops} ops"
        resident = resident_bytes(self.graph, self.program, self.current + [op.id], r)
        if resident > r.cache_bytes:
            return f"resource: {resident} B resident > {r.cache_bytes} B cache"
        return None

    def join_reason(self, op: Op) -> str:
        if self.program.compute_intensive(op):
            return "resource: fits the cache with the subprogram"
        return "memory-intensive TE: takes its producer's schedule"


def _moves_data(program: TEProgram, op: Op) -> bool:
    exprs = program.by_op.get(op.id, ())
    return bool(exprs) and all(te.dependence is Dependence.ONE_RELIES_ON_ONE and te.arithmetic == 0
                               and te.maps and all(m is not None for m in te.maps.values())
                               for te in exprs)


def _own_kernel(op: Op) -> bool:
    info = op_info(op.op_type)
    return info.opaque or info.recurrent


def bfs_order(graph: Graph, program: TEProgram) -> list[Op]:
    """A topological order in which every memory-intensive TE comes as soon as its inputs are
    ready — right after its producer — and compute-intensive TEs only when no memory-intensive
    one is ready, so a partition point never separates a TE from its consumers needlessly."""
    waiting = {op.id: len(graph.predecessors(op)) for op in graph.ops}
    ready = [op for op in graph.ops if waiting[op.id] == 0]
    ordered: list[Op] = []
    while ready:
        op = min(ready, key=lambda o: (program.compute_intensive(o), graph.order[o.id]))
        ready.remove(op)
        ordered.append(op)
        for nxt in graph.successors(op):
            waiting[nxt.id] -= 1
            if waiting[nxt.id] == 0:
                ready.append(nxt)
    return ordered


def resident_bytes(graph: Graph, program: TEProgram, members: list[str],
                   resources: Resources) -> int:
    """Bytes on chip while the last TE of `members` runs (see the module docstring): the results
    of earlier one-relies-on-many TEs that it or no earlier TE was the last to read, plus its own
    working set. Earlier TEs' working sets are gone by then: each stage ends at a barrier."""
    *before, last = members
    inside = set(members)
    remaining = {t: sum(1 for c in graph.consumers(t) if c.id in inside)
                 for op_id in before for t in graph.op_by_id[op_id].outputs}
    for op_id in before:
        for t in graph.op_by_id[op_id].present_inputs():
            if t in remaining:
                remaining[t] -= 1
    live = sum(graph.tensors[te.output].nbytes for op_id in before
               for te in program.by_op.get(op_id, ())
               if te.dependence is Dependence.ONE_RELIES_ON_MANY and remaining[te.output] > 0)
    return live + working_set(graph, graph.op_by_id[last], resources)


def working_set(graph: Graph, op: Op, resources: Resources) -> int:
    """Bytes one row tile of a compute-intensive TE touches: its constant operands (re-read by
    every tile) and a `row_tile`-row share of its activations and results."""
    out = graph.tensors[op.outputs[0]]
    rows = math.prod(out.shape[:-1]) if len(out.shape) > 1 else 1
    tiles = max(1, rows // resources.row_tile)
    constant = sum(graph.tensors[t].nbytes for t in op.present_inputs() if graph.is_constant(t))
    streamed = sum(graph.tensors[t].nbytes for t in graph.activation_inputs(op)) + sum(
        graph.tensors[t].nbytes for t in op.outputs)
    return constant + streamed // tiles


def vertical_decisions(program: TEProgram, groups: list[list[str]]) -> list[Decision]:
    """§6.2 within each subprogram: every maximal chain of one-relies-on-one TEs, each reading
    the one before, with the composed map of the chain (or why it has none)."""
    graph = program.graph
    found = []
    for group in groups:
        members = set(group)
        for op_id in group:
            op = graph.op_by_id[op_id]
            if not program.one_relies_on_one(op) or len(op.outputs) != 1:
                continue
            if any(c.id in members and program.one_relies_on_one(c) and
                   _chain_input(graph, c) == op.outputs[0] for c in graph.consumers(op.outputs[0])):
                continue  # not the end of its chain
            chain = _chain(graph, program, op, members)
            if len(chain) < 3:
                continue
            composed = program.chain_map(chain)
            what = str(composed) if composed is not None else \
                "no quasi-affine map: index expressions"
            first = graph.producer(chain[1])
            found.append(Decision(first.id, op.id, True,
                                  f"vertical: {len(chain) - 1} one-relies-on-one TEs as one, "
                                  f"{what}"))
    return found


def _chain_input(graph: Graph, op: Op) -> str | None:
    inputs = graph.activation_inputs(op)
    return inputs[0] if inputs else None


def _chain(graph: Graph, program: TEProgram, last: Op, members: set[str]) -> list[str]:
    """Tensors t₀ … tₙ (tₙ = `last`'s output) along first activation inputs through
    one-relies-on-one TEs of the subprogram."""
    chain = [last.outputs[0]]
    op = last
    while True:
        source = _chain_input(graph, op)
        if source is None:
            break
        chain.append(source)
        producer = graph.producer(source)
        if (producer is None or producer.id not in members or len(producer.outputs) != 1
                or not program.one_relies_on_one(producer)):
            break
        op = producer
    return list(reversed(chain))
