"""Attention blocks alone: Kiln's kernel for the attention of each zoo transformer against
onnxruntime and OpenVINO on the same subgraph, side by side.

Each model here is one attention block as the zoo's exports have it (batch 1): Q packed as
[B, L, H·D] (Reshape + Transpose in the graph), Kᵀ [B, H, D, L] and V [B, H, L, Dv] as inputs,
scores scaled by 1/√D, the block's mask, Softmax, ·V, and the output back as [B, L, H·Dv]:

    swin-s1     64 windows × 3 heads, 49 × 49, D 32, relative-position bias and shift mask
    swin-s3      4 windows × 12 heads, 49 × 49, D 32, relative-position bias
    vit-base    12 heads, 197 × 197, D 64, no mask
    bert-base   12 heads, 128 × 128, D 64, padding mask [B, 1, 1, L]
    gpt2        12 heads, 128 × 128, D 64, causal mask
    mobilebert   4 heads, 128 × 128, D 32, padding mask

Kiln's artifact is compiled with dnnfusion (a fused attention stage); `--baseline DIR` adds the
artifacts `DIR/<name>-dnnfusion.kiln` that another Kiln version compiled from the same models
(run this script there with `--keep DIR`), so both kernels are timed in one process. Medians
over interleaved rounds with a pause before each timed call (`bench.latency`).

    python bench/attention.py [--blocks swin-s1,bert-base] [--baseline DIR] [--keep DIR]
                              [--threads 2] [--rounds 30]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import (  # noqa: E402
    BenchModel,
    contenders,
    interleaved_medians,
    max_diff,
    work_folder,
)
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

CAUSAL, ADDITIVE, BOOLEAN, BIAS = "causal", "additive", "boolean", "bias"
BLOCKS = {  # name: (batch, heads, q_len, kv_len, head, value, mask)
    "swin-s1": (64, 3, 49, 49, 32, 32, BIAS),
    "swin-s3": (4, 12, 49, 49, 32, 32, BIAS),
    "vit-base": (1, 12, 197, 197, 64, 64, None),
    "bert-base": (1, 12, 128, 128, 64, 64, ADDITIVE),
    "gpt2": (1, 12, 128, 128, 64, 64, CAUSAL),
    "mobilebert": (1, 4, 128, 128, 32, 32, ADDITIVE),
}


def attention_model(batch: int, heads: int, q_len: int, kv_len: int, head: int, value: int,
                    mask: str | None, packed_q: bool = True, transpose_k: bool = False,
                    seed: int = 0, outputs: Sequence[str] = ("y",)
                    ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(model, inputs) of one attention block. Q is [B, H, Lq, D], or packed [B, Lq, H·D] with a
    Reshape and a Transpose; K is Kᵀ [B, H, D, Lk], or K [B, H, Lk, D] with a Transpose. The
    scores ("s") are scaled by 1/√D, then masked: `additive` a padding mask input [B, 1, 1, Lk]
    (0 or -1e4), `boolean` a Where on a [B, 1, Lq, Lk] input, `causal` a constant (0 or -inf,
    the last query row seeing every key), `bias` a constant [B, H, Lq, Lk]; Softmax gives "p",
    and "y" is p·V [B, H, Lk, Dv] as [B, Lq, H·Dv]."""
    rng = np.random.default_rng(seed)
    spec: dict[str, tuple[tuple[int, ...], str]] = {}
    inits: dict[str, np.ndarray] = {"scale": np.array(1 / np.sqrt(head), np.float32)}
    nodes = []
    if packed_q:
        spec["x"] = ((batch, q_len, heads * head), "float32")
        inits["qshape"] = np.array([batch, q_len, heads, head], np.int64)
        nodes += [helper.make_node("Reshape", ["x", "qshape"], ["q4"]),
                  helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3])]
    else:
        spec["q"] = ((batch, heads, q_len, head), "float32")
    if transpose_k:
        spec["k"] = ((batch, heads, kv_len, head), "float32")
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    else:
        spec["kt"] = ((batch, heads, head, kv_len), "float32")
    spec["v"] = ((batch, heads, kv_len, value), "float32")
    nodes += [helper.make_node("MatMul", ["q", "kt"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["scaled"])]
    scores = "scaled"
    if mask == ADDITIVE:
        spec["m"] = ((batch, 1, 1, kv_len), "float32")
        nodes.append(helper.make_node("Add", ["scaled", "m"], ["masked"]))
    elif mask == BOOLEAN:
        spec["keep"] = ((batch, 1, q_len, kv_len), "bool")
        inits["low"] = np.array(-1e9, np.float32)
        nodes.append(helper.make_node("Where", ["keep", "scaled", "low"], ["masked"]))
    elif mask == CAUSAL:
        allowed = np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len)
        inits["causal"] = np.where(allowed, 0, -np.inf).astype(np.float32)[None, None]
        nodes.append(helper.make_node("Add", ["scaled", "causal"], ["masked"]))
    elif mask == BIAS:
        inits["bias"] = rng.standard_normal((batch, heads, q_len, kv_len)).astype(np.float32)
        nodes.append(helper.make_node("Add", ["scaled", "bias"], ["masked"]))
    if mask is not None:
        scores = "masked"
    inits["oshape"] = np.array([batch, q_len, heads * value], np.int64)
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "oshape"], ["y"])]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), s)
         for n, (s, d) in spec.items()],
        [], [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.extend(inferred[o] for o in outputs)
    inputs = {name: (rng.random(shape) < 0.8 if dtype == "bool"
                     else rng.standard_normal(shape).astype(dtype))
              for name, (shape, dtype) in spec.items()}
    if mask == ADDITIVE:
        inputs["m"] = np.where(rng.random(inputs["m"].shape) < 0.2, -1e4, 0).astype(np.float32)
    return model, inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=",".join(BLOCKS),
                        help=f"comma-separated blocks (default all: {', '.join(BLOCKS)})")
    parser.add_argument("--baseline", type=Path,
                        help="folder of artifacts another Kiln compiled with --keep")
    parser.add_argument("--keep", type=Path, help="write models and artifacts here, reuse them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    names = [n for n in args.blocks.split(",") if n]
    unknown = sorted(set(names) - set(BLOCKS))
    if unknown:
        parser.error(f"--blocks: unknown {', '.join(unknown)}")
    print(f"median µs, {args.threads} threads, {args.rounds} interleaved rounds")
    header = f"{'block':12s} {'kiln':>10s} {'baseline':>10s} {'ort':>10s} {'openvino':>10s} " \
             f"{'kiln/base':>9s} {'kiln/ort':>8s} {'kiln/ov':>8s} {'max|diff|':>10s}"
    print(header)
    with work_folder(args.keep, "kiln-attention-") as work:
        for name in names:
            onnx_model, inputs = attention_model(*BLOCKS[name])
            path = work / f"attention-{name}.onnx"
            onnx.save(onnx_model, path)
            calls, failures = contenders(BenchModel(name, path, inputs), args.threads, work)
            calls.pop("none", None)
            if args.baseline is not None:
                artifact = args.baseline / f"{name}-dnnfusion.kiln"
                baseline = CompiledModel(open_artifact(artifact, work / "baseline" / name),
                                         args.threads)
                calls["baseline"] = lambda b=baseline: b.run(**inputs)
            diffs = max_diff(calls)
            medians = interleaved_medians(calls, args.rounds, args.warmup)
            us = {k: v * 1e3 for k, v in medians.items()}
            kiln = us.get("dnnfusion")
            print(f"{name:12s} " + " ".join(f"{us[k]:10.1f}" if k in us else f"{'-':>10s}"
                                             for k in ("dnnfusion", "baseline", "ort", "ov"))
                  + "".join(f" {kiln / us[k]:{w}.2f}" if kiln and k in us else f" {'-':>{w}s}"
                            for k, w in (("baseline", 9), ("ort", 8), ("ov", 8)))
                  + f" {diffs.get('dnnfusion', float('nan')):10.2g}", flush=True)
            for contender, reason in failures.items():
                print(f"  not built: {contender}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
