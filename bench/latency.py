"""Latency of Kiln artifacts against onnxruntime on the full-size zoo models, side by side.

For each model: the artifact compiled with dnnfusion, the artifact compiled with partitioner
none, and onnxruntime (ORT_ENABLE_ALL), all with the same number of threads (default 2), run
interleaved — one call of each per round — so machine noise hits all three alike. Artifacts run
in-process through the loader. Prints median milliseconds and the ratios artifact/ort and
none/dnnfusion, and each artifact's max |diff| against onnxruntime. The order of the three rotates
each round, and each timed call starts after a short pause (see `interleaved_medians`).

    python bench/latency.py [--models bert-base,resnet50] [--rounds 20] [--threads 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.zoo import MODELS, ensure_model, make_inputs
from kiln.errors import KilnError
from kiln.pipeline import CompileOptions, compile_artifact
from kiln.profile.local import default_store
from kiln.runtime.artifact import open_artifact
from kiln.runtime.loader import CompiledModel

PARTITIONERS = ("dnnfusion", "none")
SETTLE_S = 0.05  # pause before each timed call, so no thread pool is still spinning from the last
WARM_S = 0.02  # untimed calls (at least one) after the pause, for at least this long


def ort_session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@contextmanager
def work_folder(keep: Path | None, prefix: str) -> Iterator[Path]:
    """`keep` (created if missing), or else a temporary folder removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def zoo_artifact(name: str, partitioner: str, work: Path) -> Path:
    """The full-size zoo model `name` compiled with `partitioner` into `work` (kept there and
    reused by later runs given the same folder)."""
    out = work / f"{name}-{partitioner}.kiln"
    if not out.exists():
        start = time.perf_counter()
        compile_artifact(ensure_model(name), out, CompileOptions(partitioner=partitioner),
                         default_store())
        print(f"  compiled {name} with {partitioner} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    return out


def contenders(name: str, threads: int, work: Path) -> tuple[dict[str, Callable], dict[str, str]]:
    """Callables running one inference each (by contender name), and compile failures."""
    path = ensure_model(name)
    inputs = make_inputs(name)
    session = ort_session(path, threads)
    calls: dict[str, Callable] = {"ort": lambda: session.run(None, inputs)}
    failures = {}
    for partitioner in PARTITIONERS:
        try:
            out = zoo_artifact(name, partitioner, work)
            model = CompiledModel(open_artifact(out, work / "extracted" / out.stem), threads)
        except KilnError as exc:
            failures[partitioner] = str(exc).splitlines()[0]
            continue
        calls[partitioner] = lambda model=model: model.run(**inputs)
    return calls, failures


def max_diff(calls: dict[str, Callable]) -> dict[str, float]:
    reference = calls["ort"]()
    return {name: max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(call(), reference))
            for name, call in calls.items() if name != "ort"}


def interleaved_medians(calls: dict[str, Callable], rounds: int, warmup: int,
                        settle_s: float = SETTLE_S) -> dict[str, float]:
    """Medians over rounds of one call each. The order rotates every round and each timed call
    starts after a pause: a thread pool spins for a while after its call returns (onnxruntime's
    and OpenMP's both do), and whoever always ran next would pay for it. After the pause come
    untimed calls for `WARM_S`: on a VM the first calls after an idle pause run several times
    slower while the sleeping threads' virtual CPUs come back."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(settle_s)
            warm_until = time.perf_counter() + WARM_S
            calls[name]()
            while time.perf_counter() < warm_until:
                calls[name]()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def zoo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every zoo benchmark that compiles artifacts takes."""
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="compile into (and reuse artifacts from) DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    header = (f"{'model':16s} {'dnnfusion ms':>12s} {'none ms':>10s} {'ort ms':>10s} "
              f"{'dnnf/ort':>9s} {'none/ort':>9s} {'none/dnnf':>9s} {'max|diff| dnnf':>14s}")
    rows, notes = [], []
    with work_folder(args.keep, "kiln-latency-") as work:
        for name in args.models.split(","):
            calls, failures = contenders(name, args.threads, work)
            notes += [f"{name} [{p}]: {reason}" for p, reason in failures.items()]
            diffs = max_diff(calls)
            ms = interleaved_medians(calls, args.rounds, args.warmup)
            dnnf, none, ort_ms = ms.get("dnnfusion"), ms.get("none"), ms["ort"]
            rows.append(f"{name:16s} {_ms(dnnf):>12s} {_ms(none):>10s} {_ms(ort_ms):>10s} "
                        f"{ratio(dnnf, ort_ms):>9s} {ratio(none, ort_ms):>9s} "
                        f"{ratio(none, dnnf):>9s} {diffs.get('dnnfusion', float('nan')):14.3g}")
            print(rows[-1], file=sys.stderr)
    print(f"median latency, {args.threads} threads, {args.rounds} interleaved rounds")
    print(header)
    print("\n".join(rows))
    for note in notes:
        print(f"not compiled: {note}")
    return 0


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
