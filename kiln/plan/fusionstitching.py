"""Partitioner `fusionstitching`: FusionStitching's deep fusion (§3), schedule planning (§4) and
shared-memory sizing (§5.1), for CPUs.

**Work/Span analysis** (§3.1, `work_span`): an op no other op reads has span 0; any other op's
span is the largest span of its users plus one. Ops of one span form a layer, and no op of a layer
depends on another of it. Library calls (`op.compute_intensive`: MatMul, Gemm, Conv, ...; and ops
that are never fused: opaque and recurrent ones) are the boundaries: each is a kernel of its own,
and the layers holding one are the LC-layers.

**Fusion** (§3.2): root layers are taken from span 0 upwards. In each, the ops not yet fused are
first grouped by *ElementwiseFusion* (intra-layer elementwise ops of one output shape, up to a
memory footprint and an output count), then each group (or lone op) is a fusion root grown by
Algorithm 1 up to the roof, the next LC-layer above: layer by layer, an op joins when
`SchdConsistent` holds:

1. none of its users was given up, nor is in another fusion (which keeps the fusion convex and
   the fusions acyclic: no path leaves it and comes back, also through another fusion of the
   same root layer);
2. one of its users is in the fusion (producer/consumer fusion only; same-layer ops are
   ElementwiseFusion's);
3. the fusion with it still has an optimized schedule: a propagated schedule
   (`stitch_schedule`, Row or Column) with as many blocks, up to one per thread, as the fusion
   had without it; reshapes and transposes of at most `trivial_bytes` are bypassed as §4.3 allows, composed
   into their consumers' loops; its stitched intermediates fit the scratch budget (§5.1.2's feedback); at most `max_ops` ops;
   and the performance library predicts the fused kernel no slower than the fusion and the op
   apart (`stitch_tuning.faster_fused`).

Otherwise the op is given up, and later becomes a root in its own layer. Ops already in another
fusion count as given up. Since spans fall strictly along every edge and layers are grown in
order, fusions are convex and the plan acyclic (a path between two ops of one fusion passes only
through layers the fusion visited, where a given-up op would have stopped the upstream one; a
path through another fusion starts at a producer whose user is in that fusion, refused by 1).

**Schedules** (§4): while a fusion grows, its satisfiable partitions, Row and Column, decide
condition 3 (a statistics fusion over the rows keeps its parallelism only by columns). Once it is
complete, every satisfiable Row and Column partition of it is ranked by the performance library
(`stitch_tuning.PerformanceLibrary.tune`: measurements when the library has them all, else the
cost model, in which a column reduction run by rows pays for its strided reads); the best becomes
the block's `Schedule.stitch_blocks`, with `Schedule.stitch_columns` for a Column one
(`FusionPlan.schedules`), when the fusion stitches a reduction; the rest of the shortlist goes to
the tuner (`FusionPlan.schedule_candidates`), which measures them into the library. Code
generation realises both: a Row schedule splits each stage's parallel loop into the same static
row chunks; a Column schedule cuts the inner dims from split_dim on into contiguous column chunks,
and every stage runs its rows inside its thread's chunk, vectorised along the columns
(`kiln.codegen.columns`): the schedule of a BatchNorm-style statistics fusion over N·H·W, a
ReduceSum over axis 0 or a column Softmax. Each kernel's `schedule.stitch_type` in plan.json says
which one it got.

**GPU shared memory → CPU cache.** A GPU thread block stitches ops through shared memory: on-chip,
private to the block, tens of KiB. Kiln's counterpart is a kernel's scratch area: a stitched
kernel writes the intermediate one stage computes in a layout the next stage cannot read in
registers (a reduction's rows, a Softmax's output read again by another row stage) to scratch,
and with `stitch_blocks` every stage deals chunk k to the same thread, so that thread reads back
from its own L1/L2 what it wrote. The budget that plays the shared-memory size is
`Constraints.scratch_bytes` (an L2, 1 MiB by default): the size requirement of a fusion (§5.1.1:
every intermediate a Many-to-Many op of the fusion produces for another of its ops), placed with
reuse by liveness (§5.1.3, `kiln.placement.place`, as code generation places it), must fit, or
the fusion stops growing.
"""
from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field, replace

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import Pattern, op_info
from kiln.placement import place
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.plan.stitch_schedule import COLUMN, ROW, Resolved, resolve, root_keys, satisfiable
from kiln.plan.stitch_tuning import UNSTITCHED, PerformanceLibrary
from kiln.profile import ProfileStore

