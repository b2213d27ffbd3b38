"""The machine's float32 FMA peak on N threads, and each model's floor at that peak.

The peak is measured, not taken from a data sheet: a static binary (the host target's compiler
and flags, like the runner) runs, on every thread of Kiln's pool, independent chains of vector
FMAs (GCC vector extensions at the widest vector the target's micro-kernels use), long enough
to be timed, and the best of several repetitions gives GFLOP/s. For each model the FLOPs are
Kiln's count of its graph (`Graph.total_flops`, after rewriting, as `kiln compile` reports
`flops_after`); the floor is the time those FLOPs take at the peak. No implementation can run the
model faster than its floor; a runtime's latency over the floor is how close it is to the peak.

    python bench/peak_flops.py [--models zoo|bert-base,...] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import bench_models, zoo_arguments  # noqa: E402
from kiln import frontend  # noqa: E402
from kiln.codegen.microkernel import ISA_TILES  # noqa: E402
from kiln.codegen.render.c import pool_source  # noqa: E402
from kiln.rewrite import rewrite  # noqa: E402
from kiln.runtime.toolchain import compiler_for  # noqa: E402
from kiln.target import target  # noqa: E402

CHAINS = 12  # independent accumulators: FMA latency (4) x ports (2), with room to spare

PEAK_C = r"""
#include <stdio.h>
typedef float vec __attribute__((vector_size(VECTOR_BYTES)));
#define LANES (VECTOR_BYTES / 4)
static double seconds[KILN_POOL_MAX_THREADS];
static volatile float sink;
static void chains(const void *context, int64_t begin, int64_t end) {
    int64_t steps = *(const int64_t *)context, i, t;
    for (t = begin; t < end; t++) {
        vec acc[CHAINS], a, b;
        struct timespec s, e;
        for (i = 0; i < LANES; i++) { a[i] = 0.999f; b[i] = 1e-7f; }
        for (i = 0; i < CHAINS; i++) acc[i] = b * (float)i;
        clock_gettime(CLOCK_MONOTONIC, &s);
        for (i = 0; i < steps; i++) {
            for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * a + b;
            __asm__ volatile("" : "+x"(a));
        }
        clock_gettime(CLOCK_MONOTONIC, &e);
        seconds[t] = (e.tv_sec - s.tv_sec) + 1e-9 * (e.tv_nsec - s.tv_nsec);
        for (i = 0; i < CHAINS; i++) sink += acc[i][0];
    }
}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), reps = 7, r, t;
    int64_t steps = atoll(argv[2]);
    double best = 0.0;
    (void)argc;
    kiln_pool_set_threads(threads);
    for (r = 0; r < reps; r++) {
        double slowest = 0.0;
        kiln_parallel_for(chains, &steps, threads, 1, KILN_POOL_DYNAMIC);
        for (t = 0; t < threads; t++) if (seconds[t] > slowest) slowest = seconds[t];
        if (r && 2.0 * CHAINS * LANES * steps * threads / slowest > best)
            best = 2.0 * CHAINS * LANES * steps * threads / slowest;
    }
    printf("{\"gflops\": %.1f}\n", best / 1e9);
    return 0;
}
"""


def vector_bytes() -> int:
    host = target("host")
    return next((width for isa, width, _, _ in ISA_TILES if isa in host.isa), 16)


def peak_gflops(threads: int, steps: int = 20_000_000) -> float:
    """Best GFLOP/s of `threads` threads each running CHAINS independent FMA chains."""
    compiler = compiler_for(target("host"))
    with tempfile.TemporaryDirectory(prefix="kiln-peak-") as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(f"#define VECTOR_BYTES {vector_bytes()}\n#define CHAINS {CHAINS}\n"
                          + pool_source() + PEAK_C)
        subprocess.run([compiler.command, *compiler.flags, "-static", str(source), "-o",
                        str(binary), *compiler.link_flags, *compiler.libraries],
                       check=True, capture_output=True, text=True)
        done = subprocess.run([str(binary), str(threads), str(steps)], check=True,
                              capture_output=True, text=True)
    return json.loads(done.stdout)["gflops"]


def model_flops(path: Path, shapes: dict) -> int:
    return rewrite(frontend.load(path, shapes)).flops_after


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    peak = peak_gflops(args.threads)
    print(f"float32 FMA peak, {args.threads} threads, {vector_bytes() * 8}-bit vectors: "
          f"{peak:.0f} GFLOP/s")
    print(f"{'model':16s} {'GFLOP':>8s} {'floor ms':>9s}")
    for model in bench_models(args):
        flops = model_flops(model.path, model.shapes)
        print(f"{model.name:16s} {flops / 1e9:8.2f} {flops / peak / 1e6:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
