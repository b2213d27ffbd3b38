"""AGO's intensive fusion of two matrix products (`kiln.codegen.intensive_rows`): MatMul/Gemm →
MatMul/Gemm row tile by row tile, against onnxruntime on random shapes (batch dims, ragged rows
and columns, a single row), epilogues between (bias, GELU, ReLU, a residual, a reshape); conv ↔
MatMul pairs, whose layouts do not match, stay two stages and stay right."""
from __future__ import annotations

import numpy as np
from hypothesis import given, note, settings, strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.intensive import CONV_TO_ROWS, POINTWISE, find_pairs
from kiln.codegen.microkernel import rows_evict_each_other, tile_for
from kiln.target import host_target
from tests.codegen.harness import (
    assert_matches,
    check_ago_tiles,
    intensive_stages,
    model,
    plan_for,
    reference,
    run_kernels,
)

BETWEEN = ("none", "bias", "relu", "gelu", "residual", "reshape")


def _between(nodes: list, inits: dict, x: str, kind: str, width: int, residual: str | None,
             shape: tuple[int, ...]) -> str:
    rng = np.random.default_rng(width)
    if kind in ("bias", "gelu"):
        inits["b1"] = rng.standard_normal(width).astype(np.float32)
        nodes.append(helper.make_node("Add", [x, "b1"], ["a1"]))
        x = "a1"
    if kind == "relu":
        nodes.append(helper.make_node("Relu", [x], ["r1"]))
        x = "r1"
    elif kind == "gelu":  # as the exporters write it: x · (erf(x / √2) + 1) · 0.5
        inits.update(sq=np.float32(np.sqrt(2)), one=np.float32(1), half=np.float32(0.5))
        nodes += [helper.make_node("Div", [x, "sq"], ["g1"]), helper.make_node("Erf", ["g1"], ["g2"]),
                  helper.make_node("Add", ["g2", "one"], ["g3"]), helper.make_node("Mul", [x, "g3"], ["g4"]),
                  helper.make_node("Mul", ["g4", "half"], ["g5"])]
        x = "g5"
    elif kind == "residual" and residual is not None:
        nodes.append(helper.make_node("Add", [x, residual], ["s1"]))
        x = "s1"
    elif kind == "reshape":  # GPT-2's Gemm → Reshape → activation → Reshape → Gemm
        inits["shape1"] = np.array([1, *shape], np.int64)
        inits["shape2"] = np.array(shape, np.int64)
        nodes += [helper.make_node("Reshape", [x, "shape1"], ["h1"]),
                  helper.make_node("Tanh", ["h1"], ["h2"]),
                  helper.make_node("Reshape", ["h2", "shape2"], ["h3"])]
        x = "h3"
    return x


def _product(nodes: list, inits: dict, x: str, name: str, k: int, n: int, gemm: dict | None,
             rng) -> str:
    if gemm is None:
        inits[f"w{name}"] = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [x, f"w{name}"], [name]))
        return name
    weight = rng.standard_normal((n, k) if gemm["transB"] else (k, n)) / np.sqrt(k)
    inits[f"w{name}"] = weight.astype(np.float32)
    inputs = [x, f"w{name}"]
    if gemm["bias"]:
        inits[f"c{name}"] = rng.standard_normal(n).astype(np.float32)
        inputs.append(f"c{name}")
    nodes.append(helper.make_node("Gemm", inputs, [name], transB=gemm["transB"],
                                  alpha=gemm["alpha"], beta=gemm["beta"]))
    return name


