"""Kiln's kernels against OpenVINO's layers of the same ops, interleaved: where a model loses.

For each model, the dnnfusion artifact runs with the driver's per-kernel profile and OpenVINO
with `PERF_COUNT`, alternately, each call after a pause and warm-up calls
(`bench.latency.settle_and_warm`). A kernel is matched with the OpenVINO layers whose names start
with the name of an op of its block or of one of the op's outputs (OpenVINO names a layer after
the op or output it comes from, a suffix added where it splits one, e.g. `…/Conv/WithoutBiases`).
Figures are each layer's 10th percentile over the rounds, steadier than the median on a loaded
machine. OpenVINO's profile adds its own overhead per layer, so its layers are scaled so that
their sum relates to its wall time as Kiln's kernels' sum does to Kiln's. Printed: the kernels
Kiln loses most time on, then those it gains most on.

    python bench/peer_layers.py [--models resnet50,my.onnx] [--rounds 25] [--top 15] [--keep DIR]
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_ab import figure  # noqa: E402
from bench.latency import (BenchModel, bench_models, kiln_artifact,  # noqa: E402
                           settle_and_warm, work_folder, zoo_arguments)
from bench.peers import openvino_request  # noqa: E402
from kiln.runtime.loader import load  # noqa: E402


def timed(call: Callable[[], object]) -> float:
    """Seconds of one call after `settle_and_warm`."""
    settle_and_warm(call)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def compare(model: BenchModel, work: Path, threads: int, rounds: int) -> list[tuple]:
    """(Kiln ms, OpenVINO ms scaled, layers matched, kernel) per kernel, and the wall medians."""
    compiled = load(kiln_artifact(model, "dnnfusion", work), threads)
    feeds = model.inputs
    request = openvino_request(model.path, feeds, threads, perf_count=True)
    count = ctypes.c_int.in_dll(compiled._lib, "kiln_model_num_kernels").value
    compiled._lib.kiln_model_set_profile.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    kernel_ms: list[list[float]] = [[] for _ in range(count)]
    layer_ms: dict[str, list[float]] = collections.defaultdict(list)
    wall = {"kiln": [], "ov": []}
    for _ in range(rounds):
        wall["ov"].append(timed(lambda: request.infer(feeds)))
        for layer in request.profiling_info:
            if layer.status == layer.Status.EXECUTED:
                layer_ms[layer.node_name].append(layer.real_time.total_seconds() * 1e3)
        wall["kiln"].append(timed(lambda: compiled.run(**feeds)))
        ns = (ctypes.c_uint64 * count)()
        compiled._lib.kiln_model_set_profile(compiled._handle, ns)
        compiled.run(**feeds)
        compiled._lib.kiln_model_set_profile(compiled._handle, None)
        for i, t in enumerate(ns):
            kernel_ms[i].append(t / 1e6)
    kiln_sum = sum(figure(v, "p10") for v in kernel_ms)
    ov_sum = sum(figure(v, "p10") for v in layer_ms.values())
    scale = (statistics.median(wall["ov"]) / ov_sum) / (statistics.median(wall["kiln"]) / kiln_sum)
    outputs = {node.name: set(node.output)
               for node in onnx.load(str(model.path), load_external_data=False).graph.node}
    plan = compiled.artifact.plan
    blocks = {b["id"]: b for b in plan["blocks"]}
    rows = []
    for i, kernel in enumerate(plan["kernels"]):
        names = set()
        for op in blocks[kernel["block"]]["ops"]:
            names |= {op["name"]} | outputs.get(op["name"], set())
        matched = [layer for layer in layer_ms if any(layer.startswith(n) for n in names if n)]
        ov_ms = scale * sum(figure(layer_ms[m], "p10") for m in matched)
        rows.append((figure(kernel_ms[i], "p10"), ov_ms, len(matched), kernel["symbol"]))
    return rows, {k: statistics.median(v) * 1e3 for k, v in wall.items()}, scale


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--top", type=int, default=15, help="kernels listed each way")
    args = parser.parse_args(argv)
    with work_folder(args.keep, "kiln-peer-layers-") as work:
        for model in bench_models(args):
            rows, wall, scale = compare(model, work, args.threads, args.rounds)
            rows = [r for r in rows if r[2]]
            rows.sort(key=lambda r: r[1] - r[0])
            slower = sum(r[0] - r[1] for r in rows if r[0] > r[1])
            faster = sum(r[1] - r[0] for r in rows if r[0] < r[1])
            print(f"{model.name}: wall median kiln {wall['kiln']:.2f} ms, openvino "
                  f"{wall['ov']:.2f} ms; OpenVINO's layers scaled by {scale:.3f}; on matched "
                  f"kernels Kiln loses {slower:.3f} ms and gains {faster:.3f} ms")
            print(f"  {'kernel':40s} {'kiln ms':>8s} {'ov ms':>8s} {'diff':>7s} layers")
            shown = rows[:args.top] + [r for r in rows[::-1][:args.top] if r not in rows[:args.top]]
            for kiln_ms, ov_ms, layers, symbol in shown:
                print(f"  {symbol[:40]:40s} {kiln_ms:8.3f} {ov_ms:8.3f} {kiln_ms - ov_ms:+7.3f} "
                      f"{layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
