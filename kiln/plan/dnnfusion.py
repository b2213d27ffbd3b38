"""Partitioner `dnnfusion`: DNNFusion's seed-based fusion plan generation (§4.3, Listing 1).

Seeds are One-to-One ops, smallest intermediate result first. From a seed the block grows along
successors, then predecessors; each candidate passes Table 3's mapping check (red stops, green
fuses, yellow asks the ProfileStore whether latency(block+op) beats latency(block)+latency(op)),
a legality check (the block must not form a cycle with the rest of the graph) and the constraint
check below. When no One-to-One seed is left, the remaining ops seed blocks in order of increasing
mapping-type complexity, so that for example a MatMul still absorbs a following Reshape/Transpose.

Constraints (chosen for 2-thread CPUs with AVX2's 16 vector registers and 1–2 MB of L2):
  * at most 16 values live at once while a block's data-flow tree is evaluated, so a vectorised
    fused loop keeps its temporaries in the 16 ymm registers instead of spilling;
  * at most 16 tensors read from outside (pointer arguments and streams a loop can prefetch);
  * at most 48 ops, which bounds generated-code size and compile time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType, Verdict, fuse_types
from kiln.ops import op_info
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.profile import ProfileStore


@dataclass(frozen=True)
class Constraints:
    max_ops: int = 48
    max_live_values: int = 16
    max_inputs: int = 16


@register_partitioner("dnnfusion")
class DNNFusion:
    name = "dnnfusion"

    def __init__(self, constraints: Constraints = Constraints()):
        self.constraints = constraints

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
        self.block: set[str] = set()
        self.mapping = MappingType.ONE_TO_ONE
        self._latency: dict[frozenset[str], float] = {}

    def run(self, name: str) -> FusionPlan:
        while (seed := self.next_seed()) is not None:
            self.block, self.mapping = {seed.id}, seed.mapping
            if not _is_opaque(seed):
                for successor in self.graph.successors(seed):
                    self.fuse_successor(successor)
                for predecessor in self.graph.predecessors(seed):
                    self.fuse_predecessor(predecessor)
            self.assigned |= self.block
            self.group_of.update((op_id, len(self.groups)) for op_id in self.block)
            self.groups.append(self.block)
        return build_plan(self.graph, self.groups, name, self.decisions, self.yellow_lookups)

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
        if not self.try_add(successor, fused=fuse_types(self.mapping, successor.mapping),
                            creates_cycle=self.path_outside(self.block, {successor.id})):
            return
        for nxt in self.graph.successors(successor):
            self.fuse_successor(nxt)

    def fuse_predecessor(self, predecessor: Op) -> None:
        if not self.try_add(predecessor, fused=fuse_types(predecessor.mapping, self.mapping),
                            creates_cycle=self.path_outside({predecessor.id}, self.block)):
            return
        for nxt in self.graph.predecessors(predecessor):
            self.fuse_predecessor(nxt)

    def try_add(self, op: Op, fused: tuple[MappingType, Verdict], creates_cycle: bool) -> bool:
        if op.id in self.block or op.id in self.assigned:
            return False
        mapping, verdict = fused
        reason = self.refusal(op, mapping, verdict, creates_cycle)
        self.decisions.append(Decision(self.block_label(), op.id, reason is None,
                                       reason or verdict.value))
        if reason is not None:
            return False
        self.block.add(op.id)
        self.mapping = mapping
        return True

    def refusal(self, op: Op, mapping: MappingType, verdict: Verdict,
                creates_cycle: bool) -> str | None:
        if _is_opaque(op):
            return f"red: {op.op_type} is opaque"
        if verdict is Verdict.RED:
            return f"red: {self.mapping.label} + {op.mapping.label}"
        if creates_cycle:
            return "illegal: would create a cycle"
        violated = self.violated_constraint(self.block | {op.id})
        if violated:
            return f"constraint: {violated}"
        if verdict is Verdict.YELLOW and not self.faster_fused(op):
            return "yellow: slower fused"
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
    def faster_fused(self, op: Op) -> bool:
        self.yellow_lookups += 1
        together = self.latency(self.block | {op.id})
        apart = self.latency(self.block) + self.latency({op.id})
        return together <= apart

    def latency(self, members: Iterable[str]) -> float:
        key = frozenset(members)
        if key not in self._latency:
            ordered = sorted(key, key=self.graph.order.__getitem__)
            self._latency[key] = self.store.latency(self.graph, ordered).seconds
        return self._latency[key]

    # Legality ----------------------------------------------------------------------------
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


def _is_opaque(op: Op) -> bool:
    return op_info(op.op_type).opaque


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
