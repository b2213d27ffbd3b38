"""Fusion rate per full-size zoo model: Kiln's kernel counts next to onnxruntime's.

For each model: ops in the ECG, kernels with partitioners none / fixed / dnnfusion, onnxruntime's
kernel count (nodes of its optimized graph at ORT_ENABLE_ALL, not counting Reshape, Squeeze,
Unsqueeze, Flatten, Identity, Constant), fusion rates (ops / kernels) and planning time.

    python bench/fusion_rate.py [--models bert-base,gpt2] [--no-rewrite]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.zoo import MODELS, ensure_model  # noqa: E402
from kiln.pipeline import CompileOptions, compile_model  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402

PAPER_RATES = {"bert-base": 4.5, "distilbert": 4.2, "mobilebert": 4.7, "efficientnet-b0": 3.2}
ORT_UNCOUNTED = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Constant"}
PARTITIONERS = ("none", "fixed", "dnnfusion")


def ort_kernel_count(model_path: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 2
        options.log_severity_level = 3
        options.optimized_model_filepath = str(optimized)
        ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(str(optimized), load_external_data=False).graph
        return sum(1 for node in graph.node if node.op_type not in ORT_UNCOUNTED)


def measure(name: str, rewrite: bool) -> dict:
    path = ensure_model(name, "full")
    store = default_store()
    row = {"model": name}
    for partitioner in PARTITIONERS:
        options = CompileOptions(partitioner=partitioner, **({} if rewrite else {"rewrite": False}))
        start = time.perf_counter()
        report = compile_model(path, options, store).report
        row[partitioner] = report["kernels"]
        row["ops"] = report["ops_before"]
        row[f"{partitioner}_seconds"] = time.perf_counter() - start
        row[f"{partitioner}_plan_seconds"] = report["seconds"]
    row["ort"] = ort_kernel_count(path)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-rewrite", action="store_true", help="plan without graph rewriting")
    args = parser.parse_args(argv)
    header = (f"{'model':<16}{'ops':>6}{'none':>7}{'fixed':>7}{'dnnf':>7}{'ort':>7}"
              f"{'rate':>8}{'paper':>7}{'fixed':>8}{'ort':>7}{'dnnf<ort':>10}{'compile s':>11}")
    print(header)
    print("-" * len(header))
    failures = []
    for name in args.models.split(","):
        row = measure(name, rewrite=not args.no_rewrite)
        rate = row["ops"] / row["dnnfusion"]
        paper = PAPER_RATES.get(name)
        below_ort = row["dnnfusion"] < row["ort"]
        print(f"{name:<16}{row['ops']:>6}{row['none']:>7}{row['fixed']:>7}{row['dnnfusion']:>7}"
              f"{row['ort']:>7}{rate:>7.2f}x{(f'{paper:.1f}x' if paper else '-'):>7}"
              f"{row['ops'] / row['fixed']:>7.2f}x{row['ops'] / row['ort']:>6.2f}x"
              f"{'yes' if below_ort else 'NO':>10}{row['dnnfusion_seconds']:>11.2f}", flush=True)
        if not below_ort or (paper and rate < paper):
            failures.append(name)
    print(f"\nrate = ops / kernels. Models missing a target: {', '.join(failures) or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
