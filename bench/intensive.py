"""AGO's intensive fusion at kernel level: the blocks where `ago` fused a pair (conv →
depthwise, conv → pointwise, matrix products), timed against what `dnnfusion` runs for the
same ops, and against `ago` with intensive fusion off (the same blocks lowered as separate
stages with a full intermediate).

For each model, three artifacts are built from the same ECG: dnnfusion, ago, and ago with the
schedule parameter `intensive_fusion` off. Their runners are called in rounds, the order
rotating each round and each call after a short pause (as bench/latency.py does); the per-kernel
medians of each call (the runner's `--kernels` figures) give per-round times, and the median over
rounds is reported. Blocks of the two plans that share ops form a *region* (the smallest set of
ops both plans cut along the same boundary); a region is listed when one of ago's blocks in it
has an intensive stage.

    python bench/intensive.py --models /path/mobilenetv2.onnx,/path/efficientnet-b0.onnx
                              [--rounds 7] [--runs 10] [--threads 2] [--top 12]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln import codegen
from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.local import default_store
from kiln.runtime.artifact import build_artifact, open_artifact
from kiln.runtime.execute import run_runner
from kiln.runtime.inputs import random_inputs
from kiln.target import target

VARIANTS = {"dnnfusion": ("dnnfusion", True), "ago": ("ago", True), "ago-off": ("ago", False)}
SETTLE_S = 0.05


def build(model: Path, partitioner: str, intensive: bool, folder: Path, store):
    compiled = compile_model(model, CompileOptions(partitioner=partitioner), store)
    plan = compiled.plan
    schedules = {b.id: {"intensive_fusion": intensive} for b in plan.blocks}
    host = target("host")
    kernels = codegen.generate(plan, host, block_schedules=schedules)
    out = folder / f"{model.stem}-{partitioner}-{'on' if intensive else 'off'}.kiln"
    build_artifact(plan, kernels, host, compiled.report, out)
    return plan, kernels, open_artifact(out)


def regions(plan_a, plan_b) -> list[tuple[set[str], set[str]]]:
    """(blocks of a, blocks of b) of each connected set of blocks sharing ops."""
    owner = {}
    for tag, plan in (("a", plan_a), ("b", plan_b)):
        for block in plan.blocks:
            for op in block.op_ids:
                owner.setdefault(op, []).append((tag, block.id))
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for pair in owner.values():
        for other in pair[1:]:
            parent[find(other)] = find(pair[0])
    found: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for node in list(parent):
        a, b = found.setdefault(find(node), (set(), set()))
        (a if node[0] == "a" else b).add(node[1])
    return list(found.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated .onnx paths")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="regions listed per model")
    args = parser.parse_args()
    store = default_store(":memory:")
    with tempfile.TemporaryDirectory(prefix="kiln-intensive-") as tmp:
        for model in map(Path, args.models.split(",")):
            built = {name: build(model, p, on, Path(tmp), store) for name, (p, on) in VARIANTS.items()}
            inputs = random_inputs(built["ago"][2].inputs)
            per_kernel = {name: {} for name in built}
            latency = {name: [] for name in built}
            names = list(built)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    time.sleep(SETTLE_S)
                    timing = run_runner(built[name][2], inputs, args.runs, 2, args.threads,
                                        keep_outputs=False).timing
                    latency[name].append(timing["latency_ns"]["median"] / 1e6)
                    for k in timing["kernels"]:
                        per_kernel[name].setdefault(k["symbol"], []).append(k["median_ns"] / 1e6)
            ms = {name: {s: statistics.median(v) for s, v in times.items()}
                  for name, times in per_kernel.items()}
            block_ms = {}
            for name, (plan, kernels, _) in built.items():
                block_ms[name] = {k.block_id: ms[name].get(k.symbol, 0.0) for k in kernels}
            report(model, built, block_ms, latency, args)
    print("machine: shared and loaded; ratios of interleaved medians, not absolute times")
    return 0


def report(model, built, block_ms, latency, args) -> None:
    dnn_plan, ago_plan = built["dnnfusion"][0], built["ago"][0]
    intensive = {k.block_id for k in built["ago"][1]
                 if any("intensive" in str(s.get("form")) for s in k.schedule["stages"])}
    graph = ago_plan.graph
    rows = []
    for dnn_blocks, ago_blocks in regions(dnn_plan, ago_plan):
        if not ago_blocks & intensive:
            continue
        ops = [op for b in ago_plan.blocks if b.id in ago_blocks for op in b.op_ids]
        kinds = "+".join(dict.fromkeys(graph.op_by_id[o].op_type for o in ops))
        times = (sum(block_ms["dnnfusion"][b] for b in dnn_blocks),
                 sum(block_ms["ago"][b] for b in ago_blocks),
                 sum(block_ms["ago-off"][b] for b in ago_blocks))
        rows.append((times, len(dnn_blocks), len(ago_blocks), len(ops), kinds))
    rows.sort(key=lambda r: -r[0][0])
    print(f"\n{model.name}: {len(rows)} regions with intensive fusion "
          f"(dnnfusion {dnn_plan.kernels} kernels, ago {ago_plan.kernels})")
    print(f"{'ops':>4s} {'kernels d/a':>11s} {'dnnfusion ms':>12s} {'ago ms':>8s} {'ago-off ms':>10s} "
          f"{'ago/dnn':>8s} {'ago/off':>8s}  op types")
    for (dnn, ago, off), kd, ka, n, kinds in rows[:args.top]:
        print(f"{n:4d} {kd:>5d}/{ka:<5d} {dnn:12.3f} {ago:8.3f} {off:10.3f} {ago / dnn:8.2f} "
              f"{ago / off:8.2f}  {kinds[:60]}")
    totals = [sum(r[0][i] for r in rows) for i in range(3)]
    if rows:
        print(f"{'all':>4s} {'':>11s} {totals[0]:12.3f} {totals[1]:8.3f} {totals[2]:10.3f} "
              f"{totals[1] / totals[0]:8.2f} {totals[1] / totals[2]:8.2f}")
    # the same plan with and without intensive fusion: its blocks that hold a fused pair, one by one
    pairs = sum(1 for k in built["ago"][1] for s in k.schedule["stages"]
                if "intensive" in str(s.get("form")))
    on, off = (sum(block_ms[v][b] for b in intensive) for v in ("ago", "ago-off"))
    if intensive:
        print(f"ago's {len(intensive)} blocks with {pairs} intensive stages: {on:.3f} ms, the same "
              f"blocks with intensive fusion off {off:.3f} ms, on/off {on / off:.2f}")
    med = {name: statistics.median(v) for name, v in latency.items()}
    print("end to end (runner median ms): " + ", ".join(f"{n} {v:.2f}" for n, v in med.items())
          + f"; ago/dnnfusion {med['ago'] / med['dnnfusion']:.2f}, ago/ago-off "
          f"{med['ago'] / med['ago-off']:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