@st.composite
def row_pairs(draw):
    """MatMul (any batch dims, M = 1 included) or Gemm → ops between → MatMul or Gemm, then an
    epilogue on the downstream result."""
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    gemms = draw(st.booleans())
    batch = () if gemms else tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    m = draw(st.sampled_from([1, 2, 5, 6, 7, 13, 24, 31]))
    k1, n1, n2 = draw(st.integers(1, 40)), draw(st.integers(1, 70)), draw(st.integers(1, 40))
    kind = draw(st.sampled_from(BETWEEN))
    if kind == "residual":
        k1 = n1  # the residual is the first product's input
    if kind == "reshape" and not gemms:
        kind = "gelu"

    def gemm_attrs():
        return dict(transB=draw(st.integers(0, 1)), bias=draw(st.booleans()),
                    alpha=draw(st.sampled_from([1.0, 0.5])), beta=draw(st.sampled_from([1.0, 2.0])))

    nodes, inits = [], {}
    first = _product(nodes, inits, "x", "p1", k1, n1, gemm_attrs() if gemms else None, rng)
    mid = _between(nodes, inits, first, kind, n1, "x" if kind == "residual" else None, (m, n1))
    second = _product(nodes, inits, mid, "p2", n1, n2, gemm_attrs() if gemms else None, rng)
    if draw(st.booleans()):
        inits["b2"] = rng.standard_normal(n2).astype(np.float32)
        nodes.append(helper.make_node("Add", [second, "b2"], ["y"]))
        second = "y"
    shape = (*batch, m, k1)
    return model(nodes, {"x": (shape, "float32")}, [second], inits), shape


@settings(max_examples=40, deadline=None)
@given(case=row_pairs(), tile_bytes=st.sampled_from([1 << 11, 1 << 18]))
def test_matmul_pairs_match_onnxruntime(case, tile_bytes):
    onnx_model, shape = case
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    graph, plan, kernels = check_ago_tiles(onnx_model, x, tile_bytes)
    products = [op for op in graph.ops if op.op_type in ("MatMul", "Gemm")]
    rows = int(np.prod(shape[:-1]))
    mr = tile_for(host_target().isa, "float32").mr
    weights = [graph.tensors[op.inputs[1]].numel for op in products]
    if len(products) == 2 and len(plan.blocks) == 1 and rows >= mr and min(weights) > 1:
        up = graph.tensors[products[0].inputs[0]].shape[-1] + graph.tensors[products[0].outputs[0]].shape[-1]
        if tile_bytes == 1 << 18 and mr * up * 4 <= tile_bytes:
            assert [s["form"] for s in intensive_stages(kernels)] == [f"intensive {POINTWISE}"]


def _ffn(batch: int, seq: int, hidden: int, inner: int):
    """A BERT FFN: MatMul + bias → GELU → MatMul + bias → residual."""
    rng = np.random.default_rng(0)
    nodes, inits = [], {}
    first = _product(nodes, inits, "x", "p1", hidden, inner, None, rng)
    mid = _between(nodes, inits, first, "gelu", inner, None, (seq, inner))
    second = _product(nodes, inits, mid, "p2", inner, hidden, None, rng)
    inits["b2"] = rng.standard_normal(hidden).astype(np.float32)
    nodes += [helper.make_node("Add", [second, "b2"], ["y0"]),
              helper.make_node("Add", ["y0", "x"], ["y"])]
    return model(nodes, {"x": ((batch, seq, hidden), "float32")}, ["y"], inits)


def test_an_ffn_runs_as_one_stage_without_its_intermediate_and_off_keeps_results():
    m = _ffn(2, 24, 32, 128)
    graph = frontend.build(m, {}, "t")
    plan = plan_for(graph, "ago")
    assert plan.kernels == 1
    x = np.random.default_rng(2).standard_normal((2, 24, 32)).astype(np.float32)
    want = reference(m, {"x": x})
    fused = generate(plan, host_target())
    assert [s["form"] for s in intensive_stages(fused)] == [f"intensive {POINTWISE}"]
    assert fused[0].scratch_bytes < 2 * 24 * 128 * 4  # the 48 × 128 intermediate is not in memory
    off = generate(plan, host_target(), block_schedules={plan.blocks[0].id: {"intensive_fusion": False}})
    assert not intensive_stages(off)
    for kernels in (fused, off):
        values = run_kernels(plan, kernels, {graph.inputs[0]: x})
        assert_matches([values[t] for t in graph.outputs], want)


