"""What running a model costs beyond its kernels: driver overhead and per-loop hand-offs.

Each parallel loop of a kernel is handed to Kiln's thread pool, so a model of K kernels pays at
least K hand-offs per inference. For each model (the dnnfusion artifact, in the runner with
per-kernel timing, as `kiln bench --kernels` shows it) this prints the end-to-end median, the sum
of the kernels' medians (each kernel's time includes its own hand-offs) and their difference (the
driver's own work between kernels). It then times a parallel loop of one item per thread on the
pool with the same compiler flags and thread count (a static binary like the runner) and
multiplies by K: what the hand-offs cost, at most, and its share of the end-to-end time.

    python bench/runtime_overhead.py [--models mobilenetv2,swin-t,my.onnx] [--threads 2]
                                     [--runs 50] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import bench_models, kiln_artifact, work_folder, zoo_arguments  # noqa: E402
from kiln.codegen.render.c import pool_source  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.execute import run_runner  # noqa: E402
from kiln.runtime.toolchain import compiler_for  # noqa: E402
from kiln.target import target  # noqa: E402

FORK_JOIN_C = r"""
#include <stdio.h>
static double now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y);
}
static volatile float sink[64];
static void touch(const void *context, int64_t begin, int64_t end) {
    (void)context;
    for (int64_t i = begin; i < end; i++) sink[i * 16] += 1.0f;
}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), reps = atoi(argv[2]);
    double *one = malloc(sizeof(double) * reps), *loop = malloc(sizeof(double) * reps);
    (void)argc;
    kiln_pool_set_threads(threads);
    for (int r = 0; r < 1000; r++) kiln_parallel_for(touch, NULL, threads, 1, KILN_POOL_EVEN);
    for (int r = 0; r < reps; r++) {
        double t = now();
        kiln_parallel_for(touch, NULL, 1, 1, KILN_POOL_EVEN);
        one[r] = now() - t;
        t = now();
        kiln_parallel_for(touch, NULL, threads, 1, KILN_POOL_EVEN);
        loop[r] = now() - t;
    }
    qsort(one, reps, sizeof(double), cmp);
    qsort(loop, reps, sizeof(double), cmp);
    printf("{\"serial_ns\": %.1f, \"parallel_for_ns\": %.1f}\n", 1e9 * one[reps / 2],
           1e9 * loop[reps / 2]);
    return 0;
}
"""


def fork_join_ns(threads: int, reps: int = 20000) -> dict[str, float]:
    """Median ns of a one-item loop (run by the caller alone) and of a parallel loop of one item
    per thread, on the thread pool."""
    compiler = compiler_for(target("host"))
    with tempfile.TemporaryDirectory(prefix="kiln-forkjoin-") as tmp:
        source, binary = Path(tmp) / "forkjoin.c", Path(tmp) / "forkjoin"
        source.write_text(pool_source() + FORK_JOIN_C)
        subprocess.run([compiler.command, *compiler.flags, "-static", str(source), "-o",
                        str(binary), *compiler.link_flags, *compiler.libraries],
                       check=True, capture_output=True, text=True)
        done = subprocess.run([str(binary), str(threads), str(reps)], check=True,
                              capture_output=True, text=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    fork_join = fork_join_ns(args.threads)
    per_region_us = fork_join["parallel_for_ns"] / 1e3
    print(f"{args.threads} threads: one-item loop {fork_join['serial_ns'] / 1e3:.2f} us, "
          f"one item per thread {per_region_us:.2f} us (median)")
    print(f"{'model':16s} {'kernels':>7s} {'end-to-end ms':>13s} {'sum kernels ms':>14s} "
          f"{'driver us':>9s} {'K x fork/join us':>16s} {'share':>6s}")
    with work_folder(args.keep, "kiln-overhead-") as work:
        for model in bench_models(args):
            out = kiln_artifact(model, "dnnfusion", work)
            artifact = open_artifact(out, work / "extracted" / out.stem)
            timing = run_runner(artifact, model.inputs, args.runs, 3, args.threads,
                                keep_outputs=False).timing
            kernels = timing["kernels"]
            total = timing["latency_ns"]["median"] / 1e3
            summed = sum(k["median_ns"] for k in kernels) / 1e3
            forks = len(kernels) * per_region_us
            print(f"{model.name:16s} {len(kernels):7d} {total / 1e3:13.3f} {summed / 1e3:14.3f} "
                  f"{total - summed:9.1f} {forks:16.1f} {100 * forks / total:5.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
