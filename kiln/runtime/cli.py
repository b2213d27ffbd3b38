"""`kiln run`, `kiln verify` and `kiln bench`: running a compiled artifact.

Artifacts built for another architecture run through their runner under qemu-<arch>.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

import numpy as np

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.runtime.artifact import Artifact

# The frontend and the runtime (which loads the code generator) are imported by the commands that
# use them, so that building the parser of every `kiln` command does not load them.

RTOL = 1e-3  # verify: max|diff| <= RTOL * max|ref| + ATOL
ATOL = 1e-5


THREADS_HELP = ("threads (0: $KILN_NUM_THREADS, else $OMP_NUM_THREADS, else the CPUs this "
                "process may run on)")


def add_commands(commands) -> None:
    run = commands.add_parser("run", help="run a compiled artifact on inputs from an .npz file")
    run.add_argument("artifact", help="a model.kiln file")
    run.add_argument("--inputs", required=True, metavar="IN.npz", help="arrays by input name")
    run.add_argument("--outputs", required=True, metavar="OUT.npz", help="write outputs here")
    run.add_argument("--threads", type=_at_least(0), metavar="T",
                     help=THREADS_HELP)
    run.set_defaults(handler=_run)

    verify = commands.add_parser("verify", help="compare an artifact with onnxruntime")
    verify.add_argument("artifact", help="a model.kiln file")
    verify.add_argument("model", help="the .onnx model it was compiled from")
    verify.add_argument("--inputs", metavar="IN.npz", help="inputs (default: random valid ones)")
    verify.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                        help="input shapes the artifact was compiled with (default: its own)")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    verify.add_argument("--threads", type=_at_least(0), metavar="T",
                        help=THREADS_HELP)
    verify.set_defaults(handler=_verify)

    bench = commands.add_parser("bench", help="measure an artifact's latency with its runner")
    bench.add_argument("artifact", help="a model.kiln file")
    bench.add_argument("--runs", type=_at_least(1), default=20, metavar="N", help="timed runs")
    bench.add_argument("--warmup", type=_at_least(0), default=3, metavar="W",
                       help="untimed runs first")
    bench.add_argument("--threads", type=_at_least(0), metavar="T",
                       help=THREADS_HELP)
    bench.add_argument("--inputs", metavar="IN.npz", help="inputs (default: random ones)")
    bench.add_argument("--json", action="store_true", help="print the runner's JSON")
    bench.add_argument("--kernels", type=_at_least(0), default=0, metavar="K",
                       help="also list the K slowest kernels with their stages")
    bench.set_defaults(handler=_bench)


def _at_least(minimum: int):
    """An argparse type: an integer >= minimum (argparse names the option in its error)."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value
    return integer


# ---------------------------------------------------------------------------------------------

