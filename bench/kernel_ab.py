"""Artifacts of one model side by side, kernel by kernel: an A/B of two builds (a branch against
main, dnnfusion against none) in one process, interleaved.

Each round runs every artifact once untimed for the whole-model figures (wall and CPU time, as
`bench/latency.py` times them: a pause, warm-up calls, then one timed call) and once with the
driver's per-kernel profile on. It prints, per artifact, the median wall and CPU milliseconds
of a run and the sum of its kernels' figures; then, for each kernel of the first artifact, its
figure and the summed figures of the kernels of every other artifact whose ops all lie in its
block (`n`: how many), largest first. A kernel's figure is the median of its rounds, or with
`--stat p10` their 10th percentile, steadier on a machine that other processes load (the
profile times kernels by the wall clock).

    python bench/kernel_ab.py new=/tmp/new.kiln base=/tmp/base.kiln none=/tmp/none.kiln
                              [--threads 2] [--rounds 40] [--stat p10] [--top 30]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import settle_and_warm, tenth_percentile  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.inputs import random_inputs  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402


def figure(values: list[float], stat: str) -> float:
    return tenth_percentile(values) if stat == "p10" else statistics.median(values)


def kernels_of(model: CompiledModel) -> list[tuple[str, frozenset[str]]]:
    """(symbol, op ids of its block) of every kernel, in run order."""
    plan = model.artifact.plan
    blocks = {b["id"]: b for b in plan["blocks"]}
    return [(k["symbol"], frozenset(o["id"] for o in blocks[k["block"]]["ops"]))
            for k in plan["kernels"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", help="LABEL=PATH.kiln, the first the reference")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--stat", choices=("median", "p10"), default="median")
    parser.add_argument("--top", type=int, default=30, help="kernels listed (0: none)")
    args = parser.parse_args()
    models: dict[str, CompiledModel] = {}
    for spec in args.artifacts:
        label, _, path = spec.partition("=")
        models[label] = CompiledModel(open_artifact(path), args.threads)
    first = next(iter(models.values()))
    feeds = list(random_inputs(first.inputs).values())
    reference = first.run(*feeds)
    for label, model in models.items():
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(model.run(*feeds), reference))
        print(f"{label}: max |diff| against {next(iter(models))} {diff:.3g}")
    counts = {label: ctypes.c_int.in_dll(m._lib, "kiln_model_num_kernels").value
              for label, m in models.items()}
    wall = {label: [] for label in models}
    cpu = {label: [] for label in models}
    per_kernel = {label: [[] for _ in range(counts[label])] for label in models}
    labels = list(models)
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            model = models[label]
            settle_and_warm(lambda: model.run(*feeds))
            start, start_cpu = time.perf_counter(), time.process_time()
            model.run(*feeds)
            wall[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
            ns = (ctypes.c_uint64 * counts[label])()
            model._lib.kiln_model_set_profile.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            model._lib.kiln_model_set_profile(model._handle, ns)
            model.run(*feeds)
            model._lib.kiln_model_set_profile(model._handle, None)
            for i, t in enumerate(ns):
                per_kernel[label][i].append(t / 1e6)
    ms = {label: [figure(k, args.stat) for k in per_kernel[label]] for label in models}
    print(f"{args.threads} threads, {args.rounds} interleaved rounds; kernels: {args.stat} ms")
    for label in labels:
        print(f"{label:10s} wall {statistics.median(wall[label]) * 1e3:8.2f} ms  "
              f"cpu {statistics.median(cpu[label]) * 1e3:8.2f} ms  "
              f"kernels {sum(ms[label]):8.2f} ms")
    if not args.top:
        return
    kernels = {label: kernels_of(m) for label, m in models.items()}
    base = labels[0]
    rows = []
    for i, (symbol, ops) in enumerate(kernels[base]):
        row = [symbol[:56], ms[base][i]]
        for label in labels[1:]:
            inside = [j for j, (_, other) in enumerate(kernels[label]) if other <= ops]
            row += [sum(ms[label][j] for j in inside), len(inside)]
        rows.append(row)
    rows.sort(key=lambda row: -row[1])
    print(f"{'kernel of ' + base:56s} {base:>8s}"
          + "".join(f" {label:>8s}  n" for label in labels[1:]))
    for row in rows[:args.top]:
        print(f"{row[0]:56s} {row[1]:8.3f}" + "".join(
            f" {row[2 + 2 * k]:8.3f} {row[3 + 2 * k]:2d}" for k in range(len(labels) - 1)))


if __name__ == "__main__":
    main()