KINDS = (ROW, COLUMN)  # the sched_types a fusion may run with


@dataclass(frozen=True)
class Constraints:
    max_ops: int = 64  # bounds generated-code size and compile time
    max_blocks: int = 256  # the largest partition considered (chunks of one stage)
    threads: int = 0  # 0: $KILN_NUM_THREADS, else every CPU (as the tuner counts them)
    scratch_bytes: int = 1 << 20  # the stitched intermediates' budget: a 1 MiB L2
    elementwise_bytes: int = 4 << 20  # ElementwiseFusion's memory-footprint threshold
    elementwise_outputs: int = 8  # ElementwiseFusion's most outputs of one fusion
    trivial_bytes: int = 32 * 1024  # reshapes and transposes this small bypass schedules (L1)
    shortlist: int = 3  # schedules per block handed to the tuner besides the unstitched one


def work_span(graph: Graph) -> dict[str, int]:
    """§3.1: op id -> span (0 for ops nothing reads; else one more than the largest user's)."""
    spans: dict[str, int] = {}
    for op in reversed(graph.ops):
        users = graph.successors(op)
        spans[op.id] = 1 + max(spans[u.id] for u in users) if users else 0
    return spans


def span_layers(graph: Graph, spans: dict[str, int]) -> list[list[Op]]:
    """Ops by span, each layer in graph order."""
    layers: list[list[Op]] = [[] for _ in range(max(spans.values(), default=-1) + 1)]
    for op in graph.ops:
        layers[spans[op.id]].append(op)
    return layers


def is_library_call(op: Op) -> bool:
    info = op_info(op.op_type)
    return op.compute_intensive or info.opaque or info.recurrent


@register_partitioner("fusionstitching")
class FusionStitching:
    """Partitioner `fusionstitching`: FusionStitching's stitching of memory-intensive ops between library calls

    Work/span layers, Algorithm 1 under schedule consistency, schedules propagated and tuned."""

    name = "fusionstitching"

    def __init__(self, constraints: Constraints = Constraints()):
        self.constraints = constraints

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        return _Stitching(graph, store, self.constraints).run(self.name)


@dataclass
class _Fusion:
    members: set[str]
    resolved: list[Resolved] = field(default_factory=list)  # its satisfiable partitions


