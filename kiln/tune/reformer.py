"""AGO's reformer layer (§V): divide-and-conquer tuning of complicated subgraphs.

A subgraph with several complex ops has a large schedule space. The reformer

1. SPLITs each such subgraph of the plan with CLUSTER (`kiln.plan.ago.cluster`, run on the
   subgraph alone with at most one complex op per part) into mini-subgraphs;
2. tunes the plan of mini-subgraphs with the ordinary tuner (`tune_plan`), which measures them
   and records every measurement in the ProfileStore (`split_share` of the budget);
3. JOINs: the minis' best schedules are composed into one schedule per subgraph — a parameter
   both set differently takes the value of the mini the store's cost model estimates slowest,
   where most of the time goes — and the subgraph is tuned from there: the joined schedule is
   one of its first candidates (`tune_plan(initial=...)`) next to the default, so the second
   round starts from what the parts learnt instead of from scratch.

Simple subgraphs (at most one complex op) are not split: the second round tunes them directly.
The paper joins when the parts' tuning "tends to stabilize"; Kiln's tuner already stops a
block's search when a generation brings nothing new, so the join follows the first round.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.ecg import Graph
from kiln.mapping import MappingType
from kiln.measure.farm import Farm
from kiln.plan import Block, FusionPlan
from kiln.plan.ago import Settings, cluster, default_weights
from kiln.plan.blocks import build_plan
from kiln.profile import ProfileStore
from kiln.target import Target
from kiln.tune.modes import DEFAULT_BUDGET_S, check_budget
from kiln.tune.search import ProgressCallback, TuneResult, tune_plan

SPLIT_SHARE = 0.5


def is_complicated(graph: Graph, block: Block) -> bool:
    ops = [graph.op_by_id[i] for i in block.op_ids]
    return sum(op.mapping == MappingType.MANY_TO_MANY and op.compute_intensive for op in ops) > 1


def split(graph: Graph, block: Block, store: ProfileStore) -> list[list[str]]:
    """SPLIT: CLUSTER on the subgraph alone, at most one complex op per mini-subgraph."""
    members = set(block.op_ids)
    ops = [op for op in graph.ops if op.id in members]
    produced = {t for op in ops for t in op.outputs}
    inputs = [t for t in block.inputs if t not in produced]
    sub = Graph(graph.tensors, ops, inputs, block.outputs, graph.opset, graph.name)
    settings = Settings(max_complex=1)
    return cluster(sub, default_weights(store, settings), settings)


def join(schedules: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """JOIN: one schedule from the parts' (estimated seconds, best overrides); on a conflict the
    slowest part's value wins."""
    joined: dict[str, Any] = {}
    for _, overrides in sorted(schedules, key=lambda s: s[0]):
        joined.update(overrides)
    return joined


def tune_by_parts(plan: FusionPlan, target: Target, store: ProfileStore, mode: str = "quick",
                  budget_s: float | None = None, threads: int | None = None,
                  log: Callable[[str], None] | None = None,
                  on_progress: ProgressCallback | None = None, farm: Farm | None = None) -> TuneResult:
    """`tune_plan`'s contract (same arguments, same result), by split, tune and join."""
    budget = check_budget(budget_s) or DEFAULT_BUDGET_S.get(mode, 0.0)
    graph = plan.graph
    parts: dict[str, list[list[str]]] = {}
    for block in plan.blocks:
        parts[block.id] = split(graph, block, store) if is_complicated(graph, block) else []
    if mode in ("off", "reuse") or not any(parts.values()):  # reuse measures nothing to split
        return tune_plan(plan, target, store, mode, budget_s, threads, log, on_progress, farm)
    groups = [p for block in plan.blocks for p in (parts[block.id] or [list(block.op_ids)])]
    minis = build_plan(graph, groups, f"{plan.partitioner} (split)")
    first = tune_plan(minis, target, store, mode, budget * SPLIT_SHARE, threads, log, on_progress,
                      farm)
    model = store.fallback or store
    mini_of = {b.op_ids[0]: b for b in minis.blocks}
    initial: dict[str, dict[str, Any]] = {}
    for block in plan.blocks:
        tuned = []
        for part in parts[block.id]:
            mini = mini_of[min(part, key=graph.order.__getitem__)]
            if first.block_schedules.get(mini.id):
                seconds = model.latency(graph, list(mini.op_ids)).seconds
                tuned.append((seconds, first.block_schedules[mini.id]))
        if tuned:
            initial[block.id] = join(tuned)
    spent = float(first.report.get("seconds", 0.0))
    second = tune_plan(plan, target, store, mode, max(budget - spent, 1e-3), threads, log,
                       on_progress, farm, initial=initial)
    report = dict(second.report)
    report["reformer"] = {
        "split": {b: len(p) for b, p in parts.items() if p},
        "parts_measured": first.measured, "parts_reused": first.reused,
        "joined": initial, "seconds": spent}
    report["measured"] = second.measured + first.measured
    report["reused"] = second.reused + first.reused
    return TuneResult(second.block_schedules, report)
