"""Kiln's generated GEMM against numpy's matmul (OpenBLAS), onnxruntime's MatMul (MLAS) and
OpenVINO's, all on 2 threads, side by side.

The shapes are the MatMul/Gemm ops of the full-size zoo (`bench/models/*.onnx`, read through
Kiln's frontend: distinct operand shapes, weights constant or not) plus square 512…2048. For
each shape a one-op ONNX model is built — constant weights as an initializer (Kiln pre-packs
them at compile time), or two activation inputs for the batched MatMuls of attention — compiled
through Kiln's real compile path (`compile_artifact`, optionally `--tune quick|full`) and run
in-process by the artifact's loader. numpy computes the same function (`np.matmul` into a
preallocated output, plus Gemm's bias) on the same arrays; onnxruntime and OpenVINO run the same
one-op model file (bench/peers.py: each set up as in bench/latency.py). Blocks of calls of each
contender alternate, in a rotating order, so machine noise hits all alike; each side's median
time gives GFLOP/s (2·batch·M·N·K).
Prints one row per shape with kiln's ratio to each peer, then the geometric means of the ratios
over the zoo shapes and over the squares, of the medians and of the best (fastest) calls, which a
loaded machine disturbs less. Issue 13's target: kiln/ort ≥ 0.95 over the zoo shapes.

    python bench/gemm.py [--threads 2] [--tune off|quick|full] [--tune-budget S]
                         [--only zoo|square] [--max-shapes N] [--seconds 0.4]
                         [--peers numpy,ort,ov] [--shapes 197x768x3072,1x768x768,...]
                         [--clock wall|cpu]

`--shapes` times MatMuls of the given M×K×N (constant weights) instead of the
zoo's; `--clock cpu` compares the process's CPU time per call (all its threads), which other
processes on a loaded machine disturb less than wall time.
"""
from __future__ import annotations

import argparse
import os
import sys

_THREADS = "2"
for _i, _a in enumerate(sys.argv):  # the BLAS reads its thread count when numpy is imported
    if _a == "--threads" and _i + 1 < len(sys.argv):
        _THREADS = sys.argv[_i + 1]
    elif _a.startswith("--threads="):
        _THREADS = _a.split("=", 1)[1]
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _THREADS

import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import openvino_call, ort_session  # noqa: E402
from kiln import frontend  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

MODELS = ROOT / "bench" / "models"
SQUARES = (512, 1024, 1536, 2048)
PEERS = ("numpy", "ort", "ov")


@dataclass(frozen=True)
class Case:
    op: str  # "MatMul" or "Gemm"
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    b_constant: bool
    trans_b: int = 0
    bias: tuple[int, ...] | None = None  # Gemm's C
    origin: str = "square"  # the zoo models it occurs in, or "square"

    @property
    def mnk(self) -> tuple[int, int, int, int]:
        """(batch, M, N, K) of the contraction."""
        if self.op == "Gemm":
            m, k = self.a_shape
            n = self.b_shape[0] if self.trans_b else self.b_shape[1]
            return 1, m, n, k
        a = self.a_shape if len(self.a_shape) > 1 else (1, *self.a_shape)
        b = self.b_shape if len(self.b_shape) > 1 else (*self.b_shape, 1)
        batch = math.prod(np.broadcast_shapes(a[:-2], b[:-2]))
        return batch, a[-2], b[-1], a[-1]

    @property
    def flops(self) -> int:
        batch, m, n, k = self.mnk
        return 2 * batch * m * n * k

    def label(self) -> str:
        batch, m, n, k = self.mnk
        kind = "W" if self.b_constant else "A×A"
        head = f"{self.op}{'ᵀ' if self.trans_b else ''} {kind}"
        return f"{head:10s} b={batch:<3d} M={m:<5d} N={n:<5d} K={k:<5d}"


def zoo_cases() -> list[Case]:
    """Distinct MatMul/Gemm operand shapes of the full-size zoo (read through Kiln's frontend)."""
    found: dict[tuple, Case] = {}
    origins: dict[tuple, list[str]] = {}
    paths = sorted(MODELS.glob("*.onnx"))
    if not paths:
        raise SystemExit(f"no models in {MODELS}: run `python bench/zoo.py --size full` first")
    for path in paths:
        graph = frontend.build(frontend.read_model(path), {}, path.stem)
        for op in graph.ops:
            if op.op_type not in ("MatMul", "Gemm"):
                continue
            a, b = (graph.tensors[t] for t in op.inputs[:2])
            if op.op_type == "Gemm" and op.attrs.get("transA", 0):
                continue  # not in the zoo; numpy's counterpart would need a copy
            c = graph.tensors[op.inputs[2]] if len(op.inputs) > 2 and op.inputs[2] else None
            case = Case(op.op_type, tuple(a.shape), tuple(b.shape), b.is_constant,
                        int(op.attrs.get("transB", 0)) if op.op_type == "Gemm" else 0,
                        tuple(c.shape) if c is not None else None)
            key = (case.op, case.a_shape, case.b_shape, case.b_constant, case.trans_b, case.bias)
            found.setdefault(key, case)
            if path.stem not in origins.setdefault(key, []):
                origins[key].append(path.stem)
    return [Case(**{**c.__dict__, "origin": ",".join(origins[k])}) for k, c in found.items()]


