"""Small models with hand-written kernels under the kernel ABI, for testing the runtime alone."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import Kernel
from kiln.plan import FusionPlan
from kiln.plan.blocks import build_plan
from tests.graphs import ecg

CTYPES = {"float32": "float", "int64": "int64_t", "bool": "_Bool"}


def matmul_kernel(symbol: str, block: str, args: tuple[str, str, str], m: int, k: int,
                  n: int) -> Kernel:
    source = f"""#include <stdint.h>
void {symbol}(void *const *args) {{
    const float *a = args[0], *b = args[1];
    float *c = args[2];
    for (int i = 0; i < {m}; i++)
        for (int j = 0; j < {n}; j++) {{
            float acc = 0.0f;
            for (int p = 0; p < {k}; p++) acc += a[i * {k} + p] * b[p * {n} + j];
            c[i * {n} + j] = acc;
        }}
}}
"""
    return Kernel(symbol, block, source, args, (args[2],))


def elementwise_kernel(symbol: str, block: str, inputs: tuple[str, ...], output: str,
                       count: int, expr: str, dtype: str = "float32",
                       broadcast: dict[int, int] | None = None, **extra) -> Kernel:
    """out[i] = expr over x0, x1, …; `broadcast` maps an input position to its period."""
    broadcast = broadcast or {}
    ctype = CTYPES[dtype]
    loads = "\n".join(
        f"        const {ctype} x{j} = (({ctype} const *)args[{j}])[i % {broadcast[j]}];"
        if j in broadcast else f"        const {ctype} x{j} = (({ctype} const *)args[{j}])[i];"
        for j in range(len(inputs)))
    source = f"""#include <stdint.h>
#include <math.h>
static {ctype} {symbol}_op({ctype} v) {{ return v; }}
void {symbol}(void *const *args) {{
    {ctype} *out = args[{len(inputs)}];
    for (long i = 0; i < {count}; i++) {{
{loads}
        out[i] = {symbol}_op({expr});
    }}
}}
"""
    return Kernel(symbol, block, source, (*inputs, output), (output,), **extra)


@dataclass
class Handmade:
    plan: FusionPlan
    kernels: list[Kernel]
    reference: Callable[..., dict[str, np.ndarray]]  # inputs by tensor id -> outputs by tensor id


def mlp(seed: int = 0) -> Handmade:
    """y = relu(x @ W + b) and z = y * 2 (two blocks), plus x itself and a constant as outputs."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    b = rng.normal(size=(16,)).astype(np.float32)
    c = np.arange(6, dtype=np.float32).reshape(2, 3)
    shapes = {"x": (4, 8), "w": (8, 16), "b": (16,), "h": (4, 16), "y": (4, 16), "z": (4, 16),
              "c": (2, 3)}
    graph = ecg([("MatMul", ["x", "w"], ["h"]), ("Add", ["h", "b"], ["hb"]), ("Relu", ["hb"], ["y"]),
                 ("Add", ["y", "y"], ["z"])],
                shapes | {"hb": (4, 16)}, ["x"], ["y", "z", "x", "c", "y"],
                {"w": w, "b": b, "c": c})
    plan = build_plan(graph, [["op0"], ["op1", "op2"], ["op3"]], "handmade")
    kernels = [
        matmul_kernel("k0_matmul", "b0", ("x", "w", "h"), 4, 8, 16),
        elementwise_kernel("k1_fused_add_relu", "b1", ("h", "b"), "y", 64,
                           "x0 + x1 > 0.0f ? x0 + x1 : 0.0f", broadcast={1: 16}),
        elementwise_kernel("k2_add", "b2", ("y",), "z", 64, "x0 + x0"),
    ]

    def reference(x: np.ndarray) -> dict[str, np.ndarray]:
        y = np.maximum(x @ w + b, 0)
        return {"y": y, "z": y + y, "x": x, "c": c}

    return Handmade(plan, kernels, reference)


def chain(length: int, size: int = 1024) -> Handmade:
    """x → relu → relu → … (`length` blocks, one kernel each): intermediates can share space."""
    names = ["x"] + [f"t{i}" for i in range(1, length)] + ["y"]
    graph = ecg([("Relu", [names[i]], [names[i + 1]]) for i in range(length)],
                {n: (size,) for n in names}, ["x"], ["y"])
    plan = build_plan(graph, [[f"op{i}"] for i in range(length)], "none")
    kernels = [elementwise_kernel(f"k{i}_relu", f"b{i}", (names[i],), names[i + 1], size,
                                  "x0 > 0.0f ? x0 : 0.0f") for i in range(length)]
    return Handmade(plan, kernels, lambda x: {"y": np.maximum(x, 0)})
