"""Latency of Kiln artifacts against onnxruntime and OpenVINO, side by side.

For each model: the artifact compiled with dnnfusion, the artifact compiled with partitioner
none, onnxruntime (ORT_ENABLE_ALL) and OpenVINO (CPU, f32: PERFORMANCE_HINT=LATENCY,
INFERENCE_PRECISION_HINT=f32), all with the same number of threads (default 2), run interleaved —
one call of each per round — so machine noise hits all alike. Artifacts run in-process through
the loader. The order rotates each round, and each timed call starts after a short pause (see
`interleaved_medians`). Prints median milliseconds, each Kiln build against the fastest peer
(the lower of onnxruntime and OpenVINO: the `Kiln / fastest` column), none/dnnfusion, the
artifact's max |diff| against onnxruntime, and geomeans of the ratios. The medians are the
measure; beside them, dnnfusion against the fastest peer by each one's 10th-percentile call
(`p10`): on a shared host whose slow phases last seconds and slow some code more than other
code (seen on a 2-vCPU Zen 4 VM: Kiln's ResNet-50 37.5 → 50 ms, OpenVINO's 37.5 → 40 ms, for
5-30 s at a time), a p10 ratio far below the median's says the rounds straddled such a phase.

`--models` takes zoo names (bench/zoo.py, exported on first use), names of the architectures
outside the zoo (bench/unseen.py; `unseen` for all of them, `zoo` for the zoo) and paths to
.onnx files; the inputs of a file are random valid ones derived from its declared inputs
(kiln.runtime.inputs), its symbolic dimensions fixed by `--shape NAME=D0,D1,…` as in
`kiln compile`.

    python bench/latency.py [--models bert-base,resnet50,my.onnx] [--shape ids=1,128]
                            [--peers ort,ov] [--rounds 20] [--threads 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import openvino_call, ort_session  # noqa: E402
from bench.zoo import MODELS, ensure_model, make_inputs  # noqa: E402
from kiln import frontend  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime.artifact import TensorInfo, open_artifact  # noqa: E402
from kiln.runtime.inputs import random_inputs  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

PARTITIONERS = ("dnnfusion", "none")
PEERS = ("ort", "ov")
SETTLE_S = 0.05  # pause before each timed call, so no thread pool is still spinning from the last
WARM_S = 0.02  # untimed calls (at least one) after the pause, for at least this long


@dataclass(frozen=True)
class BenchModel:
    """A model to time: its label, ONNX file, fixed input shapes and one set of inputs."""

    name: str
    path: Path
    inputs: dict[str, np.ndarray]
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)  # for symbolic dims


def bench_model(spec: str, shapes: Mapping[str, Sequence[int]] | None = None) -> BenchModel:
    """A zoo name (its full-size export), the name of an architecture outside the zoo
    (bench/unseen.py) or the path of an .onnx file."""
    from bench import unseen

    if spec in MODELS:
        return BenchModel(spec, ensure_model(spec), make_inputs(spec))
    if spec in unseen.MODELS:
        return BenchModel(spec, unseen.ensure_model(spec), unseen.make_inputs(spec))
    path = Path(spec)
    if path.suffix != ".onnx" or not path.is_file():
        raise SystemExit(f"--models: {spec!r} is neither a model of the zoo ({', '.join(MODELS)}) "
                         f"or outside it ({', '.join(unseen.MODELS)}) nor an .onnx file")
    shapes = dict(shapes or {})
    graph = frontend.load(path, shapes)
    declared = [TensorInfo(graph.tensors[t].source_name or t, graph.tensors[t].dtype,
                           tuple(graph.tensors[t].shape)) for t in graph.inputs]
    return BenchModel(path.stem, path, random_inputs(declared, graph), shapes)


@contextmanager
def work_folder(keep: Path | None, prefix: str) -> Iterator[Path]:
    """`keep` (created if missing), or else a temporary folder removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def kiln_artifact(model: BenchModel, partitioner: str, work: Path) -> Path:
    """`model` compiled with `partitioner` into `work` (kept there and reused by later runs
    given the same folder)."""
    out = work / f"{model.name}-{partitioner}.kiln"
    if not out.exists():
        start = time.perf_counter()
        compile_artifact(model.path, out, CompileOptions(partitioner=partitioner,
                                                         shapes=model.shapes), default_store())
        print(f"  compiled {model.name} with {partitioner} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    return out


def contenders(model: BenchModel, threads: int, work: Path,
               peers: Sequence[str] = PEERS) -> tuple[dict[str, Callable], dict[str, str]]:
    """Callables running one inference each (by contender name; onnxruntime's, "ort", always
    there as the reference), and the contenders that could not be built, with the reason."""
    inputs = model.inputs
    session = ort_session(model.path, threads)
    calls: dict[str, Callable] = {"ort": lambda: session.run(None, inputs)}
    failures = {}
    if "ov" in peers:
        try:
            calls["ov"] = openvino_call(model.path, inputs, threads)
        except RuntimeError as exc:  # OpenVINO reports unsupported models as RuntimeError
            failures["ov"] = str(exc).strip().splitlines()[0]
    for partitioner in PARTITIONERS:
        try:
            out = kiln_artifact(model, partitioner, work)
            compiled = CompiledModel(open_artifact(out, work / "extracted" / out.stem), threads)
        except KilnError as exc:
            failures[partitioner] = str(exc).splitlines()[0]
            continue
        calls[partitioner] = lambda compiled=compiled: compiled.run(**inputs)
    return calls, failures


def max_diff(calls: dict[str, Callable]) -> dict[str, float]:
    reference = calls["ort"]()
    return {name: max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(call(), reference))
            for name, call in calls.items() if name != "ort"}