def _run(args: argparse.Namespace) -> int:
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.execute import run_artifact

    artifact = open_artifact(args.artifact)
    outputs = run_artifact(artifact, read_npz(args.inputs), args.threads)
    names = _unique([t.name for t in artifact.outputs])
    np.savez(args.outputs, **dict(zip(names, outputs)))
    print(f"wrote {len(outputs)} output(s) to {args.outputs}: {', '.join(names)}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from kiln import frontend
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.execute import run_artifact
    from kiln.runtime.inputs import random_inputs

    artifact = open_artifact(args.artifact)
    model = frontend.read_model(args.model)
    _check_input_names(artifact, model)
    given = dict(frontend.parse_shape_arg(s) for s in args.shape)
    shapes = {t.name: list(t.shape) for t in artifact.inputs} | given
    graph = frontend.build(model, shapes, Path(args.model).stem)
    _check_shapes(artifact, graph)
    inputs = read_npz(args.inputs) if args.inputs else random_inputs(artifact.inputs, graph, args.seed)
    ours = run_artifact(artifact, inputs, args.threads)
    names, reference = run_onnxruntime(args.model, inputs)
    rows = [compare(name, got, want) for name, got, want in zip(names, ours, reference)]
    print(format_comparison(rows))
    failed = [r["output"] for r in rows if not r["ok"]]
    if failed:
        print(f"FAILED: {len(failed)} of {len(rows)} output(s) beyond tolerance: {', '.join(failed)}")
        return 1
    print(f"ok: {len(rows)} output(s) within max|diff| <= {RTOL:g}*max|ref| + {ATOL:g}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.execute import run_runner, runner_prefix, runs_natively
    from kiln.runtime.inputs import random_inputs

    artifact = open_artifact(args.artifact)
    inputs = read_npz(args.inputs) if args.inputs else random_inputs(artifact.inputs)
    result = run_runner(artifact, inputs, args.runs, args.warmup, args.threads, keep_outputs=False)
    if not runs_natively(artifact):
        emulator = Path(runner_prefix(artifact)[0]).name
        print(f"warning: this {artifact.arch} artifact ran under {emulator} on this "
              f"{platform.machine()} machine: its times are emulated, not what a {artifact.arch} "
              f"device measures", file=sys.stderr)
    if args.json:
        print(json.dumps(result.timing, indent=2))
        return 0
    latency = result.timing["latency_ns"]
    print(f"{artifact.manifest['model']} ({artifact.arch}, {len(result.timing['kernels'])} "
          f"kernels, {result.timing['threads']} threads, {result.timing['runs']} runs)")
    print("  ".join(f"{key} {latency[key] / 1e6:.4g} ms" for key in ("median", "p10", "p90")))
    if args.kernels > 0:
        print(format_kernel_times(result.timing["kernels"], artifact.plan, args.kernels))
    return 0


def format_kernel_times(kernels: Sequence[dict[str, Any]], plan: dict[str, Any], most: int) -> str:
    """The `most` slowest kernels (median of the runs), with their share of the kernels' total
    and how each stage was generated (from the plan's recorded schedules)."""
    stages = {k["symbol"]: k.get("schedule", {}).get("stages", []) for k in plan.get("kernels", [])}
    total = sum(k["median_ns"] for k in kernels) or 1
    lines = [f"{'kernel':48s} {'median ms':>10s} {'share':>6s}  stages"]
    for k in sorted(kernels, key=lambda k: -k["median_ns"])[:most]:
        forms = "; ".join(_stage_summary(s) for s in stages.get(k["symbol"], []))
        lines.append(f"{k['symbol'][:48]:48s} {k['median_ns'] / 1e6:10.3f} "
                     f"{100 * k['median_ns'] / total:5.1f}%  {forms}")
    lines.append(f"{'all ' + str(len(kernels)) + ' kernels':48s} {total / 1e6:10.3f}")
    return "\n".join(lines)


def _stage_summary(stage: dict[str, Any]) -> str:
    name = stage.get("stage", "?")
    if stage.get("form") == "packed":
        return f"{name} [{stage['micro_kernel']}, mc {stage['mc']} nc {stage['nc']} kc {stage['kc']}]"
    return name


# ---------------------------------------------------------------------------------------------

def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise KilnError(f"cannot read inputs from {path}: {exc}") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise KilnError(f"{path} is not an .npz archive (save inputs with numpy.savez)")
    with archive:
        return {name: archive[name] for name in archive.files}


def _unique(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name] - 1}")
    return unique


def _check_input_names(artifact: Artifact, model) -> None:
    """The artifact must have been compiled from this model: the same inputs, by name."""
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    compiled = [t.name for t in artifact.inputs]
    if compiled != names:
        raise KilnError(f"the artifact's inputs ({', '.join(compiled)}) do not match the model's "
                        f"({', '.join(names)}): was it compiled from another model?")


def _check_shapes(artifact: Artifact, graph) -> None:
    for info, tensor in zip(artifact.inputs, graph.inputs):
        if tuple(graph.tensors[tensor].shape) != info.shape:
            raise KilnError(f"input {info.name!r}: the artifact was compiled for shape "
                            f"{list(info.shape)}, not {list(graph.tensors[tensor].shape)}")


def run_onnxruntime(model: str | Path, inputs: dict[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
    import onnxruntime

    from kiln import frontend

    proto = frontend.read_model(model)
    proto.ir_version = min(proto.ir_version, frontend.FOLD_IR_VERSION)  # newer than ORT reads
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(proto.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feeds = {i.name: inputs[i.name] for i in session.get_inputs() if i.name in inputs}
    return names, session.run(names, feeds)


def compare(name: str, got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """Exact for integer and bool outputs; else max|diff| <= RTOL*max|ref| + ATOL (NaNs must match)."""
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"output": name, "max_abs": float("inf"), "max_ref": 0.0, "rel": float("inf"),
                "ok": False, "note": f"got {got.dtype} {list(got.shape)}, expected "
                                     f"{want.dtype} {list(want.shape)}"}
    wide_got, wide_want = got.astype(np.float64), want.astype(np.float64)
    diff = np.where(wide_got == wide_want, 0.0, np.abs(wide_got - wide_want))
    if want.dtype.kind != "f":
        max_abs = float(np.max(diff, initial=0.0))
        return {"output": name, "max_abs": max_abs, "max_ref": 0.0, "rel": max_abs,
                "ok": max_abs == 0, "note": "exact"}
    same_nan = np.isnan(wide_got) == np.isnan(wide_want)
    compared = ~np.isnan(wide_got) & ~np.isnan(wide_want)
    max_abs = float(np.max(diff, where=compared, initial=0.0))
    max_ref = float(np.max(np.abs(wide_want), where=compared & np.isfinite(wide_want), initial=0.0))
    ok = bool(same_nan.all()) and max_abs <= RTOL * max_ref + ATOL
    return {"output": name, "max_abs": max_abs, "max_ref": max_ref,
            "rel": max_abs / max_ref if max_ref else max_abs, "ok": ok,
            "note": "" if same_nan.all() else "NaNs differ"}


def format_comparison(rows: list[dict[str, Any]]) -> str:
    width = max([len("output")] + [len(r["output"]) for r in rows])
    lines = [f"{'output'.ljust(width)}  {'max|diff|':>10}  {'max|ref|':>10}  {'rel':>10}  result"]
    for r in rows:
        status = "ok" if r["ok"] else "FAIL"
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"{r['output'].ljust(width)}  {r['max_abs']:10.3g}  {r['max_ref']:10.3g}  "
                     f"{r['rel']:10.3g}  {status}{note}")
    return "\n".join(lines)

