"""AGO's intensive fusion (§III-B): conv → depthwise conv (Fig. 7a) and conv → pointwise conv
(Fig. 7b) in one stage, against onnxruntime on random shapes, strides, pads and dilations."""
from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings, strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.intensive import DEPTHWISE, POINTWISE, category
from kiln.plan import partitioner
from kiln.target import host_target
from tests.codegen.harness import (
    assert_matches,
    check_ago_tiles,
    intensive_stages,
    model,
    reference,
    run_kernels,
    store,
)

ACTIVATIONS = ("none", "relu6", "silu")


def _activation(nodes: list, inits: dict, x: str, kind: str, tag: str) -> str:
    if kind == "relu6":
        inits[f"lo{tag}"], inits[f"hi{tag}"] = np.float32(0), np.float32(6)
        nodes.append(helper.make_node("Clip", [x, f"lo{tag}", f"hi{tag}"], [f"a{tag}"]))
    elif kind == "silu":
        nodes += [helper.make_node("Sigmoid", [x], [f"s{tag}"]),
                  helper.make_node("Mul", [x, f"s{tag}"], [f"a{tag}"])]
    else:
        return x
    return f"a{tag}"


def _conv(nodes: list, inits: dict, x: str, name: str, weight: np.ndarray, bias: bool, **attrs) -> str:
    inits[f"w{name}"] = weight
    inputs = [x, f"w{name}"]
    if bias:
        inits[f"b{name}"] = np.random.default_rng(len(inits)).standard_normal(weight.shape[0]).astype(np.float32)
        inputs.append(f"b{name}")
    nodes.append(helper.make_node("Conv", inputs, [name], **attrs))
    return name


@st.composite
def pairs(draw):
    """An upstream conv (pointwise, general k×k or depthwise), elementwise ops, then a downstream
    depthwise or pointwise conv."""
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    n, cin = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    h, w = draw(st.integers(3, 11)), draw(st.integers(3, 11))
    up = draw(st.sampled_from(["pointwise", "general", "depthwise"]))
    down = draw(st.sampled_from([DEPTHWISE, POINTWISE]))
    nodes, inits = [], {}

    size = [h, w]

    def window():
        k = draw(st.integers(1, 3))
        attrs = dict(kernel_shape=[k, k], strides=[draw(st.integers(1, 2))] * 2,
                     dilations=[draw(st.integers(1, 2))] * 2,
                     pads=[draw(st.integers(0, k - 1 if k > 1 else 0)) for _ in range(4)])
        for d in range(2):
            span = (k - 1) * attrs["dilations"][d] + 1
            size[d] = (size[d] + attrs["pads"][d] + attrs["pads"][d + 2] - span) // attrs["strides"][d] + 1
            assume(size[d] >= 1)
        return attrs

    if up == "depthwise":
        mid, attrs = cin, window()
        weight = rng.standard_normal((mid, 1, *attrs["kernel_shape"])).astype(np.float32)
        attrs["group"] = cin
    elif up == "general":
        mid, attrs = draw(st.integers(1, 20)), window()
        weight = rng.standard_normal((mid, cin, *attrs["kernel_shape"])).astype(np.float32)
    else:
        mid, attrs = draw(st.integers(1, 20)), {}
        weight = rng.standard_normal((mid, cin, 1, 1)).astype(np.float32)
    first = _conv(nodes, inits, "x", "c1", weight, draw(st.booleans()), **attrs)
    between = _activation(nodes, inits, first, draw(st.sampled_from(ACTIVATIONS)), "1")
    if down == DEPTHWISE:
        attrs = window()
        attrs["group"] = mid
        weight = rng.standard_normal((mid, 1, *attrs["kernel_shape"])).astype(np.float32)
    else:
        attrs = {}
        weight = rng.standard_normal((draw(st.integers(1, 20)), mid, 1, 1)).astype(np.float32)
    second = _conv(nodes, inits, between, "c2", weight, draw(st.booleans()), **attrs)
    out = _activation(nodes, inits, second, draw(st.sampled_from(ACTIVATIONS)), "2")
    return model(nodes, {"x": ((n, cin, h, w), "float32")}, [out], inits), (n, cin, h, w), down


@settings(max_examples=25, deadline=None)
@given(case=pairs(), tile_bytes=st.sampled_from([1 << 12, 1 << 18]))
def test_intensive_pairs_match_onnxruntime(case, tile_bytes):
    onnx_model, shape, down = case
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    graph, plan, kernels = check_ago_tiles(onnx_model, x, tile_bytes)
    convs = [op for op in graph.ops if op.op_type == "Conv"]
    mid = graph.tensors[convs[0].outputs[0]]
    weights = [graph.tensors[op.inputs[1]].numel for op in convs]
    wide = mid.shape[2] * mid.shape[3] >= 32  # a micro-kernel panel of pixels, on any ISA
    if tile_bytes == 1 << 18 and mid.shape[1] > 1 and min(weights) > 1 and wide:  # any tile fits
        stages = intensive_stages(kernels)
        assert stages and stages[0]["form"] == f"intensive {down}"


def test_the_paper_categories_of_the_downstream_op():
    nodes, inits = [], {}
    rng = np.random.default_rng(0)
    x = _conv(nodes, inits, "x", "dw", rng.standard_normal((8, 1, 3, 3)).astype(np.float32), False,
              group=8, pads=[1, 1, 1, 1])
    x = _conv(nodes, inits, x, "pw", rng.standard_normal((4, 8, 1, 1)).astype(np.float32), False)
    _conv(nodes, inits, x, "full", rng.standard_normal((4, 4, 3, 3)).astype(np.float32), False)
    graph = frontend.build(model(nodes, {"x": ((1, 8, 6, 6), "float32")}, ["full"], inits), {}, "t")
    kinds = [category(op, graph) for op in graph.ops]
    assert kinds == [DEPTHWISE, POINTWISE, None]  # a 3×3 conv reuses along O, H and W


def test_the_intermediate_never_reaches_memory_and_turning_it_off_keeps_results():
    nodes, inits = [], {}
    rng = np.random.default_rng(0)
    x = _conv(nodes, inits, "x", "pw", rng.standard_normal((24, 8, 1, 1)).astype(np.float32), True)
    x = _activation(nodes, inits, x, "relu6", "1")
    x = _conv(nodes, inits, x, "dw", rng.standard_normal((24, 1, 3, 3)).astype(np.float32), True,
              group=24, pads=[1, 1, 1, 1])
    m = model(nodes, {"x": ((1, 8, 16, 16), "float32")}, [x], inits)
    graph = frontend.build(m, {}, "t")
    plan = partitioner("ago")(graph, store())
    assert plan.kernels == 1
    x_value = np.random.default_rng(2).standard_normal((1, 8, 16, 16)).astype(np.float32)
    want = reference(m, {"x": x_value})
    fused = generate(plan, host_target())
    assert [s["form"] for s in intensive_stages(fused)] == ["intensive depthwise"]
    # 24 × 16 × 16 floats would be 24 KiB of scratch; the tiles live on the stack instead
    assert fused[0].scratch_bytes < 24 * 16 * 16 * 4
    off = generate(plan, host_target(), block_schedules={plan.blocks[0].id: {"intensive_fusion": False}})
    assert not intensive_stages(off)
    for kernels in (fused, off):
        values = run_kernels(plan, kernels, {graph.inputs[0]: x_value})
        assert_matches([values[t] for t in graph.outputs], want)
