"""Math-property graph rewriting on the zoo (DNNFusion §4.2).

For each model: ops before and after rewriting, rules fired, FLOPs before and after, dnnfusion
kernels without and with rewriting, the rewrite stage's time, and whether the outputs are
unchanged (onnxruntime on the rewritten ECG, exported to ONNX, against onnxruntime on the
original model, on realistic inputs: token ids in [0, 100), attention masks of ones, standard
normal images and sequences; within `kiln verify`'s tolerance). Below the table, the rules fired
per model.

Targets (exit status 1 when one is missed): outputs unchanged on every model; rewriting lowers
the kernel count or the FLOPs of every transformer; rewriting BERT-base takes under 2 s.

    python bench/rewrite.py [--models bert-base,gpt2] [--size full|tiny] [--skip-outputs]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.zoo import MODELS, ensure_model, make_inputs  # noqa: E402
from kiln import frontend  # noqa: E402
from kiln.plan import partitioner  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.rewrite import rewrite  # noqa: E402
from kiln.rewrite.export import run_onnxruntime  # noqa: E402
from kiln.runtime.cli import compare  # noqa: E402

TRANSFORMERS = ("albert", "bert-base", "distilbert", "gpt2", "mobilebert", "tinybert", "vit-base")
BERT_SECONDS = 2.0


def outputs_unchanged(path: Path, graph, rewritten, feeds) -> tuple[bool, float]:
    """(all outputs within tolerance, the largest max|diff| / max|ref|)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    by_name = {graph.tensors[t].source_name: t for t in graph.inputs}
    got = run_onnxruntime(rewritten, {by_name[k]: v for k, v in feeds.items()})
    rows = [compare(o.name, g, w) for o, g, w in zip(session.get_outputs(), got, want)]
    return all(r["ok"] for r in rows), max(r["rel"] for r in rows)


def measure(name: str, size: str, check_outputs: bool) -> dict:
    path = ensure_model(name, size)
    graph = frontend.load(path)
    start = time.perf_counter()
    result = rewrite(graph)
    seconds = time.perf_counter() - start
    plan = partitioner("dnnfusion")
    store = default_store(":memory:")
    row = {"model": name, "ops": len(graph.ops), "ops_after": len(result.graph.ops),
           "fired": result.rules_fired, "flops": result.flops_before,
           "flops_after": result.flops_after, "kernels": plan(graph, store).kernels,
           "kernels_after": plan(result.graph, store).kernels, "seconds": seconds}
    if check_outputs:
        row["ok"], row["rel"] = outputs_unchanged(path, graph, result.graph,
                                                  make_inputs(name, size))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--size", default="full", choices=("full", "tiny"))
    parser.add_argument("--skip-outputs", action="store_true",
                        help="do not compare outputs with onnxruntime")
    args = parser.parse_args(argv)
    header = (f"{'model':<16}{'ops':>11}{'fired':>7}{'GFLOPs before':>15}{'after':>9}{'Δ':>8}"
              f"{'kernels w/o':>13}{'with':>6}{'rewrite s':>11}{'outputs':>16}")
    print(header)
    print("-" * len(header))
    rows, failures = [], []
    for name in args.models.split(","):
        row = measure(name, args.size, not args.skip_outputs)
        rows.append(row)
        change = (row["flops_after"] - row["flops"]) / row["flops"] if row["flops"] else 0.0
        outputs = "-" if "ok" not in row else \
            f"{'ok' if row['ok'] else 'FAIL'} ({row['rel']:.0e})"
        print(f"{name:<16}{row['ops']:>5} →{row['ops_after']:>4}{sum(row['fired'].values()):>7}"
              f"{row['flops'] / 1e9:>15.3f}{row['flops_after'] / 1e9:>9.3f}{change:>8.1%}"
              f"{row['kernels']:>13}{row['kernels_after']:>6}{row['seconds']:>11.2f}{outputs:>16}",
              flush=True)
        if row.get("ok") is False:
            failures.append(f"{name}: outputs changed")
        if name in TRANSFORMERS and not (row["kernels_after"] < row["kernels"]
                                         or row["flops_after"] < row["flops"]):
            failures.append(f"{name}: neither kernels nor FLOPs lower")
        if name == "bert-base" and row["seconds"] >= BERT_SECONDS:
            failures.append(f"bert-base: rewriting took {row['seconds']:.2f} s")
    print("\nrules fired:")
    for row in rows:
        fired = ", ".join(f"{rule}×{n}" for rule, n in sorted(row["fired"].items(),
                                                              key=lambda kv: (-kv[1], kv[0])))
        print(f"  {row['model']:<16}{fired or '-'}")
    print(f"\ntargets missed: {'; '.join(failures) or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