def interleaved_medians(calls: dict[str, Callable], rounds: int, warmup: int,
                        settle_s: float = SETTLE_S) -> dict[str, float]:
    """Median milliseconds per call over `interleaved_times`' rounds."""
    return wall_ms(interleaved_times(calls, rounds, warmup, settle_s), statistics.median)


def tenth_percentile(values: Sequence[float]) -> float:
    """The value a tenth of the way up the sorted values (the fastest of fewer than ten)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 10]


def wall_ms(times: dict[str, dict[str, list[float]]],
            statistic: Callable[[Sequence[float]], float]) -> dict[str, float]:
    """`statistic` of each contender's wall times from `interleaved_times`, in milliseconds."""
    return {name: statistic(t["wall"]) * 1e3 for name, t in times.items()}


def settle_and_warm(call: Callable, settle_s: float = SETTLE_S) -> None:
    """A pause of `settle_s`, then untimed calls for at least `WARM_S` (at least one): what
    precedes every timed call (`interleaved_times`)."""
    time.sleep(settle_s)
    warm_until = time.perf_counter() + WARM_S
    call()
    while time.perf_counter() < warm_until:
        call()


def interleaved_times(calls: dict[str, Callable], rounds: int, warmup: int,
                      settle_s: float = SETTLE_S) -> dict[str, dict[str, list[float]]]:
    """Seconds of each call in every round, by name: "wall" (perf_counter) and "cpu" (the
    process's CPU time, all its threads; a call whose threads were descheduled by another process
    loses wall time, not CPU time). One call each per round; the order rotates every round and
    each timed call starts after a pause: a thread pool spins for a while after its call returns
    (onnxruntime's and OpenMP's both do), and whoever always ran next would pay for it. After the
    pause come untimed calls for `WARM_S`: on a VM the first calls after an idle pause run
    several times slower while the sleeping threads' virtual CPUs come back."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            settle_and_warm(calls[name], settle_s)
            start, start_cpu = time.perf_counter(), time.process_time()
            calls[name]()
            times[name]["wall"].append(time.perf_counter() - start)
            times[name]["cpu"].append(time.process_time() - start_cpu)
    return times


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def zoo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every zoo benchmark that compiles artifacts takes (see `bench_models`)."""
    parser.add_argument("--models", default="zoo",
                        help="comma-separated model names (bench/zoo.py, bench/unseen.py), "
                             ".onnx paths, and the groups zoo and unseen (default: zoo)")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                        help="value of an .onnx input's symbolic dimensions (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="compile into (and reuse artifacts from) DIR")
    return parser


