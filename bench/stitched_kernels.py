"""Kernel-level times of FusionStitching's stitched reductions against dnnfusion's kernels.

Three artifacts of one model: `dnnfusion`; `fusionstitching` as planned (stitched blocks run their
stages in `stitch_blocks` static chunks); and the same fusionstitching plan with `stitch_blocks`
0 (each stage its own dynamic chunks), which isolates what the shared split buys. They run
interleaved through the artifact runner (what `kiln bench --kernels` reports), one call of
`--runs` runs each per round, the order rotating and a pause before each call; per-kernel medians
are summed by kind of kernel for each round and the medians over rounds are printed with ratios.

Kinds: `reduction` — a kernel holding a row-local reduction or normalisation (Softmax,
LayerNormalization, Reduce*; by the op record) and no library call; `with library call` — one
holding a MatMul/Gemm/Conv (dnnfusion fuses Softmax into its attention MatMuls); `other`.

    python bench/stitched_kernels.py MODEL.onnx [--rounds 5] [--runs 10] [--warmup 1] [--threads T] [--keep DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln import codegen  # noqa: E402
from kiln.ops import RowLocality, op_info  # noqa: E402
from kiln.pipeline import CompileOptions, compile_model  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime.artifact import build_artifact, open_artifact  # noqa: E402
from kiln.runtime.execute import run_runner  # noqa: E402
from kiln.runtime.inputs import random_inputs  # noqa: E402
from kiln.target import target  # noqa: E402

VARIANTS = ("dnnfusion", "fusionstitching", "fusionstitching unstitched")


def build(model: Path, variant: str, out: Path) -> Path:
    if out.exists():
        return out
    partitioner = variant.split()[0]
    compiled = compile_model(model, CompileOptions(partitioner=partitioner), default_store())
    plan = compiled.plan
    if variant.endswith("unstitched"):
        plan = dataclasses.replace(plan, schedules={})
    host = target("host")
    build_artifact(plan, codegen.generate(plan, host), host, compiled.report, out)
    return out


def kind_of(ops: list[dict]) -> str:
    infos = [op_info(o["type"]) for o in ops]
    if any(i.compute_intensive for i in infos):
        return "with library call"
    if any(i.row_locality not in (RowLocality.NONE, RowLocality.MATRIX_ROWS) for i in infos):
        return "reduction"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="runner threads (default: all)")
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="kiln-stitch-"))
    folder.mkdir(parents=True, exist_ok=True)
    artifacts = {}
    for variant in VARIANTS:
        path = build(args.model, variant, folder / f"{args.model.stem}-{variant.replace(' ', '-')}.kiln")
        artifacts[variant] = open_artifact(path)
    inputs = random_inputs(artifacts["dnnfusion"].inputs)
    kinds = {}
    for variant, artifact in artifacts.items():
        ops = {b["id"]: b["ops"] for b in artifact.plan["blocks"]}
        kinds[variant] = {k["symbol"]: kind_of(ops[k["block"]]) for k in artifact.plan["kernels"]}
    sums: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            time.sleep(0.5)
            timing = run_runner(artifacts[variant], inputs, args.runs, args.warmup,
                                args.threads, keep_outputs=False).timing
            print(f"round {r + 1} {variant}: {timing['latency_ns']['median'] / 1e6:.1f} ms",
                  file=sys.stderr, flush=True)
            totals: dict[str, float] = {"all kernels": 0.0}
            for k in timing["kernels"]:
                kind = kinds[variant][k["symbol"]]
                totals[kind] = totals.get(kind, 0.0) + k["median_ns"] / 1e6
                totals["all kernels"] += k["median_ns"] / 1e6
            totals["model latency"] = timing["latency_ns"]["median"] / 1e6
            for kind, ms in totals.items():
                sums.setdefault((variant, kind), []).append(ms)
    counts = {v: {kind: sum(1 for x in kinds[v].values() if x == kind) for kind in set(kinds[v].values())}
              | {"all kernels": len(kinds[v])} for v in VARIANTS}
    rows = ["reduction", "with library call", "other", "all kernels", "model latency"]
    print(f"{args.model.name}: median over {args.rounds} interleaved rounds of {args.runs} runs (ms), "
          f"{args.threads or 'all'} threads")
    print(f"{'':20s}" + "".join(f"{v:>30s}" for v in VARIANTS) + f"{'fs/dnn':>9s}{'fs/unstitched':>15s}")
    for kind in rows:
        med = {v: statistics.median(sums.get((v, kind), [0.0])) for v in VARIANTS}
        cells = "".join(f"{med[v]:>22.3f} ({counts[v].get(kind, '-')!s:>5s})" for v in VARIANTS)
        fs, dnn, un = med["fusionstitching"], med["dnnfusion"], med["fusionstitching unstitched"]
        print(f"{kind:20s}{cells}{fs / dnn if dnn else float('nan'):>9.2f}"
              f"{fs / un if un else float('nan'):>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
