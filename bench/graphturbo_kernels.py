"""Kernel-level timings of GraphTurbo's tiled stages against the same ops compiled otherwise.

For every stage `graphturbo` runs tile by tile (kiln.codegen.tiled) in a model, three builds of
exactly the stage's ops, on the same random inputs:

* `tiled`: the stage as one kernel, instance by instance, intermediates in window buffers;
* `whole`: the same block lowered layer by layer with whole intermediates in scratch memory
  (what the kernel generator does without GraphTurbo's windows: the breadth-first order);
* `dnnfusion`: DNNFusion's plan of the stage's sub-graph, its kernels run one after another
  with their intermediates in memory.

The three run interleaved, one call of each per round after a pause (bench/latency.py's
`interleaved_medians`); printed are median microseconds and the ratios to `tiled`, then their
geometric means. Outputs are checked against each other first.

    python bench/graphturbo_kernels.py [--models mobilenetv2,efficientnet-b0,resnet50]
                                       [--rounds 15] [--max-stages 8]

Models are read from bench/models/NAME.onnx (the full-size zoo) when it exists, else from the
tiny fixtures in tests/fixtures/zoo; each line says which.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency import interleaved_medians  # noqa: E402
from kiln import frontend  # noqa: E402
from kiln.codegen import Kernel, generate  # noqa: E402
from kiln.ecg import Graph  # noqa: E402
from kiln.plan import FusionPlan, partitioner  # noqa: E402
from kiln.plan.blocks import build_plan  # noqa: E402
from kiln.plan.graphturbo import Hardware, stage_plan  # noqa: E402
from kiln.profile.machine import host_machine  # noqa: E402
from kiln.profile.roofline import RooflineModel  # noqa: E402
from kiln.rewrite import rewrite  # noqa: E402
from kiln.target import host_target  # noqa: E402
from tests.codegen.harness import compile_kernels  # noqa: E402


def model_path(name: str) -> tuple[Path, str]:
    for folder, kind in ((ROOT / "bench" / "models", "full"),
                         (Path("/work/main/bench/models"), "full"),
                         (ROOT / "tests" / "fixtures" / "zoo", "tiny")):
        if (folder / f"{name}.onnx").exists():
            return folder / f"{name}.onnx", kind
    raise SystemExit(f"no model {name}")


class Prepared:
    """A plan's kernels compiled once, buffers allocated once: `()` runs them in order."""

    def __init__(self, plan: FusionPlan, kernels: list[Kernel], feeds: dict[str, np.ndarray]):
        graph = plan.graph
        lib = compile_kernels(kernels)
        self.values = dict(feeds)
        for t in graph.tensors.values():
            if t.is_constant:
                self.values[t.id] = np.ascontiguousarray(t.data)
        self.steps = []
        for k in kernels:
            for name, array in k.derived_constants.items():
                self.values[f"{k.symbol}:{name}"] = np.ascontiguousarray(array)
            for t in k.outputs:
                self.values[t] = np.zeros(graph.tensors[t].shape, graph.tensors[t].dtype)
            pointers = [self.values[f"{k.symbol}:{a}" if a in k.derived_constants else a].ctypes.data
                        for a in k.args]
            if k.scratch_bytes:
                scratch = np.empty(k.scratch_bytes + 64, np.uint8)
                self.values[f"{k.symbol}:scratch"] = scratch
                pointers.append(scratch.ctypes.data + (-scratch.ctypes.data) % 64)
            fn = getattr(lib, k.symbol)
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
            args = (ctypes.c_void_p * max(len(pointers), 1))(*pointers)
            self.steps.append((fn, args))

    def __call__(self) -> None:
        for fn, args in self.steps:
            fn(ctypes.cast(args, ctypes.c_void_p))


def sub_graph(graph: Graph, op_ids: tuple[str, ...], outputs: tuple[str, ...]) -> Graph:
    ops = [graph.op_by_id[i] for i in op_ids]
    produced = {t for op in ops for t in op.outputs}
    inputs = list(dict.fromkeys(t for op in ops for t in op.present_inputs()
                                if t not in produced and not graph.is_constant(t)))
    return Graph(graph.tensors, ops, inputs, list(outputs))


def contenders(graph: Graph, block, hw: Hardware, store, feeds_for) -> dict[str, Prepared]:
    sub = sub_graph(graph, block.op_ids, block.outputs)
    feeds = feeds_for(sub)
    target = host_target()
    whole = build_plan(sub, [block.op_ids], "graphturbo")
    b = whole.blocks[0]
    tiled = FusionPlan(whole.graph, whole.blocks, "graphturbo", block_of=whole.block_of,
                       stages={b.id: stage_plan(whole.graph, b.id, b.op_ids, b.outputs, hw)})
    dnn = partitioner("dnnfusion")(sub, store)
    built = {"tiled": (tiled, generate(tiled, target)), "whole": (whole, generate(whole, target)),
             "dnnfusion": (dnn, generate(dnn, target))}
    if not any(s.get("form") == "tiled" for s in built["tiled"][1][0].schedule["stages"]):
        return {}
    return {name: Prepared(plan, kernels, feeds) for name, (plan, kernels) in built.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenetv2,efficientnet-b0,resnet50")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-stages", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    hw = Hardware.for_host()
    store = RooflineModel(host_machine())
    rng = np.random.default_rng(0)
    ratios: dict[str, list[float]] = {"whole": [], "dnnfusion": []}
    print(f"local buffer (L2 per core) {hw.local_bytes >> 10} KiB, L1 {hw.l1_bytes >> 10} KiB")
    for name in args.models.split(","):
        path, kind = model_path(name)
        graph = rewrite(frontend.load(path, {})).graph
        plan = partitioner("graphturbo")(graph, store)
        stages = [b for b in plan.blocks if plan.stages[b.id].tiled][:args.max_stages]

        def feeds_for(sub: Graph) -> dict[str, np.ndarray]:
            return {t: rng.standard_normal(sub.tensors[t].shape).astype(sub.tensors[t].dtype)
                    for t in sub.inputs}

        for block in stages:
            calls = contenders(graph, block, hw, store, feeds_for)
            if not calls:
                continue
            for c in calls.values():
                c()
            want = calls["dnnfusion"].values
            for c in ("tiled", "whole"):
                for t in block.outputs:
                    np.testing.assert_allclose(calls[c].values[t], want[t], rtol=1e-3, atol=1e-3)
            ms = interleaved_medians(calls, args.rounds, warmup=2)
            s = plan.stages[block.id]
            kinds = "+".join(dict.fromkeys(graph.op_by_id[o].op_type for o in block.op_ids))
            print(f"{name} ({kind}) {block.id} {len(block.op_ids)} ops [{kinds}] "
                  f"{s.split.parts} parts: tiled {ms['tiled'] * 1e3:.0f} us, "
                  f"whole {ms['whole'] * 1e3:.0f} us ({ms['whole'] / ms['tiled']:.2f}x), "
                  f"dnnfusion {ms['dnnfusion'] * 1e3:.0f} us "
                  f"({ms['dnnfusion'] / ms['tiled']:.2f}x)", flush=True)
            ratios["whole"].append(ms["whole"] / ms["tiled"])
            ratios["dnnfusion"].append(ms["dnnfusion"] / ms["tiled"])
    for other, values in ratios.items():
        if values:
            geomean = math.exp(sum(math.log(v) for v in values) / len(values))
            print(f"geomean {other} / tiled: {geomean:.2f}x over {len(values)} stages "
                  f"(above 1: tiled is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
