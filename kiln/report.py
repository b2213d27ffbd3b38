"""The fusion report: what the compiler did to a model, as JSON and as a readable table."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph
from kiln.plan import FusionPlan

if TYPE_CHECKING:
    from kiln.rewrite import RewriteResult


def fusion_report(graph: Graph, plan: FusionPlan, seconds: dict[str, float],
                  onnx_nodes: int, rewrite: "RewriteResult | None" = None) -> dict[str, Any]:
    """`graph` is the frontend's ECG (the *_before counts describe it); `plan` partitions the
    graph after rewriting, whose rules and FLOPs `rewrite` gives (None: no rewriting)."""
    cil = sum(1 for op in graph.ops if op.compute_intensive)
    refusals = Counter(d.reason.split(":")[0] for d in plan.decisions if not d.fused)
    return {
        "model": graph.name,
        "partitioner": plan.partitioner,
        "onnx_nodes": onnx_nodes,
        "ops_before": len(graph.ops),
        "cil_before": cil,
        "mil_before": len(graph.ops) - cil,
        "kernels": plan.kernels,
        "fusion_rate": round(len(graph.ops) / plan.kernels, 3) if plan.kernels else 0.0,
        "irs_bytes_before": graph.irs_bytes,
        "irs_bytes_after": plan.irs_bytes,
        "yellow_lookups": plan.yellow_lookups,
        "rules_fired": dict(rewrite.rules_fired) if rewrite else {},
        "flops_before": rewrite.flops_before if rewrite else graph.total_flops,
        "flops_after": rewrite.flops_after if rewrite else graph.total_flops,
        "refusals": dict(sorted(refusals.items())),
        "seconds": {stage: round(s, 4) for stage, s in seconds.items()},
        "blocks": [{"id": b.id, "name": b.name, "ops": len(b.op_ids), "mapping": b.mapping.label,
                    "anchor": b.anchor} | _planned_schedule(plan, b.id) for b in plan.blocks],
        "graph": plan_graph(plan),
    } | plan_stages(plan)


def _planned_schedule(plan: FusionPlan, block: str) -> dict[str, Any]:
    """The schedule overrides the partitioner chose for a block (FusionStitching: its blocks and
    sched_type), or nothing."""
    chosen = plan.schedules.get(block)
    if not chosen:
        return {}
    stitched = {"sched_type": Schedule().merged(chosen).stitch_type} if "stitch_blocks" in chosen \
        else {}
    return {"schedule": dict(chosen) | stitched}


def plan_stages(plan: FusionPlan) -> dict[str, Any]:
    """What the partitioner decided beyond the cut, when it says (GraphTurbo: per block its
    split, instances and the scope of every tensor; the instance order), else nothing."""
    if not plan.stages and not plan.notes:
        return {}
    return {"stages": {block: stage.to_json() for block, stage in plan.stages.items()},
            "plan_notes": dict(plan.notes)}


def plan_graph(plan: FusionPlan) -> dict[str, Any]:
    """The plan as a graph: ops (nodes) in blocks, the tensors between ops (edges; `internal` when
    both ends are in one block, so no buffer holds it), every fusion decision with its reason, and
    each block's kernel signature (the key of its profile entries; None for views) with the
    canonical description it hashes."""
    from kiln.signature import signed_description

    graph = plan.graph
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    ops = [{"id": op.id, "type": op.op_type, "name": op.source_name, "mapping": op.mapping.label,
            "block": plan.block_of.get(op.id)} for op in graph.ops]
    edges = [{"from": producer[t], "to": op.id, "tensor": t, "bytes": graph.tensors[t].nbytes,
              "internal": plan.block_of.get(producer[t]) == plan.block_of.get(op.id)}
             for op in graph.ops for t in dict.fromkeys(op.present_inputs()) if t in producer]
    blocks = []
    for b in plan.blocks:
        signature, description = (None, None) if b.is_view else signed_description(graph, b.op_ids)
        blocks.append({"id": b.id, "name": b.name, "mapping": b.mapping.label, "anchor": b.anchor,
                       "view": b.is_view, "ops": list(b.op_ids), "signature": signature,
                       "description": description})
    decisions = [{"first": d.first, "second": d.second, "fused": d.fused, "reason": d.reason}
                 for d in plan.decisions]
    return {"ops": ops, "edges": edges, "blocks": blocks, "decisions": decisions}


def format_report(report: dict[str, Any]) -> str:
    mib = 1 << 20
    rows = [
        ("model", report["model"]),
        ("partitioner", report["partitioner"]),
        ("ONNX nodes", report["onnx_nodes"]),
        ("ops before (CIL / MIL)", f"{report['ops_before']} ({report['cil_before']} / "
                                   f"{report['mil_before']})"),
        ("kernels after", report["kernels"]),
        ("fusion rate", f"{report['fusion_rate']:.2f}x"),
        ("intermediate results", f"{report['irs_bytes_before'] / mib:.1f} MiB -> "
                                 f"{report['irs_bytes_after'] / mib:.1f} MiB"),
        ("yellow lookups", report["yellow_lookups"]),
        ("rewrite rules fired", f"{sum(report['rules_fired'].values())} "
                                f"({len(report['rules_fired'])} distinct)"),
        ("FLOPs", _flops_change(report["flops_before"], report["flops_after"])),
    ]
    rows += [(f"seconds: {stage}", f"{s:.3f}") for stage, s in report["seconds"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _flops_change(before: int, after: int) -> str:
    change = f" ({(after - before) / before:+.1%})" if before else ""
    return f"{before:,} -> {after:,}{change}"
