"""Partitioner `none`: one kernel per op (the paper's OurB baseline)."""
from __future__ import annotations

from kiln.ecg import Graph
from kiln.plan import FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.profile import ProfileStore


@register_partitioner("none")
class NoFusion:
    name = "none"

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        return build_plan(graph, [[op.id] for op in graph.ops], self.name)