def shape_cases(shapes: str) -> list[Case]:
    """MatMuls of (1, M, K) by constant (K, N) weights, one per M×K×N of `shapes`."""
    cases = []
    for shape in shapes.split(","):
        m, k, n = (int(d) for d in shape.lower().split("x"))
        cases.append(Case("MatMul", (1, m, k), (k, n), True, origin=f"{m}x{k}x{n}"))
    return cases


def square_cases() -> list[Case]:
    return [Case("MatMul", (n, n), (n, n), True) for n in SQUARES]


def one_op_model(case: Case, rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """The ONNX model, its inputs, and its constants (for numpy)."""
    f32 = TensorProto.FLOAT
    a = rng.standard_normal(case.a_shape).astype(np.float32)
    b = rng.standard_normal(case.b_shape).astype(np.float32)
    inputs = [helper.make_tensor_value_info("A", f32, list(case.a_shape))]
    inits, feeds, consts = [], {"A": a}, {"B": b}
    if case.b_constant:
        inits.append(numpy_helper.from_array(b, "B"))
    else:
        inputs.append(helper.make_tensor_value_info("B", f32, list(case.b_shape)))
        feeds["B"] = b
    names = ["A", "B"]
    attrs = {}
    if case.op == "Gemm":
        attrs["transB"] = case.trans_b
        if case.bias is not None:
            c = rng.standard_normal(case.bias).astype(np.float32)
            inits.append(numpy_helper.from_array(c, "C"))
            consts["C"] = c
            names.append("C")
    node = helper.make_node(case.op, names, ["Y"], **attrs)
    out_shape = _out_shape(case)
    graph = helper.make_graph([node], "gemm", inputs,
                              [helper.make_tensor_value_info("Y", f32, list(out_shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model, feeds, consts


def _out_shape(case: Case) -> tuple[int, ...]:
    if case.op == "Gemm":
        _, m, n, _ = case.mnk
        return (m, n)
    a = case.a_shape if len(case.a_shape) > 1 else (1, *case.a_shape)
    b = case.b_shape if len(case.b_shape) > 1 else (*case.b_shape, 1)
    shape = (*np.broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1])
    if len(case.b_shape) == 1:
        shape = shape[:-1]
    if len(case.a_shape) == 1:
        shape = (*shape[:-2], shape[-1]) if len(case.b_shape) > 1 else shape[:-1]
    return shape


def numpy_call(case: Case, feeds: dict, consts: dict):
    a = feeds["A"]
    b = feeds.get("B", consts["B"])
    if case.op == "Gemm" and case.trans_b:
        b = b.T  # a transposed view: the BLAS reads it as such, no copy
    out = np.empty(_out_shape(case), np.float32)
    bias = consts.get("C")

    def call():
        np.matmul(a, b, out=out)
        if bias is not None:
            np.add(out, bias, out=out)
        return out
    return call


BLOCK = 6  # timed calls per contender and round
MAX_ROUNDS = 20
SETTLE_S = 0.15  # pause before each block: longer than OpenBLAS's workers busy-wait (~0.1 s)
WARM_S = 0.02  # untimed calls at the start of each block: at least 3, for at least this long


def measure(calls: dict, seconds: float,
            clock=time.perf_counter) -> dict[str, tuple[float, float]]:
    """Interleaved (median, best) seconds of `clock`: one call of each per round, rounds until
    each side has run about `seconds`."""
    for call in calls.values():
        call()
    single = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        single[name] = time.perf_counter() - start
    rounds = int(min(MAX_ROUNDS, max(3, seconds / BLOCK / max(max(single.values()), 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        # Blocks of back-to-back calls, in an order that rotates each round. Each block starts
        # after a pause, so the other side's thread pool is no longer spinning (OpenBLAS's
        # workers busy-wait for up to ~0.1 s after a call, libgomp's for ~10 ms), and its first
        # few milliseconds are not timed: on a VM the first calls after an idle pause run
        # several times slower while the sleeping threads' virtual CPUs come back.
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(SETTLE_S)
            warm_until, warm_calls = time.perf_counter() + WARM_S, 0
            while warm_calls < 3 or time.perf_counter() < warm_until:
                calls[name]()
                warm_calls += 1
            for _ in range(BLOCK):
                start = clock()
                calls[name]()
                times[name].append(clock() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def peer_calls(case: Case, path: Path, feeds: dict, consts: dict, peers: list[str],
               threads: int) -> dict:
    """One call per peer computing `case` on `feeds`, each returning the output array."""
    calls = {}
    if "numpy" in peers:
        calls["numpy"] = numpy_call(case, feeds, consts)
    if "ort" in peers:
        session = ort_session(path, threads)
        calls["ort"] = lambda: session.run(None, feeds)[0]
    if "ov" in peers:
        ov_run = openvino_call(path, feeds, threads)
        calls["ov"] = lambda: ov_run()[0]
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tune", default="off", choices=("off", "quick", "full"))
    parser.add_argument("--tune-budget", type=float, default=None, metavar="S",
                        help="tuning budget per shape (default: kiln's per mode)")
    parser.add_argument("--only", choices=("zoo", "square"))
    parser.add_argument("--max-shapes", type=int, default=0, help="first N zoo shapes only")
    parser.add_argument("--seconds", type=float, default=0.4,
                        help="time per contender per shape (sets the rounds)")
    parser.add_argument("--shapes", help="comma-separated MxKxN products instead of the zoo's")
    parser.add_argument("--clock", default="wall", choices=CLOCKS,
                        help="wall time, or the process's CPU time (all threads)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="references: numpy, ort (onnxruntime), ov (OpenVINO); default all")
    args = parser.parse_args(argv)
    if str(args.threads) != os.environ["OPENBLAS_NUM_THREADS"]:
        raise SystemExit("--threads must be given on the command line (read before numpy loads)")
    peers = [p for p in args.peers.split(",") if p]
    if not peers or not set(peers) <= set(PEERS):
        parser.error(f"--peers: choose from {', '.join(PEERS)}")

    cases = []
    if args.shapes:
        cases += shape_cases(args.shapes)
    elif args.only != "square":
        zoo = zoo_cases()
        cases += zoo[:args.max_shapes] if args.max_shapes else zoo
    if args.only != "zoo" and not args.shapes:
        cases += square_cases()
    store = default_store()
    rng = np.random.default_rng(0)
    options = CompileOptions(tune=args.tune, tune_budget=args.tune_budget)
    print(f"kiln GEMM vs {', '.join(_LABELS[p] for p in peers)} (numpy {np.__version__} with "
          f"{_blas_name()}), {args.threads} threads, tune={args.tune}, {args.clock} time")
    header = (f"{'shape':48s} {'kiln GF/s':>10s} " +
              " ".join(f"{_LABELS[p] + ' GF/s':>13s}" for p in peers) + " " +
              " ".join(f"{'k/' + p:>7s}" for p in peers) + f" {'max|diff|':>9s}  models")
    print(header)
    ratios: dict[tuple[str, str, str], list[float]] = {}  # (group, peer, median|best)
    failures = []
    with tempfile.TemporaryDirectory(prefix="kiln-gemm-") as tmp:
        for i, case in enumerate(cases):
            model, feeds, consts = one_op_model(case, rng)
            path = Path(tmp) / f"case{i}.onnx"
            onnx.save(model, path)
            try:
                compile_artifact(path, Path(tmp) / f"case{i}.kiln", options, store)
                compiled = CompiledModel(open_artifact(Path(tmp) / f"case{i}.kiln",
                                                       Path(tmp) / "x"), args.threads)
            except KilnError as exc:
                failures.append(f"{case.label()}: {str(exc).splitlines()[0]}")
                continue
            calls = {"kiln": lambda: compiled.run(**feeds)[0],
                     **peer_calls(case, path, feeds, consts, peers, args.threads)}
            theirs = numpy_call(case, feeds, consts)()
            diff = max(float(np.max(np.abs(call() - theirs))) for call in calls.values())
            ms = measure(calls, args.seconds, CLOCKS[args.clock])
            group = "square" if case.origin == "square" else "zoo"
            for peer in peers:
                ratios.setdefault((group, peer, "median"), []).append(ms[peer][0] / ms["kiln"][0])
                ratios.setdefault((group, peer, "best"), []).append(ms[peer][1] / ms["kiln"][1])
            gflops = {name: case.flops / t[0] / 1e9 for name, t in ms.items()}
            print(f"{case.label():48s} {gflops['kiln']:10.1f} " +
                  " ".join(f"{gflops[p]:13.1f}" for p in peers) + " " +
                  " ".join(f"{ms[p][0] / ms['kiln'][0]:7.2f}" for p in peers) +
                  f" {diff:9.2g}  {case.origin}", flush=True)
            compiled.close()
    for group in ("zoo", "square"):
        for peer in peers:
            medians, best = ratios.get((group, peer, "median")), ratios.get((group, peer, "best"))
            if medians:
                print(f"geomean kiln/{peer} over {group} shapes ({len(medians)}): "
                      f"{statistics.geometric_mean(medians):.2f} (medians), "
                      f"{statistics.geometric_mean(best):.2f} (best times)")
    for failure in failures:
        print(f"not compiled: {failure}")
    return 0


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_LABELS = {"numpy": "numpy", "ort": "ort", "ov": "openvino"}


def _blas_name() -> str:
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:
        return "BLAS"


if __name__ == "__main__":
    sys.exit(main())
