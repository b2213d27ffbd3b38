"""Partitioner `graphturbo`: GraphTurbo's hardware-aware grouping into stages (Zhao et al., §3).

The paper schedules graphs on a DSA whose cores each have a scratchpad local buffer (LB) and
share a global buffer (GB) in front of DDR. On a CPU, Kiln maps them so:

  DSA                               CPU
  core with its local buffer (LB)   a core and its private L2 (the per-core L2 share) — SplitInfo
                                    sizes a stage's instance so its peak live data fits it
  L1 of a core (the paper's STCP920 a core's L1d: the scope of instance buffers small enough
  LB is its L1)
  compute-unit registers            vector registers: values a fused expression computes and
                                    never stores ("register" scope)
  global buffer (GB / LLB)          the core's share of the last-level cache (L3)
  DDR                               main memory: the arena of the memory plan ("memory" scope)

What the partitioner does, in the paper's order:

* **SplitInfo** (§3.1, Algorithm 1) of a sub-graph: for each dimension d of its output, the
  smallest factor f_d (from 1, 2, 4, 8, 9, …) that cuts the sub-graph's peak live activation
  bytes into parts that fit the LB, and n_d, how many of its ops the cut splits (an op splits
  along d when it carries d: an elementwise op carries every dimension, a convolution the batch
  and its spatial dimensions, a row-local op its leading dimensions; the output extent along d
  must divide by f_d). A sub-graph that needs cutting (f_d > 1) may be cut along d only if every
  op splits along it. The best split is lexmax(n_d, −f_d, −d) (Eq. 1).
* **Grouping** (§3.2, Algorithm 2): from one sub-graph per op, repeated straight, diamond and
  branch merges (Fig. 4) until none applies. Straight and branch merges follow rule (i): the
  second's factor is not below the first's (a down-sampling ends a stage) and the merged factor
  is not above the second's; a diamond merge rule (ii): the merged factor is not above the
  largest of its parts. A merge whose result has no SplitInfo (its data cannot be cut to fit
  the LB) is refused: the hardware says where grouping stops. So is one whose halo rows would
  grow the stage's FLOPs by more than MAX_RECOMPUTE (the paper's cost model against
  recomputation), and one that puts several compute-intensive layers in a stage Kiln's kernel
  generator could not run tile by tile (it would run them whole, one after another: nothing
  gained over separate stages).
* **Instances** (§3.3): a stage cut f ways along d runs as f instances per index of the
  dimensions before d (images, for a split of rows). Instances are ordered by Algorithm 3 —
  breadth first (every instance of a stage, then the next stage) and depth first (an instance
  of the next stage as soon as its inputs exist) — and the order that keeps the fewer bytes of
  instance outputs live is chosen. Kiln runs one kernel per stage, so across stages the kernels
  run in plan order; inside a stage the kernel runs instance by instance, each through all of
  the stage's layers (the depth-first order within the stage, `kiln.codegen.tiled`).
* **Buffer scopes** (§3.4, §4.3): every tensor of a stage gets a scope (`kiln.plan.scopes`):
  a stage's outputs live in memory; in a stage run tile by tile, each kept intermediate is a
  window buffer of one instance, placed by liveness with reuse in L1, then L2, spilling the
  buffer of longest liveness when a scope overflows; other intermediates are computed in
  registers. A stage not cut keeps intermediates whole, scoped by size.
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from kiln.cpuinfo import host_caches
from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import op_info
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan, make_block
from kiln.plan.dnnfusion import row_space
from kiln.plan.scopes import (
    ROW_DIM,
    Placed,
    Window,
    allocate,
    is_row_conv,
    kept_liveness,
    kept_tensors,
    row_windows,
    scope_of_bytes,
)
from kiln.profile import ProfileStore

SMALL_FACTORS = (1, 2, 4)  # Algorithm 1 line 4: 1, 2, 4, then every value from 8 up
MAX_OPS = 48  # bounds generated-code size and compile time
MAX_DIAMOND = 12  # sub-graphs inside one diamond
# The LB is this share of a core's L2: the rest holds what an instance streams through it — the
# weights of the layer it runs (the paper's small fixed buffers for weight promotion, §2.2), the
# rows it reads from the stage's inputs and the rows it writes to the stage's outputs.
LB_SHARE = 2
# The paper's cost model against recomputation (§3.1): a stage cut into row instances computes
# the halo rows its 3×3 convolutions read in every instance that needs them; a merge is refused
# when that would make the stage's FLOPs grow by more than this factor.
MAX_RECOMPUTE = 1.25


@dataclass(frozen=True)
class Hardware:
    """The buffers GraphTurbo sizes stages by, in bytes (`for_host` reads this machine's)."""

    register_bytes: int = 16 * 32  # 16 AVX2 vector registers
    l1_bytes: int = 32 << 10
    local_bytes: int = 512 << 10  # LB: the per-core L2 share
    global_bytes: int = 16 << 20  # GB: the per-core share of the last-level cache

    @classmethod
    def for_host(cls) -> Hardware:
        caches, cores = host_caches(), os.cpu_count() or 1
        default = cls()
        l2 = caches.get("l2_bytes")
        return cls(default.register_bytes, caches.get("l1d_bytes") or default.l1_bytes,
                   l2 // LB_SHARE if l2 else default.local_bytes,
                   (caches.get("l3_bytes") or default.global_bytes * cores) // cores)

    @property
    def capacities(self) -> tuple[tuple[str, int], ...]:
        return (("L1", self.l1_bytes), ("L2", self.local_bytes), ("memory", 0))


@dataclass(frozen=True)
class Split:
    """One tuple of SplitInfo: cut along `dim` into `parts`, splitting `ops` of the ops."""

    dim: int
    parts: int
    ops: int

    def key(self) -> tuple[int, int, int]:
        return (self.ops, -self.parts, -self.dim)  # Eq. (1)

    def to_json(self) -> dict[str, int]:
        return {"dim": self.dim, "parts": self.parts, "ops": self.ops}


@dataclass(frozen=True)
class StagePlan:
    """What GraphTurbo decided for one block: its split, instances, and where its tensors live.
    `windows` is set when the stage runs row tile by row tile (`kiln.codegen.tiled`)."""

    block: str
    split: Split | None
    peak_bytes: int
    instances: int
    windows: tuple[Window, ...] = ()
    buffers: tuple[Placed, ...] = ()
    scopes: dict[str, str] = field(default_factory=dict)  # tensor -> scope

    @property
    def tiled(self) -> bool:
        return bool(self.windows)

    def placed(self, tensor: str) -> Placed | None:
        return next((b for b in self.buffers if b.tensor == tensor), None)

    def to_json(self) -> dict[str, Any]:
        return {"split": self.split.to_json() if self.split else None,
                "peak_bytes": self.peak_bytes, "instances": self.instances, "tiled": self.tiled,
                "windows": [w.to_json() for w in self.windows],
                "buffers": [b.to_json() for b in self.buffers], "scopes": dict(self.scopes)}


# --- §3.1 SplitInfo ------------------------------------------------------------------------------

def peak_bytes(graph: Graph, ops: list[Op]) -> int:
    """The most activation bytes live at once when the ops run in order on whole tensors (the
    sub-graph's inputs until their last read, each result from its op to its last read)."""
    members = {op.id for op in ops}
    uses: dict[str, int] = {}
    for op in ops:
        for t in dict.fromkeys(graph.activation_inputs(op)):
            uses[t] = uses.get(t, 0) + 1
    live = {t for t in uses if (p := graph.producer(t)) is None or p.id not in members}
    peak = 0
    for op in ops:
        live.update(op.outputs)
        peak = max(peak, sum(graph.tensors[t].nbytes for t in live))
        for t in dict.fromkeys(graph.activation_inputs(op)):
            uses[t] -= 1
            if uses[t] == 0:
                live.discard(t)
        live -= {t for t in op.outputs if t not in uses}
    return peak


def carried_dims(graph: Graph, op: Op, members: set[str]) -> frozenset[int]:
    """Output dimensions along which the op's work splits into independent parts."""
    rank = len(graph.tensors[op.outputs[0]].shape)
    if _alone(op):
        return frozenset()
    if op.mapping == MappingType.ONE_TO_ONE:
        return frozenset(range(rank))
    if is_row_conv(graph, op):
        return frozenset({0, *range(2, rank)})
    if op.mapping == MappingType.MANY_TO_MANY:
        rows = row_space(graph, op, members)
        return frozenset(range(len(rows))) if rows else frozenset()
    return frozenset()


def factors(size: int) -> Iterable[int]:
    """Algorithm 1's values of v that cut `size` evenly: 1, 2, 4, then 8, 9, … up to `size`."""
    for v in (*SMALL_FACTORS, *range(8, size + 1)):
        if v <= size and size % v == 0:
            yield v


def split_info(graph: Graph, ops: list[Op], local_bytes: int) -> list[Split]:
    """Algorithm 1 for the sub-graph `ops` (topological order); its output is its last op's."""
    members = {op.id for op in ops}
    out = graph.tensors[ops[-1].outputs[0]].shape
    peak = peak_bytes(graph, ops)
    carried = [(op, carried_dims(graph, op, members)) for op in ops]
    info = []
    for d, size in enumerate(out):
        f = next((v for v in factors(size) if -(-peak // v) <= local_bytes), None)
        if f is None:
            continue
        n = sum(1 for op, dims in carried if _splits(graph, op, dims, d, len(out), f))
        if f == 1 or n == len(ops):
            info.append(Split(d, f, n))
    return info


def _splits(graph: Graph, op: Op, dims: frozenset[int], d: int, rank: int, f: int) -> bool:
    """match_dim of Algorithm 1 (line 10): the op's output has dimension d, divisible by f."""
    shape = graph.tensors[op.outputs[0]].shape
    return len(shape) == rank and d in dims and shape[d] % f == 0


def best_split(info: list[Split]) -> Split | None:
    return max(info, key=Split.key, default=None)


# --- §3.2 grouping --------------------------------------------------------------------------------

def layers(graph: Graph) -> dict[str, int]:
    """The paper's layers, the sub-graphs grouping starts from (§1.1): ops in a straight line
    (each the only consumer of the one before, which is its only producer) with at most one
    compute-intensive op, which starts its layer. Op id -> layer number."""
    layer: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        producers = graph.predecessors(op)
        joins = None
        if (len(producers) == 1 and not op.compute_intensive and not _alone(op)
                and not _alone(producers[0])):
            before = producers[0]
            if all(len(graph.consumers(t)) == 1 and t not in graph.outputs for t in before.outputs):
                joins = layer[before.id]
        layer[op.id] = i if joins is None else joins
    return layer


def _alone(op: Op) -> bool:
    info = op_info(op.op_type)
    return info.opaque or info.recurrent


class _Grouping:
    """Algorithm 2 over sub-graphs kept as sets of op ids."""

    def __init__(self, graph: Graph, hardware: Hardware):
        self.graph = graph
        self.hw = hardware
        self.group_of = layers(graph)
        self.groups: dict[int, frozenset[str]] = {}
        for op_id, g in self.group_of.items():
            self.groups[g] = self.groups.get(g, frozenset()) | {op_id}
        self.decisions: list[Decision] = []
        self.seen: set[Decision] = set()
        self._best: dict[frozenset[str], Split | None] = {}

    def run(self) -> list[frozenset[str]]:
        changed = True
        while changed:
            changed = self.merge_all(self.straight) | self.merge_all(self.diamond) | \
                self.merge_all(self.branch)
        return list(self.groups.values())

    # sub-graph relations
    def ordered(self, group: frozenset[str]) -> list[Op]:
        return sorted((self.graph.op_by_id[i] for i in group), key=lambda o: self.graph.order[o.id])

    def producers(self, g: int) -> set[int]:
        return {self.group_of[p.id] for i in self.groups[g]
                for p in self.graph.predecessors(self.graph.op_by_id[i])} - {g}

    def consumers(self, g: int) -> set[int]:
        return {self.group_of[s.id] for i in self.groups[g]
                for s in self.graph.successors(self.graph.op_by_id[i])} - {g}

    def position(self, g: int) -> int:
        return min(self.graph.order[i] for i in self.groups[g])

    def split(self, group: frozenset[str]) -> Split | None:
        if group not in self._best:
            self._best[group] = best_split(split_info(self.graph, self.ordered(group),
                                                      self.hw.local_bytes))
        return self._best[group]

    def factor(self, group: frozenset[str]) -> float:
        s = self.split(group)
        return math.inf if s is None else s.parts

    def mergeable(self, g: int) -> bool:
        return not any(_alone(self.graph.op_by_id[i]) for i in self.groups[g])

    # merging patterns
    def merge_all(self, pattern) -> bool:
        merged_any = False
        for g in sorted(self.groups, key=self.position):
            if g in self.groups and pattern(g):
                merged_any = True
        return merged_any

    def straight(self, g1: int) -> bool:
        """Fig. 4a: g1 is g2's only producer and g2 is g1's only consumer."""
        consumers = self.consumers(g1)
        if len(consumers) != 1:
            return False
        g2 = next(iter(consumers))
        if self.producers(g2) != {g1}:
            return False
        return self.rule_i(g1, g2, "straight")

    def branch(self, exit_: int) -> bool:
        """Fig. 4c: an exit with several producers; the latest producer whose only consumer is
        the exit joins it."""
        producers = self.producers(exit_)
        if len(producers) < 2:
            return False
        only = [p for p in producers if self.consumers(p) == {exit_}]
        if not only:
            return False
        return self.rule_i(max(only, key=self.position), exit_, "branch")

    def rule_i(self, g1: int, g2: int, pattern: str) -> bool:
        a, b = self.groups[g1], self.groups[g2]
        merged = a | b
        reason = None
        if not (self.mergeable(g1) and self.mergeable(g2)):
            reason = "opaque or recurrent op"
        elif len(merged) > MAX_OPS:
            reason = f"more than {MAX_OPS} ops"
        elif self.factor(b) < self.factor(a):
            reason = "rule (i): the consumer's splitting factor is smaller"
        elif self.split(merged) is None:
            reason = "no SplitInfo: the merged stage cannot be cut to fit the local buffer"
        elif self.factor(merged) > self.factor(b):
            reason = "rule (i): the merged splitting factor is larger"
        elif self.recomputed(merged) > MAX_RECOMPUTE:
            reason = f"cost model: halo recomputation above {MAX_RECOMPUTE}x"
        else:
            reason = self.generator_refusal(merged)
        return self.commit([g1, g2], pattern, reason)

    def generator_refusal(self, group: frozenset[str]) -> str | None:
        """Kiln's kernel generator stitches layers through buffers only tile by tile
        (`kiln.codegen.tiled`); a stage of several compute-intensive layers it would run whole,
        layer after layer, gains nothing over separate stages and is refused."""
        ops = self.ordered(group)
        if sum(o.compute_intensive for o in ops) <= 1:
            return None
        split = self.split(group)
        ids = [o.id for o in ops]
        outputs = make_block(self.graph, ids, 0).outputs
        if (split is not None and split.dim == ROW_DIM and split.parts > 1
                and row_windows(self.graph, ids, outputs, split.parts) is not None
                and kept_tensors(self.graph, ids, outputs)):
            return None
        return "kernel generator: several compute-intensive layers share a kernel only tile by tile"

    def recomputed(self, group: frozenset[str]) -> float:
        """FLOPs of the group run as its row instances over FLOPs run whole (1: no halo)."""
        split = self.split(group)
        if split is None or split.dim != ROW_DIM or split.parts == 1:
            return 1.0
        ops = self.ordered(group)
        ids = [o.id for o in ops]
        outputs = make_block(self.graph, ids, 0).outputs
        windows = row_windows(self.graph, ids, outputs, split.parts)
        if windows is None:
            return 1.0
        total = sum(o.flops for o in ops) or 1
        grown = 0.0
        for o in ops:
            w = windows.get(o.outputs[0])
            grown += o.flops * (w.rows * split.parts / w.height if w else 1.0)
        return grown / total

    def diamond(self, exit_: int) -> bool:
        """Fig. 4b: one entry, one exit, at least two paths; everything but the entry joins."""
        producers = self.producers(exit_)
        if len(producers) < 2:
            return False
        entry = self.common_entry(producers)
        if entry is None:
            return False
        inner = self.between(entry, exit_)
        if inner is None or not inner:
            return False
        parts = [*inner, exit_]
        merged = frozenset().union(*(self.groups[g] for g in parts))
        reason = None
        if not all(self.mergeable(g) for g in parts):
            reason = "opaque or recurrent op"
        elif len(merged) > MAX_OPS:
            reason = f"more than {MAX_OPS} ops"
        elif self.split(merged) is None:
            reason = "no SplitInfo: the merged stage cannot be cut to fit the local buffer"
        elif self.factor(merged) > max(self.factor(self.groups[g]) for g in parts):
            reason = "rule (ii): the merged splitting factor is larger than its parts'"
        elif self.recomputed(merged) > MAX_RECOMPUTE:
            reason = f"cost model: halo recomputation above {MAX_RECOMPUTE}x"
        else:
            reason = self.generator_refusal(merged)
        return self.commit(parts, "diamond", reason)

    def ancestors(self, g: int, limit: int) -> list[int]:
        """g and the sub-graphs it depends on, nearest first (at most `limit`)."""
        seen, queue = [g], [g]
        while queue and len(seen) < limit:
            for p in sorted(self.producers(queue.pop(0)), key=self.position, reverse=True):
                if p not in seen:
                    seen.append(p)
                    queue.append(p)
        return seen

    def common_entry(self, producers: set[int]) -> int | None:
        lists = [self.ancestors(p, 4 * MAX_DIAMOND) for p in producers]
        common = set(lists[0]).intersection(*lists[1:])
        return max(common, key=self.position) if common else None

    def between(self, entry: int, exit_: int) -> list[int] | None:
        """The sub-graphs on paths from entry to exit, if entry and exit are the only doors."""
        inside: set[int] = set()
        stack = [p for p in self.producers(exit_) if p != entry]
        while stack:
            g = stack.pop()
            if g in inside:
                continue
            inside.add(g)
            if len(inside) > MAX_DIAMOND:
                return None
            stack += [p for p in self.producers(g) if p != entry]
            if not self.producers(g):
                return None  # a path that does not come from the entry
        for g in inside:
            if (not self.producers(g) <= inside | {entry}
                    or not self.consumers(g) <= inside | {exit_}):
                return None
        return sorted(inside, key=self.position)

    def commit(self, parts: list[int], pattern: str, reason: str | None) -> bool:
        first = "+".join(o.id for o in self.ordered(self.groups[parts[0]]))
        second = "+".join(o.id for o in self.ordered(
            frozenset().union(*(self.groups[g] for g in parts[1:]))))
        decision = Decision(first, second, reason is None,
                            f"{pattern} merge" if reason is None else reason)
        if decision not in self.seen:
            self.seen.add(decision)
            self.decisions.append(decision)
        if reason is not None:
            return False
        keep = parts[0]
        merged = frozenset().union(*(self.groups[g] for g in parts))
        for g in parts[1:]:
            del self.groups[g]
        self.groups[keep] = merged
        self.group_of.update((i, keep) for i in merged)
        return True


# --- §3.3 instances and their order ---------------------------------------------------------

def instances(graph: Graph, op_ids: tuple[str, ...], split: Split | None) -> int:
    """A split stage runs `parts` instances per index of the outer dimensions every op carries
    (per image, for a split of rows)."""
    if split is None:
        return 1
    ops = [graph.op_by_id[i] for i in op_ids]
    out = graph.tensors[ops[-1].outputs[0]].shape
    members = set(op_ids)
    common = frozenset(range(split.dim)).intersection(
        *(carried_dims(graph, op, members) for op in ops))
    return max(1, split.parts * math.prod(out[k] for k in common))  # an empty tensor: one


Instance = tuple[str, int]  # (block id, instance number)


def instance_graph(plan: FusionPlan, stages: dict[str, StagePlan]) -> dict[Instance, set[Instance]]:
    """Every instance with the instances it reads from: instance j of a stage depends on the
    instances of a producer stage whose share of the data overlaps its own; the edges to the
    other instances are redundant and dropped (§3.3)."""
    graph, producers = plan.graph, {}
    for block in plan.blocks:
        n = stages[block.id].instances
        feeding = {plan.block_of[p.id] for i in block.op_ids
                   for p in graph.predecessors(graph.op_by_id[i])} - {block.id}
        for j in range(n):
            producers[(block.id, j)] = {(b, k) for b in feeding
                                        for k in overlapping(j, n, stages[b].instances)}
    return producers


def overlapping(j: int, parts_j: int, parts_k: int) -> range:
    """The shares k of `parts_k` that overlap share j of `parts_j` of one extent, the overlap
    condition k·parts_j < (j+1)·parts_k and j·parts_k < (k+1)·parts_j solved for k (a stage of
    many instances then costs its edges, not the product of two stages' instances)."""
    return range(j * parts_k // parts_j, -(-(j + 1) * parts_k // parts_j))


def instance_order(producers: dict[Instance, set[Instance]], depth_first: bool) -> list[Instance]:
    """Algorithm 3: instances become ready when their last producer instance has run; the next
    to run is the last ready one (depth first) or the first (breadth first)."""
    indegree = {i: len(p) for i, p in producers.items()}
    consumers: dict[Instance, list[Instance]] = {i: [] for i in producers}
    for inst, sources in producers.items():
        for p in sources:
            consumers[p].append(inst)
    ready = deque(i for i in producers if indegree[i] == 0)
    order: list[Instance] = []
    while ready:
        chosen = ready.pop() if depth_first else ready.popleft()
        order.append(chosen)
        for c in consumers[chosen]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    return order


def live_instance_bytes(producers: dict[Instance, set[Instance]], share: dict[str, int],
                        order: list[Instance]) -> int:
    """The most bytes of instance outputs alive at once in `order`: an instance's share of its
    stage's outputs lives until every instance reading it has run."""
    readers: dict[Instance, int] = {i: 0 for i in producers}
    for sources in producers.values():
        for p in sources:
            readers[p] += 1
    live = peak = 0
    for inst in order:
        live += share[inst[0]]
        peak = max(peak, live)
        for p in producers[inst]:
            readers[p] -= 1
            if readers[p] == 0:
                live -= share[p[0]]
        if readers[inst] == 0:
            live -= share[inst[0]]
    return peak


def choose_order(plan: FusionPlan, stages: dict[str, StagePlan]) -> dict[str, Any]:
    """Breadth first and depth first orders of the instances; the one keeping fewer bytes live
    is chosen (§3.3)."""
    producers = instance_graph(plan, stages)
    share = {b.id: sum(plan.graph.tensors[t].nbytes for t in b.outputs) // stages[b.id].instances
             for b in plan.blocks}
    live = {name: live_instance_bytes(producers, share, instance_order(producers, depth))
            for name, depth in (("breadth first", False), ("depth first", True))}
    return {"chosen": min(live, key=lambda name: (live[name], name)), "live_bytes": live,
            "instances": len(producers)}


# --- §3.4 / §4.3 scopes ---------------------------------------------------------------------------

def stage_plan(graph: Graph, block_id: str, op_ids: tuple[str, ...], outputs: tuple[str, ...],
               hw: Hardware) -> StagePlan:
    ops = [graph.op_by_id[i] for i in op_ids]
    split = best_split(split_info(graph, ops, hw.local_bytes))
    peak = peak_bytes(graph, ops)
    count = instances(graph, op_ids, split)
    internal = [t for op in ops for t in op.outputs if t not in outputs]
    scopes = {t: "memory" for t in outputs}
    windows = None
    if (split is not None and split.dim == ROW_DIM and split.parts > 1
            and any(is_row_conv(graph, op) for op in ops)):
        windows = row_windows(graph, op_ids, outputs, split.parts)
    if windows is None:
        for t in internal:
            scopes[t] = _whole_scope(graph, t, hw)
        return StagePlan(block_id, split, peak, count, scopes=scopes)
    kept = kept_tensors(graph, op_ids, outputs)
    if not kept:  # nothing to stitch between layers: the usual lowering runs the stage
        scopes |= {t: "register" for t in internal}
        return StagePlan(block_id, split, peak, count, scopes=scopes)
    live = kept_liveness(graph, op_ids, outputs, kept)
    buffers = [(t, _window_bytes(graph, windows[t]), *live[t]) for t in kept]
    placed = allocate(buffers, hw.capacities)
    scopes |= {t: "register" for t in internal}
    scopes |= {p.tensor: p.scope for p in placed if p.tensor not in outputs}
    shown = [t for t in windows if t in kept or t in outputs]
    return StagePlan(block_id, split, peak, count, tuple(windows[t] for t in shown),
                     tuple(placed), scopes)


def _window_bytes(graph: Graph, window: Window) -> int:
    t = graph.tensors[window.tensor]
    return t.nbytes // (t.shape[0] * t.shape[ROW_DIM]) * window.rows


def _whole_scope(graph: Graph, tensor: str, hw: Hardware) -> str:
    """An intermediate of a stage not cut: in registers when only elementwise ops read it (the
    lowering computes it inside their expressions or in its producer's epilogue), else a whole
    buffer, scoped by the fastest level it fits."""
    if all(c.mapping == MappingType.ONE_TO_ONE for c in graph.consumers(tensor)):
        return "register"
    return scope_of_bytes(graph.tensors[tensor].nbytes, hw.capacities)


# --- the partitioner ------------------------------------------------------------------------------

@register_partitioner("graphturbo")
class GraphTurbo:
    """Partitioner `graphturbo`: GraphTurbo's stages sized to the per-core L2, run tile by tile."""

    name = "graphturbo"

    def __init__(self, hardware: Hardware | None = None):
        self.hardware = hardware or Hardware.for_host()

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        grouping = _Grouping(graph, self.hardware)
        groups = grouping.run()
        plan = build_plan(graph, groups, self.name, grouping.decisions)
        stages = {b.id: stage_plan(plan.graph, b.id, b.op_ids, b.outputs, self.hardware)
                  for b in plan.blocks}
        return replace(plan, stages=stages, notes={"instance order": choose_order(plan, stages)})
