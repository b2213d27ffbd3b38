"""Convs run as the transposed GEMM, output pixels as rows (`kiln.codegen.ops.conv._by_pixels`),
against onnxruntime: a bias and a call-free epilogue (ReLU, Clip, a residual added) go through
the GEMM's tile epilogue straight into the output, with no pass of their own; one that calls a
function (SiLU's exp) keeps the vectorised pass over the raw sums. 1 × 1 convs onto 7 × 7 and
ragged images with channel counts that are no whole panels, batches of 2, and strided 3 × 3
convs whose im2col is packed, grouped too."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.target import target
from tests.codegen.harness import (
    assert_matches,
    model,
    plan_for,
    random_inputs,
    reference,
    run_kernels,
)

# The cost model picks among conv kernels by vector width: these cases are the choices of an
# AVX2 machine (8 lanes). The code runs on any x86-64 host with AVX2, AVX-512 ones included.
AVX2 = target("x86_64")

PASS = "bias and epilogue of"


def _conv_model(n, cin, size, cout, kernel, stride, group, tail, seed=5):
    rng = np.random.default_rng(seed)
    pad = kernel // 2
    oh, ow = ((s + 2 * pad - kernel) // stride + 1 for s in size)
    spec = {"x": ((n, cin, *size), "float32")}
    constants = {"w": rng.standard_normal((cout, cin // group, kernel, kernel)).astype(np.float32),
                 "b": rng.standard_normal(cout).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel],
                              pads=[pad] * 4, strides=[stride, stride], group=group)]
    if tail == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif tail == "clip":
        constants.update(lo=np.array(0.0, np.float32), hi=np.array(6.0, np.float32))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif tail == "residual":
        spec["r"] = ((n, cout, oh, ow), "float32")
        nodes += [helper.make_node("Add", ["c", "r"], ["s"]),
                  helper.make_node("Relu", ["s"], ["y"])]
    elif tail == "silu":
        nodes += [helper.make_node("Sigmoid", ["c"], ["g"]),
                  helper.make_node("Mul", ["c", "g"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    return model(nodes, spec, ["y"], constants), spec


def _stages(onnx_model, spec) -> list[str]:
    """Runs the model's kernels (dnnfusion), checks them against onnxruntime, returns the
    names of their stages."""
    inputs = random_inputs(spec)
    graph = frontend.build(onnx_model, {}, "t")
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, AVX2)
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
    return [(s["stage"], s.get("conv")) for k in kernels for s in k.schedule["stages"]]


CASES = [  # (batch, in channels, image, out channels, kernel, stride, groups)
    (1, 960, (7, 7), 160, 1, 1, 1),
    (2, 160, (7, 7), 328, 1, 1, 1),  # 328 channels: the last panel 8 wide
    (2, 200, (5, 9), 250, 1, 1, 1),  # 45 pixels
    (1, 64, (14, 14), 256, 3, 2, 1),  # onto 7 × 7, the im2col packed
    (2, 32, (4, 4), 300, 3, 2, 2),  # 150 channels a group onto 2 × 2: each its own bias
]


@pytest.mark.parametrize("tail", ["relu", "clip", "residual", "none", "silu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_pixel_rows_gemm_epilogue(case, tail):
    stages = _stages(*_conv_model(*case, tail))
    assert any(conv and "pixels as rows" in conv for _, conv in stages), stages
    has_pass = any(name.startswith(PASS) for name, _ in stages)
    assert has_pass == (tail == "silu"), stages