class _Stitching:
    def __init__(self, graph: Graph, store: ProfileStore, constraints: Constraints):
        self.graph, self.constraints = graph, constraints
        self.threads = (constraints.threads or int(os.environ.get("KILN_NUM_THREADS", 0) or 0)
                        or os.cpu_count() or 1)
        self.library = PerformanceLibrary(graph, store, self.threads, constraints.shortlist)
        self.spans = work_span(graph)
        self.layers = span_layers(graph, self.spans)
        self.lc_layers = sorted({self.spans[op.id] for op in graph.ops if is_library_call(op)})
        self.group_of: dict[str, int] = {}
        self.fusions: list[_Fusion] = []
        self.decisions: list[Decision] = []

    def run(self, name: str) -> FusionPlan:
        for op in self.graph.ops:
            if is_library_call(op):
                self.commit(_Fusion({op.id}))
        for span, layer in enumerate(self.layers):
            roof = next((lc for lc in self.lc_layers if lc > span), len(self.layers))
            for root in self.elementwise_fusion([op for op in layer if op.id not in self.group_of]):
                self.commit(self.subgraph_fusion(root, span, roof))
        plan = build_plan(self.graph, [f.members for f in self.fusions], name, self.decisions,
                          self.library.lookups)
        return self.with_schedules(plan)

    def commit(self, fusion: _Fusion) -> None:
        self.group_of.update((op_id, len(self.fusions)) for op_id in fusion.members)
        self.fusions.append(fusion)

    # --- ElementwiseFusion (§3.2) ---------------------------------------------------------
    def elementwise_fusion(self, layer: list[Op]) -> list[_Fusion]:
        """Intra-layer elementwise ops of one output shape as one fusion root (no two ops of a
        layer depend on each other), within the footprint and output thresholds."""
        roots: list[_Fusion] = []
        open_by_shape: dict[tuple, _Fusion] = {}
        for op in layer:
            shape = self.graph.tensors[op.outputs[0]].shape if op.outputs else ()
            host = open_by_shape.get(shape) if _is_elementwise(op) else None
            if host is not None and self.joins_horizontally(host, op):
                continue
            fusion = _Fusion({op.id}, self.partitions({op.id}))
            roots.append(fusion)
            if _is_elementwise(op):
                open_by_shape[shape] = fusion
        return roots

    def joins_horizontally(self, host: _Fusion, op: Op) -> bool:
        c = self.constraints
        members = host.members | {op.id}
        ops = [self.graph.op_by_id[i] for i in members]
        if len(members) > c.elementwise_outputs or sum(o.bytes for o in ops) > c.elementwise_bytes:
            return False
        resolved = self.partitions(members)
        alone = self.partitions({op.id})
        if self.parallelism(resolved) < min(self.parallelism(host.resolved), self.parallelism(alone)):
            return False
        if not self.library.faster_fused((members, resolved), [(host.members, host.resolved),
                                                               ({op.id}, alone)]):
            return False
        self.decisions.append(Decision(self.label(host.members), op.id, True,
                                       "stitched: same layer, same shape (ElementwiseFusion)"))
        host.members, host.resolved = members, resolved
        return True

    # --- Algorithm 1 ----------------------------------------------------------------------
    def subgraph_fusion(self, root: _Fusion, span: int, roof: int) -> _Fusion:
        """Grows `root` (at `span`) through the layers below `roof`, producers of the fusion
        only: any other op of those layers has no user in the fusion and would be given up."""
        fusion = root
        frontier: list[tuple[int, int, str]] = []
        queued: set[str] = set()

        def enqueue(op_ids) -> None:
            for op_id in op_ids:
                for pred in self.graph.predecessors(self.graph.op_by_id[op_id]):
                    if pred.id not in queued and span < self.spans[pred.id] < roof:
                        queued.add(pred.id)
                        heapq.heappush(frontier, (self.spans[pred.id], self.graph.order[pred.id],
                                                  pred.id))

        enqueue(fusion.members)
        while frontier:
            _, _, op_id = heapq.heappop(frontier)
            reason = self.schd_consistent(fusion, self.graph.op_by_id[op_id], span)
            if reason is None:
                enqueue([op_id])
        return fusion

    def schd_consistent(self, fusion: _Fusion, hlo: Op, span: int) -> str | None:
        """Adds `hlo` to `fusion` if it may join; returns why not otherwise (a Decision)."""
        users = self.graph.successors(hlo)
        given_up = [u for u in users if u.id not in fusion.members
                    and (self.spans[u.id] > span or u.id in self.group_of)]
        if hlo.id in self.group_of or is_library_call(hlo):
            reason = "given up: in another kernel" if hlo.id in self.group_of else \
                "given up: a library call (boundary)"
        elif given_up:
            reason = f"given up: its user {given_up[0].id} was given up"
        elif not any(u.id in fusion.members for u in users):
            reason = "given up: no user in the fusion"
        else:
            reason = self.schedule_refusal(fusion, hlo)
        self.decisions.append(Decision(self.label(fusion.members), hlo.id, reason is None,
                                       reason or f"stitched: {self.parallelism(fusion.resolved)}"
                                                 f" blocks agree"))
        return reason

    def schedule_refusal(self, fusion: _Fusion, hlo: Op) -> str | None:
        c = self.constraints
        members = fusion.members | {hlo.id}
        if len(members) > c.max_ops:
            return f"constraint: more than {c.max_ops} ops"
        scratch = self.scratch_requirement(members)
        if scratch > c.scratch_bytes:
            return f"constraint: stitched intermediates need {scratch} bytes of scratch"
        wanted = self.parallelism(fusion.resolved)
        resolved = self.partitions(members, at_least=wanted)
        if self.parallelism(resolved) < wanted:
            return f"schedule: no schedule of {wanted} blocks agrees"
        alone = self.partitions({hlo.id})
        if not self.library.faster_fused((members, resolved),
                                         [(fusion.members, fusion.resolved), ({hlo.id}, alone)]):
            return "slower fused"
        fusion.members, fusion.resolved = members, resolved
        return None

    # --- schedules ------------------------------------------------------------------------
    def partitions(self, members: set[str], at_least: int = 1) -> list[Resolved]:
        """The fusion's satisfiable Row and Column partitions. With `at_least` > 1 only whether
        one of at least that many blocks exists matters: the search stops at the first (fewest
        blocks)."""
        if at_least <= 1:
            return satisfiable(self.graph, members, self.constraints.max_blocks, KINDS,
                               self.trivial)
        keys = [k for k in root_keys(self.graph, members, self.constraints.max_blocks, KINDS)
                if k[1] >= at_least]
        for key in sorted(keys, key=lambda k: (k[1], k[0].value)):
            found = resolve(self.graph, members, key, self.trivial)
            if found is not None:
                return [found]
        return []

    def trivial(self, op: Op) -> bool:
        """§4.3's bypass: pure data movement on at most `trivial_bytes`, which code generation
        composes into its consumer's loop (an index remap), need not agree on a schedule."""
        return (op.mapping in (MappingType.REORGANIZE, MappingType.SHUFFLE) and op.flops == 0
                and sum(self.graph.tensors[t].nbytes for t in op.outputs)
                <= self.constraints.trivial_bytes)

    def parallelism(self, resolved: list[Resolved]) -> int:
        """Blocks the best partition gives, counted up to one per thread."""
        return min(self.threads, max((r.blocks for r in resolved), default=1))

    def scratch_requirement(self, members: set[str]) -> int:
        """§5.1.1–5.1.3: bytes of the intermediates Many-to-Many ops of the fusion produce for
        other ops of it, placed with reuse by liveness (positions in graph order)."""
        intervals = []
        for op_id in members:
            op = self.graph.op_by_id[op_id]
            if op.mapping != MappingType.MANY_TO_MANY:
                continue
            for t in op.outputs:
                readers = [self.graph.order[u.id] for u in self.graph.consumers(t)
                           if u.id in members]
                if readers:
                    intervals.append((t, self.graph.tensors[t].nbytes, self.graph.order[op_id],
                                      max(readers)))
        return max((b.offset + b.nbytes for b in place(intervals)), default=0)

    def with_schedules(self, plan: FusionPlan) -> FusionPlan:
        """Each stitched block's best schedule, and its shortlist for the tuner."""
        chosen: dict[str, dict] = {}
        candidates: dict[str, tuple[dict, ...]] = {}
        for fusion in self.fusions:
            if not _stitches_reduction(self.graph, fusion.members):
                continue
            block = plan.block_of[next(iter(fusion.members))]
            resolved = self.partitions(fusion.members)
            ranked = self.library.tune(fusion.members, resolved)
            if not ranked:
                continue
            overrides = [c.overrides(explicit=ranked[0].columns > 0) for c in ranked]
            if ranked[0].blocks != UNSTITCHED:
                chosen[block] = overrides[0]
            candidates[block] = tuple(overrides[1:])
        return replace(plan, schedules=chosen, schedule_candidates=candidates)

    def label(self, members: set[str]) -> str:
        return "+".join(sorted(members, key=self.graph.order.__getitem__))


def _is_elementwise(op: Op) -> bool:
    return (op.mapping == MappingType.ONE_TO_ONE and len(op.outputs) == 1
            and op_info(op.op_type).pattern in (Pattern.ELEMWISE, Pattern.BROADCAST))


def _stitches_reduction(graph: Graph, members: set[str]) -> bool:
    """A fusion of several ops with a Many-to-Many one: its stages are stitched through scratch."""
    return len(members) > 1 and any(graph.op_by_id[i].mapping == MappingType.MANY_TO_MANY
                                    for i in members)
