"""AGO's intensive fusion of two matrix products at kernel level: a transformer FFN (MatMul + bias
→ GELU → MatMul + bias → residual) as one `ago` subgraph, its kernel with intensive fusion on
(`kiln.codegen.intensive_rows`: row tiles, no intermediate in memory) against the same block with
`intensive_fusion` off (two packed GEMMs and a full intermediate), interleaved.

The FFNs are built at the sizes of the zoo's models (sequence length × hidden × inner):

    bert-base  128 × 768 × 3072      mobilebert 128 × 128 × 512 (its bottleneck FFN)

and planned as one subgraph, the block `ago` forms when its weight threshold admits the pair
(MobileBERT's does at a 1 MiB L2; BERT-base's FFN weighs more than Td there, so `ago` cuts it —
this bench times the pair it would form with a larger threshold). The two artifacts' runners are
called in rounds, the order alternating, each round's per-kernel median kept; the median over
rounds is reported.

    python bench/intensive_rows.py [--rounds 9] [--runs 20] [--threads 1] [--tile-bytes N]
                                   [--sizes bert-base,mobilebert]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln import codegen, frontend
from kiln.plan.blocks import build_plan
from kiln.runtime.artifact import build_artifact, open_artifact
from kiln.runtime.execute import run_runner
from kiln.runtime.inputs import random_inputs
from kiln.target import target

SIZES = {"bert-base": (128, 768, 3072), "mobilebert": (128, 128, 512)}
SETTLE_S = 0.05


def ffn_model(seq: int, hidden: int, inner: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def const(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value, np.float32), name)

    inits = [const("w1", rng.standard_normal((hidden, inner)) / np.sqrt(hidden)),
             const("b1", rng.standard_normal(inner)), const("sq", np.sqrt(2)), const("one", 1),
             const("half", 0.5), const("w2", rng.standard_normal((inner, hidden)) / np.sqrt(inner)),
             const("b2", rng.standard_normal(hidden))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Div", ["a1", "sq"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["a1", "e1"], ["g0"]),
             helper.make_node("Mul", ["g0", "half"], ["g"]), helper.make_node("MatMul", ["g", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["a2"]), helper.make_node("Add", ["a2", "x"], ["y"])]
    graph = helper.make_graph(
        nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def build(name: str, sizes: tuple[int, int, int], folder: Path, tile_bytes: int | None
          ) -> dict[str, tuple]:
    graph = frontend.build(ffn_model(*sizes), {}, name)
    plan = build_plan(graph, [[op.id for op in graph.ops]], "ago")
    host = target("host")
    built = {}
    for variant, on in (("on", True), ("off", False)):
        schedule = {"intensive_fusion": on}
        if tile_bytes:
            schedule["intensive_tile_bytes"] = tile_bytes
        kernels = codegen.generate(plan, host, block_schedules={b.id: schedule for b in plan.blocks})
        forms = [s.get("form") for k in kernels for s in k.schedule["stages"] if s.get("form")]
        out = folder / f"{name}-{variant}.kiln"
        build_artifact(plan, kernels, host, {}, out)
        built[variant] = (open_artifact(out), forms, kernels[0].scratch_bytes)
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--tile-bytes", type=int, default=None,
                        help="the schedule's intensive_tile_bytes (default: the Schedule's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-intensive-rows-") as tmp:
        for name in args.sizes.split(","):
            built = build(name, SIZES[name], Path(tmp), args.tile_bytes)
            inputs = random_inputs(built["on"][0].inputs)
            times: dict[str, list[float]] = {v: [] for v in built}
            order = list(built)
            for r in range(args.rounds):
                for variant in order[r % 2:] + order[:r % 2]:
                    time.sleep(SETTLE_S)
                    timing = run_runner(built[variant][0], inputs, args.runs, 3, args.threads,
                                        keep_outputs=False).timing
                    times[variant].append(sum(k["median_ns"] for k in timing["kernels"]) / 1e6)
            on, off = (statistics.median(times[v]) for v in ("on", "off"))
            seq, hidden, inner = SIZES[name]
            print(f"{name} FFN {seq}×{hidden}→{inner}→{hidden}: intensive on {on:.3f} ms "
                  f"(scratch {built['on'][2]} B, {built['on'][1]}), off {off:.3f} ms "
                  f"(scratch {built['off'][2]} B), on/off {on / off:.2f}")
    print(f"threads {args.threads}; machine shared and loaded: ratios of interleaved medians")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
