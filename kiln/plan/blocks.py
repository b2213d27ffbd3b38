"""Turning groups of ops into blocks, ordering blocks, and checking that a plan is valid."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from kiln.ecg import Graph, Op
from kiln.errors import PlanError
from kiln.mapping import MappingType, fuse_types
from kiln.plan import Block, Decision, Edge, FusionPlan

MAX_NAME_OPS = 6


def fused_mapping(ops: Sequence[Op]) -> MappingType:
    """The mapping type of a fused op: Table 3's result cells, composed in topological order."""
    mapping = ops[0].mapping
    for op in ops[1:]:
        mapping = fuse_types(mapping, op.mapping)[0]
    return mapping


def kernel_name(ops: Sequence[Op]) -> str:
    types = list(dict.fromkeys(op.op_type.lower() for op in ops))
    if len(ops) == 1:
        return types[0]
    shown = types[:MAX_NAME_OPS] + (["etc"] if len(types) > MAX_NAME_OPS else [])
    return "fused_" + "_".join(shown)


def make_block(graph: Graph, op_ids: Iterable[str], index: int) -> Block:
    members = set(op_ids)
    ops = sorted((graph.op_by_id[i] for i in members), key=lambda op: graph.order[op.id])
    produced = {t for op in ops for t in op.outputs}
    model_outputs = set(graph.outputs)
    inputs = list(dict.fromkeys(t for op in ops for t in op.present_inputs() if t not in produced))
    outputs = [t for op in ops for t in op.outputs
               if t in model_outputs or any(c.id not in members for c in graph.consumers(t))]
    edges = tuple(
        Edge(t, op.id, consumer.id, consumer.mapping)
        for op in ops for t in op.outputs for consumer in graph.consumers(t) if consumer.id in members)
    activations = [t for t in inputs if not graph.is_constant(t)]
    is_view = len(activations) == 1 and all(op.mapping == MappingType.REORGANIZE for op in ops)
    anchors = [op for op in ops if op.mapping == MappingType.MANY_TO_MANY]
    anchor = next((op for op in anchors if op.compute_intensive), anchors[0] if anchors else None)
    return Block(
        id=f"b{index}", name=kernel_name(ops), op_ids=tuple(op.id for op in ops),
        mapping=fused_mapping(ops), anchor=anchor.id if anchor else None,
        inputs=tuple(inputs), outputs=tuple(outputs), edges=edges, is_view=is_view)


def order_groups(graph: Graph, groups: Sequence[Iterable[str]]) -> list[list[str]]:
    """Sort groups of ops topologically (ties by their first op); raise if they form a cycle."""
    groups = [sorted(g, key=graph.order.__getitem__) for g in groups]
    group_of = {op_id: gi for gi, g in enumerate(groups) for op_id in g}
    needs: list[set[int]] = [set() for _ in groups]
    for gi, g in enumerate(groups):
        for op_id in g:
            for pred in graph.predecessors(graph.op_by_id[op_id]):
                if group_of[pred.id] != gi:
                    needs[gi].add(group_of[pred.id])
    done: set[int] = set()
    ordered: list[int] = []
    waiting = sorted(range(len(groups)), key=lambda gi: graph.order[groups[gi][0]])
    while waiting:
        ready = next((gi for gi in waiting if needs[gi] <= done), None)
        if ready is None:
            stuck = ", ".join(graph.op_by_id[groups[gi][0]].op_type for gi in waiting[:5])
            raise PlanError(f"fusion plan is cyclic: blocks starting with {stuck} depend on each other")
        waiting.remove(ready)
        done.add(ready)
        ordered.append(ready)
    return [groups[gi] for gi in ordered]


def build_plan(graph: Graph, groups: Sequence[Iterable[str]], partitioner: str,
               decisions: Sequence[Decision] = (), yellow_lookups: int = 0) -> FusionPlan:
    ordered = order_groups(graph, groups)
    block_of = {op_id: f"b{bi}" for bi, g in enumerate(ordered) for op_id in g}
    marked = graph.with_ops(_mark_ir_removable(graph, block_of))
    blocks = tuple(make_block(marked, g, bi) for bi, g in enumerate(ordered))
    plan = FusionPlan(marked, blocks, partitioner, tuple(decisions), yellow_lookups, block_of)
    validate(plan)
    return plan


def _mark_ir_removable(graph: Graph, block_of: dict[str, str]) -> list[Op]:
    outs = set(graph.outputs)
    marked = []
    for op in graph.ops:
        removable = all(t not in outs and graph.consumers(t)
                        and all(block_of[c.id] == block_of[op.id] for c in graph.consumers(t))
                        for t in op.outputs)
        marked.append(replace(op, ir_removable=removable))
    return marked


def validate(plan: FusionPlan) -> None:
    """Every op in exactly one block, blocks in an order that respects every dependency."""
    graph = plan.graph
    seen: dict[str, str] = {}
    for block in plan.blocks:
        for op_id in block.op_ids:
            if op_id in seen:
                raise PlanError(f"op {op_id} is in blocks {seen[op_id]} and {block.id}")
            seen[op_id] = block.id
    missing = [op.id for op in graph.ops if op.id not in seen]
    if missing:
        raise PlanError(f"ops not in any block: {', '.join(missing[:10])}")
    position = {b.id: i for i, b in enumerate(plan.blocks)}
    for block in plan.blocks:
        for op_id in block.op_ids:
            for pred in graph.predecessors(graph.op_by_id[op_id]):
                if position[seen[pred.id]] > position[block.id]:
                    raise PlanError(f"block {block.id} runs before block {seen[pred.id]}, "
                                    f"which it depends on: the plan is cyclic")
