"""Each lowering of a conv, forced, timed side by side with onnxruntime on a one-node model.

For each conv shape (a Conv with bias and a ReLU after it, batch 1), the conv is compiled once
per form Kiln can run it as — `wino` (Winograd F(2×2, 3×3)), `direct` (the direct GEMM over the
padded input, pixels as columns), `prows` (the direct kernel with pixels as rows), `gemmT` (the
transposed GEMM on a packed im2col, or a 1 × 1's GEMM with pixels as rows), `gemm` (a 1 × 1's
plain GEMM), `implicit` (the implicit GEMM) — plus `auto`, the form Kiln's cost models choose,
and all run interleaved with onnxruntime (see `bench.latency.interleaved_times`). `--chain N`
times a chain of N such convs instead, each with weights of its own, so that they come from
memory as in a whole model (weights cached, Winograd's 16/9 of them look cheaper than they are).
Prints the fastest and median wall and CPU milliseconds per contender (per conv of a chain).

    python bench/conv_forms.py [--convs resnet50|CIN,COUT,K,STRIDE,HW[;...]] [--rounds 30]
                               [--threads 2] [--forms auto,wino,direct,...] [--target host]
                               [--chain N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import interleaved_times  # noqa: E402
from bench.peers import ort_session  # noqa: E402
from kiln.codegen.ops import conv as conv_module  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

# ResNet-50 v1.5's distinct convs: (in channels, out channels, kernel, stride, input size)
RESNET50 = [
    (3, 64, 7, 2, 224),
    (64, 64, 3, 1, 56), (128, 128, 3, 1, 28), (256, 256, 3, 1, 14), (512, 512, 3, 1, 7),
    (128, 128, 3, 2, 56), (256, 256, 3, 2, 28), (512, 512, 3, 2, 14),
    (256, 512, 1, 2, 56), (512, 1024, 1, 2, 28), (1024, 2048, 1, 2, 14),
    (64, 64, 1, 1, 56), (64, 256, 1, 1, 56), (256, 64, 1, 1, 56), (256, 128, 1, 1, 56),
    (128, 512, 1, 1, 28), (512, 128, 1, 1, 28), (512, 256, 1, 1, 28),
    (256, 1024, 1, 1, 14), (1024, 256, 1, 1, 14), (1024, 512, 1, 1, 14),
    (512, 2048, 1, 1, 7), (2048, 512, 1, 1, 7),
]
FORMS = ("auto", "wino", "direct", "prows", "gemmT", "gemm", "implicit")


def conv_model(path: Path, cin: int, cout: int, k: int, stride: int, hw: int,
               depth: int = 1) -> None:
    """Conv (bias) + ReLU; `depth` > 1: a chain of so many, each with weights of its own (a
    conv whose output is its input's shape), so that they come from memory as in a model."""
    rng = np.random.default_rng(0)
    out = (hw + 2 * (k // 2) - k) // stride + 1
    if depth > 1 and (cin, hw) != (cout, out):
        raise SystemExit(f"--chain needs convs that keep their input's shape, not {cin}->{cout}")
    nodes, weights, x = [], [], "x"
    for i in range(depth):
        weight = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        bias = rng.standard_normal(cout).astype(np.float32) * 0.1
        weights += [numpy_helper.from_array(weight, f"w{i}"),
                    numpy_helper.from_array(bias, f"b{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[k, k],
                                   strides=[stride, stride], pads=[k // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, cout, out, out])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@contextmanager
def forced(form: str):
    """Patch conv.py's choices so that `form` is taken where it applies."""
    m = conv_module
    saved = {name: getattr(m, name) for name in
             ("winograd_tile_size", "pixel_rows_wins", "_pixels_as_rows", "direct_applies")}
    if form != "auto":
        if form != "wino":
            m.winograd_tile_size = lambda *a, **k: 0
        m.pixel_rows_wins = lambda *a, **k: form == "prows"
        m._pixels_as_rows = lambda *a, **k: form == "gemmT"
        if form == "implicit":
            m.direct_applies = lambda *a, **k: False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(m, name, value)


def applies(form: str, cin: int, k: int, stride: int) -> bool:
    if form == "wino":
        return k == 3 and stride == 1
    if form == "gemm":
        return k == 1 and stride == 1
    if form in ("direct", "prows", "implicit"):
        return not (k == 1 and stride == 1)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convs", default="resnet50")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default="host")
    parser.add_argument("--chain", type=int, default=1,
                        help="time chains of so many convs, each its own weights (per conv)")
    args = parser.parse_args()
    convs = RESNET50 if args.convs == "resnet50" else [
        tuple(int(v) for v in spec.split(",")) for spec in args.convs.split(";")]
    forms = args.forms.split(",")
    with tempfile.TemporaryDirectory(prefix="conv_forms") as tmp:
        work = Path(tmp)
        for number, (cin, cout, k, stride, hw) in enumerate(convs):
            model = work / f"conv{number}.onnx"
            conv_model(model, cin, cout, k, stride, hw, args.chain)
            x = np.random.default_rng(1).standard_normal((1, cin, hw, hw)).astype(np.float32)
            session = ort_session(model, args.threads)
            calls = {"ort": lambda session=session: session.run(None, {"x": x})}
            reference = calls["ort"]()[0]
            described = {}
            for form in forms:
                if not applies(form, cin, k, stride):
                    continue
                art = work / f"conv{number}-{form}.kiln"
                try:
                    with forced(form):
                        report = compile_artifact(model, art, CompileOptions(
                            target=args.target, tune="off"), default_store())
                except KilnError as exc:
                    print(f"  {form}: {exc}", file=sys.stderr)
                    continue
                compiled = CompiledModel(open_artifact(art, work / "x" / art.stem), args.threads)
                diff = float(np.max(np.abs(compiled.run(x=x)[0] - reference))
                         / max(float(np.max(np.abs(reference))), 1e-30))
                described[form] = _form_of(art, diff)
                calls[form] = lambda compiled=compiled: compiled.run(x=x)
            times = interleaved_times(calls, args.rounds, 2)
            # on a shared machine the fastest rounds are those no other process interrupted
            per_conv = 1e3 / args.chain
            best = {n: min(t["wall"]) * per_conv for n, t in times.items()}
            fastest_cpu = {n: min(t["cpu"]) * per_conv for n, t in times.items()}
            wall = {n: statistics.median(t["wall"]) * per_conv for n, t in times.items()}
            cpu = {n: statistics.median(t["cpu"]) * per_conv for n, t in times.items()}
            print(f"conv {cin}->{cout} k{k} s{stride} @{hw} (ms min/median wall, min/median cpu): "
                  + "  ".join(f"{n} {best[n]:.3f}/{wall[n]:.3f} {fastest_cpu[n]:.3f}/{cpu[n]:.3f}"
                              for n in calls),
                  flush=True)
            for form, text in described.items():
                print(f"    {form:8s} {best[form] / best['ort']:.2f}x ort (min wall), "
                      f"{cpu[form] / cpu['ort']:.2f}x (median cpu)  {text}",
                      flush=True)


def _form_of(art: Path, diff: float) -> str:
    """The max |diff| against onnxruntime and the conv's form, micro-kernel and blocking."""
    with zipfile.ZipFile(art) as archive:
        plan = json.loads(archive.read("plan.json"))
    parts = []
    for kernel in plan["kernels"]:
        for stage in kernel["schedule"].get("stages", []):
            if "form" in stage:
                parts.append(" ".join(f"{key}={stage[key]}" for key in
                                      ("form", "micro_kernel", "mc", "nc", "kc", "tasks", "grid",
                                       "input_copy") if key in stage))
    return f"rel. diff {diff:.1e}  " + "; ".join(dict.fromkeys(parts))


if __name__ == "__main__":
    main()