def test_tiles_run_in_rows_unless_their_rows_share_an_l1_set():
    """The tile's rows and intermediate are row-major, read in place by the row-reading
    micro-kernel (ConvNeXt's 96 → 384 → 96 over 3136 rows); rows 4 KiB apart (K = 1024), which
    put an AVX-512 tile's 12 rows into one L1 set, keep the panels. Both against onnxruntime, with
    a ragged last tile."""
    uk = tile_for(host_target().isa, "float32")
    for hidden, inner, seq in ((96, 384, 61), (1024, 64, 29)):
        x = np.random.default_rng(3).standard_normal((1, seq, hidden)).astype(np.float32)
        _, _, kernels = check_ago_tiles(_ffn(1, seq, hidden, inner), x, 1 << 18)
        [stage] = intensive_stages(kernels)
        evict = rows_evict_each_other(uk, hidden * 4) or rows_evict_each_other(uk, inner * 4)
        assert stage["tile_layout"] == ("panels" if evict else "rows"), (hidden, inner)


def test_a_single_row_product_is_not_fused_and_stays_right():
    m = _ffn(1, 1, 32, 128)
    graph = frontend.build(m, {}, "t")
    plan = plan_for(graph, "ago")
    kernels = generate(plan, host_target())
    assert not intensive_stages(kernels)  # one row: a micro-kernel panel would be mostly padding
    x = np.random.default_rng(3).standard_normal((1, 1, 32)).astype(np.float32)
    values = run_kernels(plan, kernels, {graph.inputs[0]: x})
    assert_matches([values[t] for t in graph.outputs], reference(m, {"x": x}))


@st.composite
def conv_matmul_pairs(draw):
    """Conv (k×k, strides, pads) → [ReLU] → Reshape (N, C, HW) → Transpose → [bias] → MatMul (a
    patch embedding into a linear layer), or MatMul → [bias] → Transpose → Reshape (N, C, H, W)
    → [ReLU] → 1×1 Conv."""
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    n, c, h, w = draw(st.integers(1, 2)), draw(st.integers(1, 20)), draw(st.integers(2, 12)), draw(st.integers(2, 12))
    d = draw(st.integers(1, 24))
    conv_first = draw(st.booleans())
    nodes, inits = [], {}
    act = draw(st.booleans())
    bias = draw(st.booleans())
    if conv_first:
        cin, k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
        pad = draw(st.integers(0, k - 1)) if k > 1 else 0
        stride = draw(st.integers(1, 2))
        hin, win = (h - 1) * stride + k - 2 * pad, (w - 1) * stride + k - 2 * pad
        if hin < 1 or win < 1:
            hin, win, pad, stride = h + k - 1, w + k - 1, 0, 1
        inits["wc"] = rng.standard_normal((c, cin, k, k)).astype(np.float32)
        inits["bc"] = rng.standard_normal(c).astype(np.float32)
        nodes.append(helper.make_node("Conv", ["x", "wc", "bc"], ["c0"], kernel_shape=[k, k],
                                      pads=[pad] * 4, strides=[stride] * 2))
        x = "c0"
        if act:
            nodes.append(helper.make_node("Relu", [x], ["c1"]))
            x = "c1"
        oh = (hin + 2 * pad - k) // stride + 1
        ow = (win + 2 * pad - k) // stride + 1
        inits["flat"] = np.array([n, c, oh * ow], np.int64)
        nodes += [helper.make_node("Reshape", [x, "flat"], ["r"]),
                  helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1])]
        x = "t"
        if bias:
            inits["bt"] = rng.standard_normal(c).astype(np.float32)
            nodes.append(helper.make_node("Add", [x, "bt"], ["t1"]))
            x = "t1"
        inits["wm"] = rng.standard_normal((c, d)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [x, "wm"], ["y"]))
        return model(nodes, {"x": ((n, cin, hin, win), "float32")}, ["y"], inits), (n, cin, hin, win)
    inits["wm"] = rng.standard_normal((d, c)).astype(np.float32)
    nodes.append(helper.make_node("MatMul", ["x", "wm"], ["m"]))
    x = "m"
    if bias:
        inits["bm"] = rng.standard_normal(c).astype(np.float32)
        nodes.append(helper.make_node("Add", [x, "bm"], ["m1"]))
        x = "m1"
    inits["image"] = np.array([n, c, h, w], np.int64)
    nodes += [helper.make_node("Transpose", [x], ["t"], perm=[0, 2, 1]),
              helper.make_node("Reshape", ["t", "image"], ["r"])]
    x = "r"
    if act:
        nodes.append(helper.make_node("Relu", [x], ["r1"]))
        x = "r1"
    out = draw(st.integers(1, 20))
    inits["wc"] = rng.standard_normal((out, c, 1, 1)).astype(np.float32)
    inits["bc"] = rng.standard_normal(out).astype(np.float32)
    nodes.append(helper.make_node("Conv", [x, "wc", "bc"], ["y"]))
    return model(nodes, {"x": ((n, h * w, d), "float32")}, ["y"], inits), (n, h * w, d)


