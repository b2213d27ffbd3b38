"""Latency of Kiln's CUDA artifacts on an NVIDIA GPU against PyTorch on the same GPU.

For each model: the artifact compiled for a CUDA target (default: this machine's GPU's own
architecture) with dnnfusion and with partitioner none, run in-process through the loader, and —
for zoo models, whose torch modules bench/zoo.py builds — the same seeded torch module in eager
mode on the GPU (float32, TF32 off for matrix products and convolutions, so every contender does
float32 arithmetic). Every call starts from host arrays and ends with host arrays (the artifact's
run copies inputs in and outputs out; torch's call does the same), so the figures are what a user
of each sees. Calls are interleaved (bench/latency.py's `interleaved_medians`); onnxruntime on the
CPU gives the reference outputs, and the table prints each contender's max |diff| from them.

    python bench/gpu_latency.py [--models resnet50,bert-base,my.onnx] [--target cuda-sm90]
                                [--rounds 20] [--keep DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import (  # noqa: E402
    BenchModel,
    bench_models,
    interleaved_medians,
    ratio,
    work_folder,
    zoo_arguments,
)
from bench.peers import ort_session  # noqa: E402
from bench.zoo import MODELS, build_module, input_specs  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.runtime import cuda  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

PARTITIONERS = ("dnnfusion", "none")


def gpu_target() -> str:
    capability = cuda.gpu_capability()
    if capability is None:
        raise SystemExit("no NVIDIA GPU here (libcuda.so.1 found no device): run this on a GPU host")
    return f"cuda-sm{capability[0]}{capability[1]}"


def kiln_call(model: BenchModel, partitioner: str, target: str, work: Path) -> Callable:
    out = work / f"{model.name}-{partitioner}-{target}.kiln"
    if not out.exists():
        start = time.perf_counter()
        compile_artifact(model.path, out, CompileOptions(partitioner=partitioner, target=target,
                                                         shapes=model.shapes), default_store())
        print(f"  compiled {model.name} with {partitioner} for {target} in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    compiled = CompiledModel(open_artifact(out, work / "extracted" / out.stem))
    return lambda: compiled.run(**model.inputs)


def torch_call(model: BenchModel) -> Callable | None:
    """The zoo model's torch module on the GPU, or None for a model that is no zoo model."""
    if model.name not in MODELS:
        return None
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = build_module(model.name).to("cuda")
    names = [spec.name for spec in input_specs(model.name)]

    def call() -> list[np.ndarray]:
        with torch.inference_mode():
            inputs = [torch.from_numpy(model.inputs[n]).to("cuda") for n in names]
            outputs = module(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            return [o.cpu().numpy() for o in outputs]

    return call


def max_diffs(calls: dict[str, Callable], reference: list[np.ndarray]) -> dict[str, float]:
    return {name: max(float(np.max(np.abs(np.asarray(a) - b), initial=0.0))
                      for a, b in zip(call(), reference)) for name, call in calls.items()}


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--target", help="CUDA target (default: this GPU's, cuda-sm<NN>)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    target = args.target or gpu_target()
    rows, notes, speedups, fusion = [], [], [], []
    with work_folder(args.keep, "kiln-gpu-latency-") as work:
        for model in bench_models(args):
            calls: dict[str, Callable] = {}
            for partitioner in PARTITIONERS:
                try:
                    calls[partitioner] = kiln_call(model, partitioner, target, work)
                except KilnError as exc:
                    notes.append(f"{model.name} [{partitioner}]: {str(exc).splitlines()[0]}")
            torch_run = torch_call(model)
            if torch_run is not None:
                calls["torch"] = torch_run
            session = ort_session(model.path, args.threads)
            diffs = max_diffs(calls, session.run(None, model.inputs))
            ms = interleaved_medians(calls, args.rounds, args.warmup, settle_s=0.005)
            dnnf, none, peer = ms.get("dnnfusion"), ms.get("none"), ms.get("torch")
            if dnnf and peer:
                speedups.append(dnnf / peer)
            if dnnf and none:
                fusion.append(none / dnnf)
            rows.append(f"{model.name:16s} {_ms(dnnf):>10s} {_ms(none):>10s} {_ms(peer):>10s} "
                        f"{ratio(dnnf, peer):>11s} {ratio(none, dnnf):>9s} "
                        f"{diffs.get('dnnfusion', float('nan')):>10.3g} "
                        f"{diffs.get('torch', float('nan')):>10.3g}")
            print(rows[-1], file=sys.stderr)
    print(f"median latency on {target}, host arrays in and out, {args.rounds} interleaved rounds")
    print(f"{'model':16s} {'dnnf ms':>10s} {'none ms':>10s} {'torch ms':>10s} "
          f"{'dnnf/torch':>11s} {'none/dnnf':>9s} {'diff dnnf':>10s} {'diff torch':>10s}")
    print("\n".join(rows))
    if speedups:
        print(f"geomean dnnfusion / torch: {statistics.geometric_mean(speedups):.2f} over "
              f"{len(speedups)} model(s)")
    if fusion:
        print(f"geomean none / dnnfusion: {statistics.geometric_mean(fusion):.2f} over "
              f"{len(fusion)} model(s)")
    for note in notes:
        print(f"not built: {note}")
    return 0


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
