"""Every partitioner side by side: models × partitioners × {kernels, intermediate bytes, latency,
compile seconds}, with onnxruntime and OpenVINO as reference rows, in one run.

For each model, every registered partitioner (`kiln.plan.partitioner_names()`: none, fixed,
dnnfusion and the papers' systems) compiles an artifact; all artifacts and the peers then run
interleaved — one call of each per round, the order rotating, a pause before each timed call
(`bench.latency.interleaved_medians`) — so machine noise hits all alike. Per partitioner it prints
the kernels run, the intermediate-result bytes still materialised between kernels, the median
latency, latency against the fastest peer, compile seconds and the outputs' max |diff| against
onnxruntime. A partitioner that cannot compile a model gets its reason in the notes.

`--models` takes zoo names, the groups `zoo` and `unseen`, and paths to any .onnx files (with
`--shape NAME=D0,D1,…` for symbolic dimensions), as `bench/latency.py` does.

    python bench/partitioners.py [--models mobilenetv2,bert-base,my.onnx] [--partitioners ago,souffle]
                                 [--peers ort,ov] [--rounds 15] [--threads 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import (  # noqa: E402
    PEERS,
    BenchModel,
    bench_models,
    interleaved_medians,
    max_diff,
    work_folder,
    zoo_arguments,
)
from bench.peers import openvino_call, ort_session  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.plan import partitioner_names  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

PEER_LABELS = {"ort": "onnxruntime", "ov": "openvino"}


@dataclass(frozen=True)
class Build:
    """One partitioner's artifact of one model, loaded, with what its report says."""

    partitioner: str
    call: Callable
    kernels: int
    irs_bytes: int
    compile_s: float


def build(model: BenchModel, partitioner: str, threads: int, work: Path) -> Build:
    out = work / f"{model.name}-{partitioner}.kiln"
    start = time.perf_counter()
    report = compile_artifact(model.path, out, CompileOptions(partitioner=partitioner,
                                                              shapes=model.shapes),
                              default_store())
    seconds = time.perf_counter() - start
    compiled = CompiledModel(open_artifact(out, work / "extracted" / out.stem), threads)
    return Build(partitioner, lambda: compiled.run(**model.inputs), report["kernels"],
                 report["irs_bytes_after"], seconds)


def peer_calls(model: BenchModel, threads: int, peers: Sequence[str]) -> tuple[dict, dict]:
    session = ort_session(model.path, threads)
    calls = {"ort": lambda: session.run(None, model.inputs)}
    failures = {}
    if "ov" in peers:
        try:
            calls["ov"] = openvino_call(model.path, model.inputs, threads)
        except RuntimeError as exc:  # OpenVINO reports unsupported models as RuntimeError
            failures["ov"] = str(exc).strip().splitlines()[0]
    return calls, failures


def model_rows(model: BenchModel, partitioners: Sequence[str], peers: Sequence[str],
               args: argparse.Namespace, work: Path) -> tuple[list[list[str]], list[str], dict]:
    calls, failures = peer_calls(model, args.threads, peers)
    builds: dict[str, Build] = {}
    for name in partitioners:
        try:
            builds[name] = build(model, name, args.threads, work)
        except KilnError as exc:
            failures[name] = str(exc).splitlines()[0]
            continue
        calls[name] = builds[name].call
    diffs = max_diff(calls)
    ms = interleaved_medians(calls, args.rounds, args.warmup)
    fastest = min(ms[p] for p in peers if p in ms)
    rows = []
    for name, b in builds.items():
        rows.append([model.name, name, str(b.kernels), f"{b.irs_bytes / 2**20:.2f}",
                     f"{ms[name]:.2f}", f"{ms[name] / fastest:.2f}", f"{b.compile_s:.1f}",
                     f"{diffs[name]:.2g}"])
    for peer in peers:
        if peer in ms:
            rows.append([model.name, PEER_LABELS[peer], "-", "-", f"{ms[peer]:.2f}",
                         f"{ms[peer] / fastest:.2f}", "-",
                         f"{diffs[peer]:.2g}" if peer in diffs else "0"])
    notes = [f"{model.name} [{who}]: {reason}" for who, reason in failures.items()]
    return rows, notes, {name: ms[name] / fastest for name in builds}


HEADER = ["model", "partitioner", "kernels", "IR MiB", "ms", "/fastest", "compile s",
          "max|diff|"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(HEADER), line(["-" * w for w in widths]), *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--partitioners", default=",".join(partitioner_names()),
                        help=f"comma-separated (default all: {', '.join(partitioner_names())})")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="reference runtimes: ort (always run: the outputs' reference), ov")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    partitioners = [p for p in args.partitioners.split(",") if p]
    unknown = set(partitioners) - set(partitioner_names())
    if unknown:
        parser.error(f"--partitioners: unknown {sorted(unknown)}; "
                     f"choose from {', '.join(partitioner_names())}")
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= set(PEERS):
        parser.error(f"--peers: choose from {', '.join(PEERS)}")
    rows, notes = [], []
    ratios: dict[str, list[float]] = {p: [] for p in partitioners}
    with work_folder(args.keep, "kiln-partitioners-") as work:
        for model in bench_models(args):
            model_table, model_notes, model_ratios = model_rows(model, partitioners, peers,
                                                                args, work)
            rows += model_table
            notes += model_notes
            for name, value in model_ratios.items():
                ratios[name].append(value)
            print(table(model_table), file=sys.stderr)
    print(f"median latency, {args.threads} threads, {args.rounds} interleaved rounds; "
          f"/fastest = against the faster of {', '.join(PEER_LABELS[p] for p in peers)}; "
          f"IR MiB = intermediate results materialised between kernels")
    print(table(rows))
    for name, values in ratios.items():
        if values:
            print(f"geomean {name} / fastest peer: {statistics.geometric_mean(values):.2f} "
                  f"over {len(values)} model(s)")
    for note in notes:
        print(f"not built: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
