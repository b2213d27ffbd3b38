"""Partitioner `fixed`: TVM-style fixed patterns (the paper's OurB+ baseline).

Ops are sorted into pattern kinds as TVM's OpPatternKind does. A compute-intensive anchor absorbs
the chain of elementwise/broadcast ops that follows it (its epilogue); chains of elementwise,
broadcast and injective (pure data movement) ops fuse together; reductions and opaque ops stay
alone. A link in a chain is a tensor with a single consumer whose other inputs are ready.
"""
from __future__ import annotations

from kiln.ecg import Graph, Op
from kiln.ops import Pattern, op_info
from kiln.plan import FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.profile import ProfileStore


def pattern_of(op: Op) -> Pattern:
    return op_info(op.op_type).pattern


# What may follow a group started by an op of each kind.
CHAIN_FOLLOWERS = {
    Pattern.ANCHOR: {Pattern.ELEMWISE, Pattern.BROADCAST},
    Pattern.ELEMWISE: {Pattern.ELEMWISE, Pattern.BROADCAST, Pattern.INJECTIVE},
    Pattern.BROADCAST: {Pattern.ELEMWISE, Pattern.BROADCAST, Pattern.INJECTIVE},
    Pattern.INJECTIVE: {Pattern.ELEMWISE, Pattern.BROADCAST, Pattern.INJECTIVE},
}


@register_partitioner("fixed")
class FixedPatterns:
    name = "fixed"

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        assigned: set[str] = set()
        groups = []
        for op in graph.ops:
            if op.id in assigned:
                continue
            group = self._chain(graph, op, assigned)
            assigned.update(group)
            groups.append(group)
        return build_plan(graph, groups, self.name)

    def _chain(self, graph: Graph, start: Op, assigned: set[str]) -> list[str]:
        group = [start.id]
        followers = CHAIN_FOLLOWERS.get(pattern_of(start), set())
        current = start
        while followers:
            nxt = _single_consumer(graph, current)
            if (nxt is None or nxt.id in assigned or pattern_of(nxt) not in followers
                    or not _inputs_ready(graph, nxt, assigned, group)):
                break
            group.append(nxt.id)
            current = nxt
        return group


def _single_consumer(graph: Graph, op: Op) -> Op | None:
    if len(op.outputs) != 1 or op.outputs[0] in graph.outputs:
        return None
    consumers = graph.consumers(op.outputs[0])
    return consumers[0] if len(consumers) == 1 else None


def _inputs_ready(graph: Graph, op: Op, assigned: set[str], group: list[str]) -> bool:
    return all(p.id in assigned or p.id in group for p in graph.predecessors(op))