@settings(max_examples=30, deadline=None)
@given(case=conv_matmul_pairs(), tile_bytes=st.sampled_from([1 << 12, 1 << 18]))
def test_conv_and_matmul_pairs_across_a_transposition_match_onnxruntime(case, tile_bytes):
    onnx_model, shape = case
    graph = frontend.build(onnx_model, {}, "t")
    plan = plan_for(graph, "ago")
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    overrides = {b.id: {"intensive_tile_bytes": tile_bytes} for b in plan.blocks}
    kernels = generate(plan, host_target(), block_schedules=overrides)
    values = run_kernels(plan, kernels, {graph.inputs[0]: x})
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, {"x": x}), "[ago]")
    uk = tile_for(host_target().isa, "float32")
    unit = np.lcm(uk.mr, uk.nr)
    conv = next(op for op in graph.ops if op.op_type == "Conv")
    nchw = graph.tensors[conv.outputs[0] if graph.ops[0] is conv else conv.inputs[0]].shape
    weights = [graph.tensors[op.inputs[1]].numel for op in graph.ops if len(op.inputs) > 1
               and op.op_type in ("Conv", "MatMul")]
    if (len(plan.blocks) == 1 and tile_bytes == 1 << 18 and nchw[2] * nchw[3] >= unit
            and min(weights) > 1):
        note(f"{shape} {[n.op_type for n in onnx_model.graph.node]} {nchw} {weights}")
        assert [s["form"] for s in intensive_stages(kernels)] == [f"intensive {POINTWISE}"]


def test_the_layouts_a_pair_of_a_conv_and_a_matmul_may_have():
    rng = np.random.default_rng(4)
    c, h, w = 8, 4, 6
    inits = {"wc": rng.standard_normal((c, c, 1, 1)).astype(np.float32),
             "wm": rng.standard_normal((c, c)).astype(np.float32),
             "flat": np.array([1, c, h * w], np.int64)}
    # without the Transpose, a row of the MatMul would be one channel's pixels: no pair
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"]),
             helper.make_node("Reshape", ["c", "flat"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "wm"], ["y"])]
    found = []
    for with_transpose in (True, False):
        wm = inits["wm"] if with_transpose else rng.standard_normal((h * w, c)).astype(np.float32)
        ops = nodes if with_transpose else [nodes[0], nodes[1], helper.make_node("MatMul", ["r", "wm"], ["y"])]
        m = model(ops, {"x": ((1, c, h, w), "float32")}, ["y"], {**inits, "wm": wm})
        graph = frontend.build(m, {}, "t")
        pairs = find_pairs(graph, list(graph.ops), set(graph.outputs), set(graph.outputs))
        found.append([p.layout for p in pairs.values()])
    assert found == [[CONV_TO_ROWS], []]
