"""Where the unfused time goes, and how much any fusion could save of it.

For each full-size zoo model, the artifacts built with partitioner none and with dnnfusion run in
the runner (a process of their own, 2 threads) with per-kernel timing. Every kernel is counted as
compute-intensive when its block holds a contraction (MatMul, Gemm, Conv, Einsum, LSTM/GRU/RNN:
the ops Table 5 of DNNFusion calls CIL) and as memory-intensive otherwise. Fusion removes
memory-intensive kernels by folding them into others; it does not make a contraction cheaper
(a fused contraction does the same multiply-adds plus its epilogue). So the unfused build's
compute-intensive time is a floor for any fused build, and

    ceiling = none total / none compute-intensive

bounds none/dnnfusion for that model on this machine. Prints both builds' split, the measured
none/dnnfusion (end-to-end medians of the runner) and the ceiling, with geomeans.

It also prints fusion's share of what is removable (issue 13's restated fusion target): where the
removable time, none − none's CIL time, is at least 5 % of none,

    share = (none − dnnfusion) / (none − none's CIL time)

and whether it reaches 0.75. Below 5 % the share is noise over a small difference and is shown
as "-".

    python bench/fusion_ceiling.py [--models bert-base,resnet50] [--runs 20] [--threads 2]
                                   [--keep DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import (BenchModel, bench_models, kiln_artifact, work_folder,  # noqa: E402
                           zoo_arguments)
from kiln.ops import op_info  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.execute import run_runner  # noqa: E402

PARTITIONERS = ("none", "dnnfusion")
MIN_REMOVABLE = 0.05  # of none's time: below it, the share is not counted
TARGET_SHARE = 0.75


def fusion_share(none: float, none_cil: float, dnnfusion: float) -> float | None:
    """(none − dnnfusion) / (none − none's CIL time), or None where that removable time is
    under `MIN_REMOVABLE` of none."""
    removable = none - none_cil
    if removable < MIN_REMOVABLE * none:
        return None
    return (none - dnnfusion) / removable


def split_ms(timing: dict, plan: dict) -> tuple[float, float, float]:
    """(end-to-end median, compute-intensive kernels, memory-intensive kernels), in ms."""
    contracting = {b["id"] for b in plan["blocks"]
                   if any(op_info(o["type"]).compute_intensive for o in b["ops"])}
    compute = memory = 0.0
    for kernel in timing["kernels"]:
        if kernel["block"] in contracting:
            compute += kernel["median_ns"]
        else:
            memory += kernel["median_ns"]
    return timing["latency_ns"]["median"] / 1e6, compute / 1e6, memory / 1e6


def measure(model: BenchModel, work: Path, runs: int,
            threads: int) -> dict[str, tuple[float, float, float]]:
    artifacts = {}
    for partitioner in PARTITIONERS:
        out = kiln_artifact(model, partitioner, work)
        artifacts[partitioner] = open_artifact(out, work / "extracted" / out.stem)
    splits: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PARTITIONERS}
    for half in range(2):  # two alternating halves, so drift on the machine hits both builds
        for partitioner in PARTITIONERS if half == 0 else PARTITIONERS[::-1]:
            artifact = artifacts[partitioner]
            timing = run_runner(artifact, model.inputs, runs, 3, threads, keep_outputs=False).timing
            splits[partitioner].append(split_ms(timing, artifact.plan))
    return {p: tuple(min(s[i] for s in got) for i in range(3)) for p, got in splits.items()}


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    header = (f"{'model':16s} {'none ms':>8s} {'CIL ms':>8s} {'MIL ms':>8s} {'MIL%':>5s} | "
              f"{'dnnf ms':>8s} {'CIL ms':>8s} {'MIL ms':>8s} | {'none/dnnf':>9s} {'ceiling':>8s} "
              f"{'share':>6s} {'>=' + format(TARGET_SHARE, 'g'):>6s}")
    rows, measured, ceilings, verdicts = [], [], [], []
    with work_folder(args.keep, "kiln-ceiling-") as work:
        for model in bench_models(args):
            name = model.name
            got = measure(model, work, args.runs, args.threads)
            (none, none_ci, none_mi), (dnnf, dnnf_ci, dnnf_mi) = got["none"], got["dnnfusion"]
            measured.append(none / dnnf)
            ceilings.append(none / none_ci)
            share = fusion_share(none, none_ci, dnnf)
            verdict = "-" if share is None else "yes" if share >= TARGET_SHARE else "NO"
            verdicts.append(verdict)
            rows.append(f"{name:16s} {none:8.2f} {none_ci:8.2f} {none_mi:8.2f} "
                        f"{100 * none_mi / none:4.0f}% | {dnnf:8.2f} {dnnf_ci:8.2f} {dnnf_mi:8.2f} | "
                        f"{measured[-1]:9.2f} {ceilings[-1]:8.2f} "
                        f"{'-' if share is None else format(share, '.2f'):>6s} {verdict:>6s}")
            print(rows[-1], file=sys.stderr)
    print(f"runner medians (best of two alternating halves), {args.threads} threads, "
          f"{args.runs} runs; CIL = kernels holding a contraction, MIL = the rest")
    print(header)
    print("\n".join(rows))
    print(f"geomean none/dnnfusion measured {statistics.geometric_mean(measured):.2f}, "
          f"ceiling (none / its CIL time) {statistics.geometric_mean(ceilings):.2f}")
    counted = [v for v in verdicts if v != "-"]
    print(f"fusion share >= {TARGET_SHARE:g} on {counted.count('yes')} of {len(counted)} model(s) "
          f"whose removable time is >= {MIN_REMOVABLE:.0%} of none "
          f"({len(verdicts) - len(counted)} below)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
