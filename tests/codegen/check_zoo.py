"""Run zoo models end to end through the generated kernels and compare with onnxruntime.

    python -m tests.codegen.check_zoo                 # tiny fixtures, all partitioners
    python -m tests.codegen.check_zoo --full          # bench/models (not in git; slow)
    python -m tests.codegen.check_zoo --full --models resnet50 gpt2 --partitioners dnnfusion

Prints one line per (model, partitioner): kernels, compile+run time, worst error vs allowed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from kiln import frontend
from tests.codegen.harness import PARTITIONERS, max_error, reference, run_graph

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "zoo"
FULL = ROOT / "bench" / "models"


def model_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid inputs: token ids in [0, 100), attention masks of ones, floats ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        t = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim)
        if np.dtype(dtype).kind == "f":
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in value.name:
            feeds[value.name] = np.ones(shape, dtype=dtype)
        elif "type" in value.name:
            feeds[value.name] = np.zeros(shape, dtype=dtype)
        else:
            feeds[value.name] = rng.integers(0, 100, size=shape).astype(dtype)
    return feeds


def check(path: Path, partitioners: list[str]) -> bool:
    model = onnx.load(str(path))
    inputs = model_inputs(model)
    want = reference(model, inputs)
    graph = frontend.load(path, {n: v.shape for n, v in inputs.items()})
    ok = True
    for name in partitioners:
        start = time.perf_counter()
        try:
            got = run_graph(graph, name, inputs)
        except Exception as exc:  # noqa: BLE001  (report it and go on with the next model)
            print(f"{path.stem:16s} {name:9s} FAILED: {type(exc).__name__}: {exc}"[:400])
            ok = False
            continue
        seconds = time.perf_counter() - start
        errors = [max_error(g, w) for g, w in zip(got, want)]
        worst = max(errors, key=lambda e: e[0] - e[1])
        passed = all(e <= a for e, a in errors) and all(g.dtype == w.dtype for g, w in zip(got, want))
        ok &= passed
        print(f"{path.stem:16s} {name:9s} {'ok  ' if passed else 'FAIL'} max|diff| {worst[0]:.3g} "
              f"(allowed {worst[1]:.3g}), {seconds:.1f} s", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="use bench/models instead of fixtures")
    parser.add_argument("--models", nargs="*", help="model names (default: all)")
    parser.add_argument("--partitioners", nargs="*", default=list(PARTITIONERS))
    args = parser.parse_args(argv)
    folder = FULL if args.full else TINY
    paths = sorted(p for p in folder.glob("*.onnx") if not args.models or p.stem in args.models)
    results = [check(p, args.partitioners) for p in paths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
