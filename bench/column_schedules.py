"""Kernel-level times of FusionStitching's Column schedule against the Row realisation of a
column-reduction fusion: statistics over the rows of an [R, C] tensor (mean, variance), the
normalised tensor, a Softmax over the rows and a ReduceMax of it (the plan's stitched kernels).

Variants of the same fusionstitching plan's kernels (the same blocks, only the schedule differs;
the sum over the plan's kernels is timed): `column` — as planned (`stitch_columns`: contiguous
column chunks per thread, rows inside); `row blocks` — `stitch_blocks` = threads with no columns:
every stage's loop over the columns in static Row chunks, each column reduced by a strided walk
down the rows; `unstitched` — each stage's own dynamic chunks. They are compiled into one library
and called in one process, interleaved round by round (the order rotating), at 1 and 2 OpenMP
threads (`omp_set_num_threads` between calls); the medians over rounds are printed with ratios.

    python bench/column_schedules.py [--rows 256] [--columns 768] [--rounds 7] [--runs 20]
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln import frontend  # noqa: E402
from kiln.codegen import generate  # noqa: E402
from kiln.plan import partitioner  # noqa: E402
from kiln.profile.machine import host_machine  # noqa: E402
from kiln.profile.roofline import RooflineModel  # noqa: E402
from kiln.target import host_target  # noqa: E402

THREADS = (1, 2)


def column_statistics(rows: int, columns: int) -> onnx.ModelProto:
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
             helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["q"]),
             helper.make_node("ReduceMean", ["q", "axes"], ["var"], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["y"]),
             helper.make_node("Softmax", ["y"], ["z"], axis=0),
             helper.make_node("ReduceMax", ["z", "axes"], ["top"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "column_statistics",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, columns])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [rows, columns]),
         helper.make_tensor_value_info("top", onnx.TensorProto.FLOAT, [columns])],
        [onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "axes"),
         onnx.numpy_helper.from_array(np.float32(1e-5), "eps")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def compile_library(sources: list[str], folder: Path) -> ctypes.CDLL:
    source = "\n".join(sources)
    lib = folder / f"k{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(source)
        subprocess.run(["gcc", "-O3", "-fopenmp", "-fPIC", "-fno-math-errno", "-shared",
                        *host_target().cflags, str(src), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # z (R·C floats) within the 1 MiB scratch budget, so that the fusion is not cut there
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--columns", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    model = column_statistics(args.rows, args.columns)
    graph = frontend.build(model, {}, "column_statistics")
    plan = partitioner("fusionstitching")(graph, RooflineModel(host_machine()))
    stitched = [b.id for b in plan.blocks if b.id in plan.schedules]
    print(f"[{args.rows}, {args.columns}]: {len(plan.blocks)} kernels, planned schedules "
          f"{ {b: plan.schedules[b] for b in stitched} }")
    variants = {"column": {},
                "row blocks": {"stitch_blocks": max(THREADS), "stitch_columns": 0},
                "unstitched": {"stitch_blocks": 0, "stitch_columns": 0}}
    kernels = {name: generate(plan, host_target(), block_schedules={b: o for b in stitched})
               for name, o in variants.items()}
    for name, ks in kernels.items():
        print(f"  {name:12s} stitch_type={[k.schedule['stitch_type'] for k in ks]}")
    renamed = {name: [k.source.replace(k.symbol, f"{k.symbol}_{i}") for k in ks]
               for i, (name, ks) in enumerate(kernels.items())}
    lib = compile_library([src for srcs in renamed.values() for src in srcs],
                          Path(tempfile.mkdtemp(prefix="kiln-col-")))
    gomp = ctypes.CDLL("libgomp.so.1")
    x = np.random.default_rng(0).standard_normal((args.rows, args.columns)).astype(np.float32)
    calls: dict[str, list] = {}
    results: dict[str, list[np.ndarray]] = {}
    for i, (name, ks) in enumerate(kernels.items()):
        buffers: dict[str, np.ndarray] = {graph.inputs[0]: x}
        buffers |= {t.id: np.array(t.data, order="C") for t in graph.tensors.values()
                    if t.is_constant}
        calls[name] = []
        for k in ks:
            buffers |= {t: np.empty(graph.tensors[t].shape, graph.tensors[t].dtype)
                        for t in k.outputs}
            buffers |= {c: np.array(a, order="C") for c, a in k.derived_constants.items()}
            pointers = [buffers[a].ctypes.data for a in k.args]
            if k.scratch_bytes:
                scratch = np.empty(k.scratch_bytes + 64, np.uint8)
                buffers[f"scratch of {k.symbol}"] = scratch
                pointers.append(scratch.ctypes.data + (-scratch.ctypes.data) % 64)
            argv = (ctypes.c_void_p * len(pointers))(*pointers)
            fn = getattr(lib, f"{k.symbol}_{i}")
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
            calls[name].append((fn, ctypes.cast(argv, ctypes.c_void_p), argv, buffers))
        results[name] = [buffers[t] for t in graph.outputs]

    def run(name: str) -> None:
        for fn, arg, _, _ in calls[name]:
            fn(arg)

    times: dict[tuple[str, int], list[float]] = {}
    names = list(kernels)
    for r in range(args.rounds):
        for threads in THREADS:
            gomp.omp_set_num_threads(threads)
            for name in names[r % len(names):] + names[:r % len(names)]:
                run(name)  # warm-up
                samples = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    run(name)
                    samples.append(time.perf_counter() - start)
                times.setdefault((name, threads), []).append(statistics.median(samples))
    for name in names[1:]:
        for got, want in zip(results[name], results["column"]):
            assert np.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True), name
    print(f"median over {args.rounds} interleaved rounds of {args.runs} calls (ms); "
          f"ratio = variant / column")
    for threads in THREADS:
        base = statistics.median(times[("column", threads)])
        cells = "  ".join(f"{n}: {statistics.median(times[(n, threads)]) * 1e3:8.3f}"
                          f" ({statistics.median(times[(n, threads)]) / base:4.2f}x)"
                          for n in names)
        print(f"{threads} thread(s)  {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