def bench_models(args: argparse.Namespace) -> Iterator[BenchModel]:
    """The models `zoo_arguments` named, one at a time (each is exported or loaded on demand)."""
    try:
        shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    except KilnError as exc:
        raise SystemExit(f"--shape: {exc}") from None
    from bench import unseen

    groups = {"zoo": list(MODELS), "unseen": list(unseen.MODELS)}
    for spec in filter(None, (s.strip() for s in args.models.split(","))):
        for name in groups.get(spec, [spec]):
            yield bench_model(name, shapes)


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="runtimes to compare with: ort (onnxruntime, always run as the "
                             "reference of the outputs), ov (OpenVINO); default both")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= set(PEERS):
        parser.error(f"--peers: choose from {', '.join(PEERS)}")
    columns = ("dnnfusion", "none", *peers)
    header = (f"{'model':16s} " + " ".join(f"{_LABELS[c] + ' ms':>12s}" for c in columns) +
              f" {'dnnf/fastest':>12s} {'p10':>8s} {'none/fastest':>12s} {'none/dnnf':>9s} "
              f"{'max|diff| dnnf':>14s} {'max|diff| ov':>12s}")
    rows, notes = [], []
    ratios: dict[str, list[float]] = {key: [] for key in ("dnnfusion", "none", *(
        f"dnnfusion/{p}" for p in peers))}
    quiet_ratios: list[float] = []  # dnnfusion / fastest peer by 10th-percentile calls
    with work_folder(args.keep, "kiln-latency-") as work:
        for model in bench_models(args):
            calls, failures = contenders(model, args.threads, work, peers)
            notes += [f"{model.name} [{p}]: {reason}" for p, reason in failures.items()]
            diffs = max_diff(calls)
            times = interleaved_times(calls, args.rounds, args.warmup)
            ms = wall_ms(times, statistics.median)
            fastest = min(ms[p] for p in peers if p in ms)
            for key in ratios:
                ours, _, peer = key.partition("/")
                if ours in ms and (not peer or peer in ms):
                    ratios[key].append(ms[ours] / (ms[peer] if peer else fastest))
            quiet = wall_ms(times, tenth_percentile)
            quiet_fastest = min(quiet[p] for p in peers if p in quiet)
            if "dnnfusion" in quiet:
                quiet_ratios.append(quiet["dnnfusion"] / quiet_fastest)
            rows.append(f"{model.name:16s} " +
                        " ".join(f"{_ms(ms.get(c)):>12s}" for c in columns) +
                        f" {ratio(ms.get('dnnfusion'), fastest):>12s}"
                        f" {ratio(quiet.get('dnnfusion'), quiet_fastest):>8s}"
                        f" {ratio(ms.get('none'), fastest):>12s}"
                        f" {ratio(ms.get('none'), ms.get('dnnfusion')):>9s}"
                        f" {diffs.get('dnnfusion', float('nan')):14.3g}"
                        f" {diffs.get('ov', float('nan')):12.3g}")
            print(rows[-1], file=sys.stderr)
    print(f"median latency, {args.threads} threads, {args.rounds} interleaved rounds; "
          f"fastest = the faster of {', '.join(_LABELS[p] for p in peers)}")
    print(header)
    print("\n".join(rows))
    for key, values in ratios.items():
        if values:
            ours, _, peer = key.partition("/")
            against = _LABELS[peer] if peer else "fastest peer"
            print(f"geomean {_LABELS[ours]} / {against}: "
                  f"{statistics.geometric_mean(values):.2f} over {len(values)} model(s)")
    if quiet_ratios:
        print(f"geomean dnnfusion / fastest peer by 10th-percentile calls: "
              f"{statistics.geometric_mean(quiet_ratios):.2f} over {len(quiet_ratios)} model(s)")
    for note in notes:
        print(f"not built: {note}")
    return 0


_LABELS = {"dnnfusion": "dnnfusion", "none": "none", "ort": "ort", "ov": "openvino"}


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
